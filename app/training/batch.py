"""Micro-batch planning: CUDA OOM back-off and auto batch size at a fixed effective batch.

Threat-model cases 24 and 25 (``threats-and-faults.md`` §7):

* **OOM before the first optimizer step** (a micro-batch that does not fit): the micro-batch is cut to
  the largest divisor of the effective batch that is at most half of it, and gradient accumulation
  grows so that ``micro x accumulation`` (the effective batch per process) is unchanged. The model is
  reloaded and the step retried, at most ``training.gpu.oom_retries`` times. Each change is reported
  (``on_change``: the pipeline records a ``train.batch`` audit event and the manifest lists it). An OOM
  after the first step is not retried here: the run stops with a training error and resumes from its
  last checkpoint on the next start (where the same back-off applies to its first step).
* **OOM in evaluation**: only the eval micro-batch is halved; the train batch never changes
  (transformers' ``auto_find_batch_size`` shrinks the train batch on an eval OOM, #32215, and never
  adjusts gradient accumulation).
* **auto batch size** (``training.gpu.auto_batch_size``): start at micro-batch = effective batch
  (accumulation 1) and back off the same way: the first micro-batch that fits is the largest one.

Same examples per optimizer step either way: the sampler's order is unchanged and each optimizer step
still sums the loss over the same ``effective`` examples (TRL normalises by the tokens of the whole
accumulated batch), so a backed-off run matches a run configured with the smaller micro-batch.

Import-light: torch/transformers/accelerate are imported inside the functions that need them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from app.errors import TrainingError

if TYPE_CHECKING:
    from app.config import TrainingSettings

T = TypeVar("T")
Record = dict[str, Any]
OnChange = Callable[[Record], None]

OOM_FIX = ("lower training.per_device_batch_size (or set training.gpu.auto_batch_size: true), raise "
           "training.gpu.oom_retries, or set training.gpu.quantization: 4bit; the run resumes from its last checkpoint")


@dataclass(frozen=True)
class BatchPlan:
    """Micro-batch sizes of one training attempt (per process).

    Attributes:
        micro: Train micro-batch (``per_device_train_batch_size``).
        accumulation: Gradient accumulation steps.
        eval_micro: Eval micro-batch (``per_device_eval_batch_size``).
    """

    micro: int
    accumulation: int
    eval_micro: int

    @property
    def effective(self) -> int:
        """Examples per optimizer step in one process (x world size across processes)."""
        return self.micro * self.accumulation

    def next_train(self) -> BatchPlan | None:
        """The plan after a train OOM: largest divisor of the effective batch <= micro // 2, or None at 1."""
        target = self.micro // 2
        for d in range(target, 0, -1):
            if self.effective % d == 0:
                return replace(self, micro=d, accumulation=self.effective // d)
        return None

    def next_eval(self) -> BatchPlan | None:
        """The plan after an eval OOM: eval micro-batch halved, or None at 1."""
        return replace(self, eval_micro=self.eval_micro // 2) if self.eval_micro > 1 else None

    def to_json(self) -> dict[str, int]:
        return {"micro": self.micro, "accumulation": self.accumulation, "eval_micro": self.eval_micro}


def initial_plan(s: TrainingSettings) -> BatchPlan:
    """The first attempt's plan: the configured sizes, or micro = effective batch with auto batch size."""
    eval_micro = s.per_device_eval_batch_size or s.per_device_batch_size
    effective = s.per_device_batch_size * s.gradient_accumulation_steps
    if s.gpu.auto_batch_size:
        return BatchPlan(micro=effective, accumulation=1, eval_micro=eval_micro)
    return BatchPlan(micro=s.per_device_batch_size, accumulation=s.gradient_accumulation_steps, eval_micro=eval_micro)


def retry_budget(s: TrainingSettings) -> int:
    """How many train back-offs are allowed: oom_retries, or every candidate when probing (auto batch size)."""
    if s.gpu.auto_batch_size:
        effective = s.per_device_batch_size * s.gradient_accumulation_steps
        return max(s.gpu.oom_retries, sum(1 for d in range(1, effective) if effective % d == 0))
    return s.gpu.oom_retries


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA/accelerator out-of-memory error, also when wrapped (``__cause__``/``__context__``)."""
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError) or (isinstance(current, Exception) and should_reduce_batch_size(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


class OutOfMemory(TrainingError):
    """One attempt ran out of accelerator memory (internal: :func:`run_with_backoff` decides what happens)."""

    default_fix = OOM_FIX

    def __init__(self, message: str, *, phase: str, first_step: bool, at_step: int) -> None:
        super().__init__(message)
        self.phase = phase
        self.first_step = first_step
        self.at_step = at_step


def adjustment(phase: str, reason: str, at_step: int, before: BatchPlan, after: BatchPlan) -> Record:
    """The record of one change: audit ``train.batch`` data and a manifest ``training.batch.adjustments`` item."""
    return {"phase": phase, "reason": reason, "at_step": at_step, "from": before.to_json(), "to": after.to_json()}


def free_memory() -> None:
    """Drop what an OOM'd attempt left behind (call outside the ``except`` block so its frames are gone)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_with_backoff(plan: BatchPlan, attempt: Callable[[BatchPlan], T], *, retries: int, probing: bool,
                     on_change: OnChange | None) -> tuple[T, BatchPlan, list[Record]]:
    """Run ``attempt(plan)``; on :class:`OutOfMemory` at the first step retry with a smaller plan.

    Args:
        plan: The first plan (:func:`initial_plan`).
        attempt: Loads, builds the trainer and trains with the given plan; raises :class:`OutOfMemory`.
        retries: Train back-offs allowed (:func:`retry_budget`); eval back-offs stop at micro-batch 1.
        probing: Auto batch size (records reason ``auto`` instead of ``oom``).
        on_change: Called with each adjustment record before the retry.

    Returns:
        ``(attempt's result, the plan that worked, the adjustment records)``.

    Raises:
        TrainingError: an OOM after the first step, or no smaller plan / retry left.
    """
    records: list[Record] = []
    train_backoffs = 0
    while True:
        try:
            return attempt(plan), plan, records
        except OutOfMemory as exc:
            phase, first, at_step = exc.phase, exc.first_step, exc.at_step
        nxt = plan.next_eval() if phase == "eval" else plan.next_train()
        if phase == "train" and not first:
            raise TrainingError(f"CUDA out of memory at optimizer step {at_step + 1} with micro-batch {plan.micro} "
                                "(not the first step: not retried in this process)", fix=OOM_FIX)
        if nxt is None or (phase == "train" and train_backoffs >= retries):
            what = "eval micro-batch" if phase == "eval" else "micro-batch"
            raise TrainingError(f"CUDA out of memory in {phase} with {what} "
                                f"{plan.eval_micro if phase == 'eval' else plan.micro} after {len(records)} back-off(s)",
                                fix=OOM_FIX)
        train_backoffs += phase == "train"
        record = adjustment(phase, "auto" if probing and phase == "train" else "oom", at_step, plan, nxt)
        records.append(record)
        free_memory()
        if on_change is not None:
            on_change(record)
        plan = nxt


def step_watch() -> Any:
    """A TrainerCallback counting the optimizer steps completed in this attempt (``.steps``)."""
    from transformers import TrainerCallback

    class _StepWatch(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps = 0
            self.last_step = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last_step = int(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.steps += 1
            self.last_step = int(state.global_step)

    return _StepWatch()


def guard_eval(trainer: Any, plan: list[BatchPlan], records: list[Record], on_change: OnChange | None, *,
               retry: bool) -> None:
    """Make an eval OOM change only the eval micro-batch, never the train batch.

    Args:
        trainer: The HF/TRL trainer (its bound ``evaluate`` is replaced on the instance, which is what
            ``Trainer._evaluate`` calls).
        plan: One-element list holding the current plan; updated in place.
        records: Adjustment records of this run; appended to.
        on_change: Called with each adjustment record.
        retry: Single process: halve the eval micro-batch and evaluate again. Several processes
            (DDP, the other ranks are inside the same collective): raise :class:`OutOfMemory` with
            phase ``eval`` so the launcher restarts all of them with a smaller eval micro-batch.
    """
    original = trainer.evaluate

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                if not retry:
                    raise OutOfMemory("CUDA out of memory in evaluation", phase="eval", first_step=False,
                                      at_step=int(trainer.state.global_step)) from exc
                nxt = plan[0].next_eval()
                if nxt is None:
                    raise TrainingError("CUDA out of memory in evaluation with eval micro-batch 1", fix=OOM_FIX) from exc
            free_memory()
            record = adjustment("eval", "oom", int(trainer.state.global_step), plan[0], nxt)
            trainer.args.per_device_eval_batch_size = nxt.eval_micro
            plan[0] = nxt
            records.append(record)
            if on_change is not None:
                on_change(record)

    trainer.evaluate = evaluate


def summary(final: BatchPlan, configured: TrainingSettings, world: int, records: list[Record]) -> dict[str, Any]:
    """``TrainResult.batch`` / manifest ``training.batch``: what was configured, what ran, and every change."""
    return {
        "configured": {"micro": configured.per_device_batch_size, "accumulation": configured.gradient_accumulation_steps,
                       "auto": configured.gpu.auto_batch_size},
        "final": final.to_json(),
        "processes": world,
        "effective": final.effective * world,
        "adjustments": [dict(r) for r in records],
    }


__all__ = ["BatchPlan", "OutOfMemory", "adjustment", "free_memory", "guard_eval", "initial_plan", "is_oom",
           "retry_budget", "run_with_backoff", "step_watch", "summary"]
