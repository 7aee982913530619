"""Differential privacy for the adapter: DP-SGD with Opacus on the LoRA parameters.

``training.privacy.mode: dp-sgd`` changes four things in the HF backend (``backend.py`` asks this
module for a trainer class; nothing else there knows about DP):

1. **Sampling**: each optimizer step trains on a Poisson sample of the N rows (every row joins
   independently with probability ``q = effective batch / N``), drawn from a generator seeded by the
   OS (not ``training.seed``: amplification by subsampling needs the batch membership to be secret).
   The logical batch is split into micro-batches of ``per_device_batch_size`` inside one step.
2. **Per-example gradients**: Opacus' ``GradSampleModule`` hooks the trainable (LoRA) layers; the
   loss is the sum of per-example mean token losses, so an example's gradient depends on that
   example only (HF's token-mean over the whole batch would mix examples).
3. **Clipping and noise**: ``DPOptimizer`` clips every example's gradient to L2 norm ``C``
   (``max_grad_norm``, over all LoRA parameters), sums, adds N(0, (sigma C)^2) noise from a
   generator seeded by the OS, and divides by the expected batch size. An empty sample still
   takes a step (noise only), as the analysis assumes.
4. **Accounting**: an Opacus accountant (``rdp`` or ``prv``) records (sigma, q) at every optimizer
   step; its history is written into every checkpoint (``privacy_state.json``, sealed with the
   rest) and restored on resume, so a run killed and resumed spends what an uninterrupted run
   spends. The run stops at a step boundary (and exports) when the next step would exceed the plan.

:func:`plan` derives sigma (Opacus ``get_noise_multiplier``) or checks a configured one, and refuses
up front (exit 2) what cannot fit. Unsloth is not supported: its fused LoRA autograd functions
bypass the module hooks Opacus needs, so ``backend: auto`` trains with the HF backend under DP.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attestation.privacy.dp import accountant_epsilon

from app.errors import ConfigError, TrainingError

if TYPE_CHECKING:
    from app.config import TrainingSettings

logger = logging.getLogger(__name__)

STATE_FILE = "privacy_state.json"  # in every checkpoint directory (sealed with the trainer's files)
STATE_SCHEMA = "cvm-tune/privacy-state/v1"
# The HF trainer sees one logical (Poisson) batch per optimizer step and must not clip the aggregate itself.
SFT_ARGS: dict[str, Any] = {"gradient_accumulation_steps": 1, "max_grad_norm": 0.0}
_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids")
_fallback_said = False  # the Unsloth -> hf message is logged once per process


@dataclass(frozen=True)
class PrivacyPlan:
    """The DP-SGD parameters of one run (fixed before training; recorded in the manifest)."""

    noise_multiplier: float
    noise_derived: bool
    max_grad_norm: float
    sample_rate: float
    expected_batch_size: int
    rows: int
    max_steps: int
    target_epsilon: float
    delta: float
    accountant: str
    planned_epsilon: float


def default_delta(rows: int) -> float:
    """delta when ``target_delta`` is unset: 1/N^2 (far below 1/N, the level at which publishing one row outright
    would still be "private")."""
    return 1.0 / float(rows) ** 2


def epsilon(accountant: str, history: list[tuple[float, float, int]], delta: float) -> float:
    """epsilon spent at ``delta`` by ``history`` [(sigma, q, steps)], as the Opacus accountant computes it
    (the verifier's own recomputation: the manifest records what this returns)."""
    return accountant_epsilon(accountant, history, delta)


def backend_for(s: TrainingSettings, selected: str) -> str:
    """The backend to train with: ``hf`` under DP where ``auto`` selected Unsloth (said once, in the log), whose fused
    LoRA kernels bypass the module hooks Opacus needs for per-example gradients; else ``selected``."""
    global _fallback_said
    if s.privacy.mode == "off" or selected != "unsloth":
        return selected
    if not _fallback_said:
        logger.warning("training.privacy dp-sgd: training with the hf backend (transformers + PEFT) instead of Unsloth, "
                       "whose fused LoRA kernels bypass the per-example gradient hooks Opacus needs; gradient "
                       "checkpointing is off under DP, so expect more GPU memory and lower throughput")
        _fallback_said = True
    return "hf"


def plan(s: TrainingSettings, *, rows: int) -> PrivacyPlan | None:
    """The run's DP-SGD plan (``None`` when ``training.privacy.mode`` is off), fixed before anything is written.

    Args:
        s: Training settings.
        rows: N, the rows training samples from (after deduplication and the token policy).

    Raises:
        ConfigError: delta not below 1/N, an effective batch larger than N, or max_steps that do not fit
            target_epsilon with the configured noise multiplier.
    """
    p = s.privacy
    if p.mode == "off":
        return None
    batch = s.per_device_batch_size * s.gradient_accumulation_steps
    if rows < 2 or batch > rows:
        raise ConfigError(f"training.privacy: the effective batch ({batch}) must not exceed the {rows} training rows",
                          fix="lower training.per_device_batch_size or gradient_accumulation_steps, or add rows")
    delta = p.target_delta if p.target_delta is not None else default_delta(rows)
    if not delta < 1.0 / rows:
        raise ConfigError(f"training.privacy.target_delta {delta:g} is not below 1/N = 1/{rows} (N: rows after "
                          "deduplication): a delta that large allows publishing a row outright",
                          fix=f"set training.privacy.target_delta below {1.0 / rows:.3g}, or leave it unset (1/N^2)")
    q = batch / rows
    sigma, derived = p.noise_multiplier, False
    if sigma is None:
        try:
            sigma = derive_noise_multiplier(p.target_epsilon, delta, q, s.max_steps, p.accountant)
        except ValueError as exc:
            raise ConfigError(f"training.privacy: no noise multiplier fits {s.max_steps} steps into epsilon "
                              f"{p.target_epsilon:g}: {exc}", fix="raise target_epsilon or lower max_steps") from exc
        derived = True
    try:
        planned = epsilon(p.accountant, [(sigma, q, s.max_steps)], delta)
    except ValueError as exc:  # out of the accountant's bounds (prv: too many steps for its mesh) or not computable
        raise ConfigError(f"training.privacy: the {p.accountant} accountant cannot account for {s.max_steps} steps at "
                          f"noise multiplier {sigma:g}, sample rate {q:.4g} and delta {delta:.3g}: {exc}",
                          fix="use training.privacy.accountant: rdp, or lower training.max_steps") from exc
    if planned > p.target_epsilon:
        raise ConfigError(f"training.max_steps {s.max_steps} cannot fit the privacy budget: with noise multiplier "
                          f"{sigma:g} and sample rate {q:.4g} they spend epsilon {planned:.3f} > target_epsilon "
                          f"{p.target_epsilon:g} (delta {delta:.3g})",
                          fix="lower training.max_steps, raise training.privacy.noise_multiplier, or unset it "
                          "(derived from the target)")
    return PrivacyPlan(noise_multiplier=sigma, noise_derived=derived, max_grad_norm=p.max_grad_norm, sample_rate=q,
                       expected_batch_size=batch, rows=rows, max_steps=s.max_steps, target_epsilon=p.target_epsilon,
                       delta=delta, accountant=p.accountant, planned_epsilon=planned)


def derive_noise_multiplier(target: float, delta: float, q: float, steps: int, accountant: str,
                            tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (within ``tolerance`` of ``target`` in epsilon) that spends at most ``target``:
    Opacus' ``get_noise_multiplier`` search, with every evaluation through the bounded :func:`epsilon` (a sigma the
    accountant refuses or cannot compute counts as over the budget, so the search moves to more noise).

    Raises:
        ValueError: no sigma up to Opacus' MAX_SIGMA (1e6) fits, or the accountant refuses even that one.
    """
    def spend(sigma: float) -> float:
        try:
            return epsilon(accountant, [(sigma, q, steps)], delta)
        except ValueError:
            return math.inf

    low, high, eps_high = 0.0, 10.0, math.inf
    while eps_high > target:
        high *= 2
        if high > 1e6:
            raise ValueError(f"the privacy budget is too low: no noise multiplier up to 1e6 fits (or the {accountant} "
                             "accountant cannot account for these steps)")
        eps_high = spend(high)
    while target - eps_high > tolerance:
        mid = (low + high) / 2
        eps = spend(mid)
        if eps < target:
            high, eps_high = mid, eps
        else:
            low = mid
        if high - low < 1e-12 * high:  # converged without reaching the tolerance (the accountant is coarse here)
            break
    return high


def _secret_generator(device: Any) -> Any:
    """A torch generator seeded by the OS: noise and sampling must not be reproducible from the (public) config."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return gen


def per_example_loss(model: Any, batch: Mapping[str, Any]) -> Any:
    """Mean token cross-entropy of each example (shape ``[batch]``); labels ``-100`` are ignored."""
    import torch.nn.functional as F

    logits = model(**{k: batch[k] for k in _FORWARD_KEYS if k in batch}, use_cache=False).logits
    labels = batch["labels"][:, 1:]
    tok = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    mask = labels != -100
    return (tok * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def make_private(model: Any, optimizer: Any, dp: PrivacyPlan, *, device: Any, on_step: Any = None) -> Any:
    """Hook ``model``'s trainable layers for per-example gradients and wrap ``optimizer`` in a DP optimizer.

    The hooks sit on the trainable submodules, so ``model`` itself is used unchanged. The returned
    optimizer clips each example to ``max_grad_norm``, adds Gaussian noise from an OS-seeded generator
    and averages over the *expected* batch size (also when one step's sample is split into micro-batches).
    """
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    class _StepDPOptimizer(DPOptimizer):  # type: ignore[misc]
        def scale_grad(self) -> None:  # one Poisson sample per step, however many micro-batches it took
            for p in self.params:
                p.grad /= self.expected_batch_size

        def step(self, closure: Any = None) -> Any:
            out = super().step(closure)
            for p in self.params:  # the HF trainer zeroes the model's grads, not the optimizer's per-example ones
                p.grad_sample = p.summed_grad = None
            return out

    GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
    opt = _StepDPOptimizer(optimizer, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                           expected_batch_size=dp.expected_batch_size, loss_reduction="sum",
                           generator=_secret_generator(device))
    if on_step is not None:
        opt.attach_step_hook(on_step)
    return opt


def _with_empty(collate: Any) -> Any:
    def collate_or_empty(examples: list[Any]) -> Any:
        if examples:
            return collate(examples)
        import torch

        empty = torch.zeros((0, 1), dtype=torch.long)
        return {"input_ids": empty, "attention_mask": empty.clone(), "labels": empty.clone()}

    return collate_or_empty


def trainer_class(base: type, dp: PrivacyPlan, *, micro: int) -> type:
    """A subclass of the SFT trainer that trains with DP-SGD (module docstring); ``micro`` bounds a forward pass."""
    import torch
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler
    from torch.utils.data import DataLoader
    from transformers import TrainerCallback

    class _BudgetGuard(TrainerCallback):  # type: ignore[misc]
        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if self.trainer.dp_steps() >= dp.max_steps and state.global_step < args.max_steps:
                logger.warning("privacy budget reached after %d steps: stopping and exporting", state.global_step)
                control.should_save = True
                control.should_training_stop = True
            return control

    class DPTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from opacus.accountants import create_accountant

            super().__init__(*args, **kwargs)
            self.dp_plan = dp
            self.dp_accountant = create_accountant(mechanism=dp.accountant)
            self.dp_optimizer: Any = None
            self.dp_rdp_step: Any = None  # rdp: Opacus' RDP of one step at each order (running epsilon)
            self.add_callback(_BudgetGuard(self))

        def dp_steps(self) -> int:
            return sum(int(n) for _s, _q, n in self.dp_accountant.history)

        def _account(self, _opt: Any) -> None:
            self.dp_accountant.step(noise_multiplier=dp.noise_multiplier, sample_rate=dp.sample_rate)

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if "loss" in logs:  # the spend so far, at every logging step (progress lines)
                logs["epsilon"] = self.running_epsilon()
            super().log(logs, *args, **kwargs)

        def running_epsilon(self) -> float:
            """epsilon after the steps taken so far; rdp: Opacus' RDP of one step times the steps (the accountant
            sums the same per-step RDP, 100x slower per call); the manifest's figure is the accountant's own."""
            if dp.accountant != "rdp":
                return epsilon(dp.accountant, list(self.dp_accountant.history), dp.delta)
            from opacus.accountants import RDPAccountant
            from opacus.accountants.analysis import rdp as analysis

            if self.dp_rdp_step is None:
                self.dp_rdp_step = analysis.compute_rdp(q=dp.sample_rate, noise_multiplier=dp.noise_multiplier, steps=1,
                                                        orders=RDPAccountant.DEFAULT_ALPHAS)
            steps = self.dp_steps()
            if steps == 0:
                return 0.0
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
                eps, _alpha = analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS,
                                                         rdp=self.dp_rdp_step * steps, delta=dp.delta)
            return float(eps)

        def create_optimizer(self, model: Any = None) -> Any:
            opt = super().create_optimizer(model)
            if self.dp_optimizer is None:
                self.dp_optimizer = make_private(self.model, opt, dp, device=self.args.device, on_step=self._account)
                self.optimizer = self.dp_optimizer
            return self.optimizer

        def get_train_dataloader(self) -> Any:
            loader = super().get_train_dataloader()  # the collator and columns TRL prepared
            # Opacus' Poisson sampler: every row joins each step's batch with probability q (an empty batch is a step)
            sampler = UniformWithReplacementSampler(num_samples=len(loader.dataset), sample_rate=dp.sample_rate,
                                                    generator=_secret_generator("cpu"))
            return DataLoader(loader.dataset, batch_sampler=sampler, collate_fn=_with_empty(loader.collate_fn),
                              num_workers=0)

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            model.train()
            inputs = self._prepare_inputs(inputs)
            n = int(inputs["input_ids"].shape[0])
            total = torch.zeros((), device=self.args.device)
            if n == 0:  # an empty Poisson sample: the step adds noise only
                for p in self.dp_optimizer.params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
                return total
            for start in range(0, n, micro):
                chunk = {k: v[start:start + micro] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
                         for k, v in inputs.items()}
                with self.compute_loss_context_manager():
                    losses = per_example_loss(model, chunk)
                with warnings.catch_warnings():  # frozen embeddings: the LoRA layers' inputs need no grad
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    self.accelerator.backward(losses.sum())
                total += losses.detach().sum()
            return total / n

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            super()._save_optimizer_and_scheduler(output_dir)
            state = {"schema": STATE_SCHEMA, "plan": asdict(dp), "steps": self.dp_steps(),
                     "accountant": {"mechanism": dp.accountant, "history": [list(h) for h in self.dp_accountant.history]}}
            Path(output_dir, STATE_FILE).write_text(json.dumps(state, sort_keys=True), encoding="utf-8")

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                self.dp_accountant.history = load_history(Path(checkpoint), dp)

    return DPTrainer


def load_history(ckpt: Path, dp: PrivacyPlan) -> list[tuple[float, float, int]]:
    """The accountant history a checkpoint recorded; refuses a checkpoint without one or of another plan."""
    try:
        state = json.loads((Path(ckpt) / STATE_FILE).read_text(encoding="utf-8"))
        history = [(float(s), float(q), int(n)) for s, q, n in state["accountant"]["history"]]
        same = state["schema"] == STATE_SCHEMA and state["accountant"]["mechanism"] == dp.accountant
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TrainingError(f"{Path(ckpt).name} has no readable privacy accountant state: its spend cannot be accounted",
                            fix="delete the run's checkpoints and train again from step 0") from exc
    if not same or any((s, q) != (dp.noise_multiplier, dp.sample_rate) for s, q, _n in history):
        raise TrainingError(f"{Path(ckpt).name} was trained with another DP-SGD plan",
                            fix="delete the run's checkpoints and train again from step 0")
    return history


def outcome(trainer: Any, resumed_from: Path | None) -> dict[str, Any]:
    """The manifest's ``privacy`` block (also the ``privacy.spent`` audit entry): what ran and what it spent."""
    import opacus
    import torch

    dp: PrivacyPlan = trainer.dp_plan
    history = [tuple(h) for h in trainer.dp_accountant.history]
    if not history and resumed_from is not None:  # restored at max_steps: nothing trained in this process
        history = load_history(resumed_from, dp)
    steps = sum(int(n) for _s, _q, n in history)
    spent = epsilon(dp.accountant, history, dp.delta)
    if spent > dp.target_epsilon:
        raise TrainingError(f"DP-SGD spent epsilon {spent:.3f} > target {dp.target_epsilon:g}: nothing exported")
    return {
        "mechanism": "dp-sgd", "sampling": "poisson", "library": {"opacus": opacus.__version__, "torch": torch.__version__},
        "max_grad_norm": dp.max_grad_norm, "noise_multiplier": dp.noise_multiplier, "noise_derived": dp.noise_derived,
        "sample_rate": dp.sample_rate, "expected_batch_size": dp.expected_batch_size, "rows": dp.rows, "steps": steps,
        "accountant": dp.accountant, "epsilon": spent, "delta": dp.delta, "target_epsilon": dp.target_epsilon,
    }
