"""The trainer callback of every run: seals checkpoints (rank 0), runs the loss watchdog, forwards metrics, stops on
request at a step boundary. Built on first use (transformers is imported only then)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from . import LossDiverged, TrainingInterrupted, TrainingStopped, TrainRequest, ranks
from .checkpoints import seal_checkpoint
from .watchdog import LossWatchdog


def callback_class() -> type:
    from transformers import TrainerCallback

    class _CvmTuneCallback(TrainerCallback):  # type: ignore[misc]
        """Seals checkpoints (rank 0), runs the loss watchdog, forwards metrics, stops on request."""

        def __init__(self, req: TrainRequest, sealing: dict[str, Any]) -> None:
            self.req = req
            self.sealing = sealing
            self.watchdog = LossWatchdog(req.settings.loss_watchdog)
            self.stop_reason: str | None = None
            self.began = (time.monotonic(), 0, 0)  # (clock, step, tokens seen) when this process began training

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.began = (time.monotonic(), int(state.global_step), int(state.num_input_tokens_seen or 0))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs:
                return
            # Every rank logs the same (all-reduced) loss, so every rank reaches the same verdict.
            diverged = self.watchdog.check(int(state.global_step), float(logs["loss"]), logs.get("grad_norm"))
            if diverged is not None:  # raised before this step's save: no diverged checkpoint is sealed
                raise LossDiverged(f"loss watchdog: {diverged}; aborted, nothing exported")
            if self.req.on_log is None:
                return
            grad_norm = logs.get("grad_norm")
            began, step0, tokens0 = self.began
            self.req.on_log({
                "elapsed_s": time.monotonic() - began,  # since this process began training (a resume: its own part)
                "steps_this_run": int(state.global_step) - step0,
                "tokens_this_run": int(state.num_input_tokens_seen or 0) - tokens0,  # non-padding input tokens
                "step": int(state.global_step),
                "loss": float(logs["loss"]),
                "learning_rate": float(logs.get("learning_rate", 0.0)),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "epoch": float(logs.get("epoch", state.epoch or 0.0)),
                **({"epsilon": float(logs["epsilon"])} if "epsilon" in logs else {}),  # DP-SGD: spent so far
            })

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if self.req.stop_after_step is not None and state.global_step == self.req.stop_after_step:
                control.should_save = True  # the hook promises a checkpoint at that step
            if self.req.on_step_end is not None and self.stop_reason is None:
                self.stop_reason = self.req.on_step_end(int(state.global_step))
            if ranks.any_rank(self.stop_reason is not None, args.device) and self.stop_reason is None:
                self.stop_reason = "stop requested"  # several processes stop at the same step boundary
            if self.stop_reason is not None:  # SIGTERM / watchdog: checkpoint at this step boundary
                control.should_save = True
                control.should_training_stop = True
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = int(state.global_step)
            plain = Path(args.output_dir) / f"checkpoint-{step}"
            sealed = not self.watchdog.suspicious  # never seal weights from inside a loss spike
            ranks.barrier()  # several processes: every rank's rng_state_<rank>.pth is written before the seal
            if state.is_world_process_zero:
                if sealed:
                    digest = seal_checkpoint(plain, self.sealing["root"], key=self.sealing["key"],
                                             fingerprint=self.req.fingerprint, inputs=self.sealing["inputs"], step=step,
                                             keep=self.req.keep_checkpoints)
                    if self.req.on_event is not None:
                        self.req.on_event("checkpoint", {"global_step": step, "manifest_sha256": digest})
                shutil.rmtree(plain, ignore_errors=True)  # the plaintext copy lives only until it is sealed
            ranks.barrier()
            if self.stop_reason is not None:
                raise TrainingStopped(f"{self.stop_reason}: stopped at step {step}"
                                      + (f" after sealing checkpoint-{step}" if sealed else " (loss spike: not sealed)"))
            if self.req.stop_after_step is not None and step >= self.req.stop_after_step:
                raise TrainingInterrupted(f"training stopped by stop_after_step after sealing checkpoint-{step}")

    return _CvmTuneCallback
