"""OOM back-off and auto batch size (threat cases 24 and 25), on the CPU with simulated CUDA OOMs.

The OOM is real as far as cvm-tune can tell: a forward pre-hook on the tiny model's embedding raises
``torch.OutOfMemoryError`` whenever a micro-batch is larger than a limit, exactly where a too-large
batch fails on a GPU. Run: ``python -m pytest tests/test_batch.py -q``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

import app.training.backend as backend  # noqa: E402
from app.config import TrainingSettings  # noqa: E402
from app.errors import TrainingError  # noqa: E402
from app.training import TrainRequest, TrainResult, build_tiny_model, train  # noqa: E402
from app.training.batch import BatchPlan, OutOfMemory, initial_plan, is_oom, retry_budget, run_with_backoff  # noqa: E402
from tests.test_training import FP, _assert_same_adapter, _rows  # noqa: E402

SETTINGS = TrainingSettings(max_steps=4, per_device_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-3,
                            max_length=64, save_steps=2, logging_steps=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_tiny_model(path)
    return path


@pytest.fixture
def oom_when(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Make the tiny model raise torch.OutOfMemoryError for micro-batches over ``limit`` (train and/or eval)."""
    import torch

    rule: dict[str, Any] = {"train": None, "eval": None, "after_calls": 0, "calls": 0}
    real = backend._load_hf

    def load(req: TrainRequest, cuda: bool) -> tuple[Any, Any, Any]:
        model, tok, peft_config = real(req, cuda)

        def hook(module: Any, args: tuple[Any, ...]) -> None:
            rule["calls"] += 1
            limit = rule["train"] if module.training else rule["eval"]
            if limit is not None and args[0].shape[0] > limit and rule["calls"] > rule["after_calls"]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

        model.model.embed_tokens.register_forward_pre_hook(hook)
        return model, tok, peft_config

    monkeypatch.setattr(backend, "_load_hf", load)
    yield rule


def _req(base: Path, run_dir: Path, settings: TrainingSettings, changes: list[dict[str, Any]] | None = None,
         rows: int = 24) -> TrainRequest:
    return TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=_rows(rows), run_dir=run_dir,
                        settings=settings, fingerprint=FP,
                        on_batch_change=None if changes is None else changes.append)


# --- the plan arithmetic --------------------------------------------------------------------------------


def test_back_off_keeps_the_effective_batch() -> None:
    plan, seen = BatchPlan(8, 1, 8), []
    while plan is not None:
        seen.append((plan.micro, plan.accumulation))
        plan = plan.next_train()
    assert seen == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert BatchPlan(3, 2, 3).next_train() == BatchPlan(1, 6, 3)  # 6 has no divisor between 1 and 3 // 2
    assert BatchPlan(6, 2, 6).next_train() == BatchPlan(3, 4, 6)
    assert BatchPlan(2, 2, 4).next_eval() == BatchPlan(2, 2, 2)
    assert BatchPlan(2, 2, 1).next_eval() is None


def test_initial_plan_and_budget() -> None:
    s = SETTINGS.model_copy(update={"per_device_batch_size": 2, "gradient_accumulation_steps": 4})
    assert initial_plan(s) == BatchPlan(2, 4, 2)
    auto = s.model_copy(update={"gpu": s.gpu.model_copy(update={"auto_batch_size": True})})
    assert initial_plan(auto) == BatchPlan(8, 1, 2)
    assert retry_budget(s) == 3 and retry_budget(auto) == 3  # divisors of 8 below 8: 1, 2, 4
    evals = s.model_copy(update={"per_device_eval_batch_size": 16})
    assert initial_plan(evals).eval_micro == 16


def test_is_oom_recognises_wrapped_and_message_only_errors() -> None:
    import torch

    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    try:
        try:
            raise torch.OutOfMemoryError("inner")
        except torch.OutOfMemoryError as inner:
            raise ValueError("wrapper") from inner
    except ValueError as outer:
        assert is_oom(outer)
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("CUDA out of memory"))  # only RuntimeErrors carry the message-based signal


def test_run_with_backoff_rules() -> None:
    calls: list[BatchPlan] = []

    def fail_until(limit: int, first: bool = True, phase: str = "train"):
        def attempt(plan: BatchPlan) -> str:
            calls.append(plan)
            if plan.micro > limit:
                raise OutOfMemory("oom", phase=phase, first_step=first, at_step=0 if first else 5)
            return "ok"
        return attempt

    changes: list[dict[str, Any]] = []
    out, final, records = run_with_backoff(BatchPlan(8, 1, 4), fail_until(2), retries=3, probing=False,
                                           on_change=changes.append)
    assert (out, final) == ("ok", BatchPlan(2, 4, 4)) and records == changes
    assert [(r["reason"], r["from"]["micro"], r["to"]["micro"], r["to"]["accumulation"]) for r in records] == [
        ("oom", 8, 4, 2), ("oom", 4, 2, 4)]
    with pytest.raises(TrainingError, match="after 1 back-off"):
        run_with_backoff(BatchPlan(8, 1, 4), fail_until(1), retries=1, probing=False, on_change=None)
    with pytest.raises(TrainingError, match="not the first step"):
        run_with_backoff(BatchPlan(8, 1, 4), fail_until(1, first=False), retries=3, probing=False, on_change=None)
    calls.clear()
    with pytest.raises(TrainingError, match="with micro-batch 1"):
        run_with_backoff(BatchPlan(2, 1, 4), fail_until(0), retries=9, probing=True, on_change=None)
    assert [p.micro for p in calls] == [2, 1]


# --- real training with simulated OOMs -------------------------------------------------------------------


def test_oom_at_step_one_halves_micro_batch_and_matches_a_run_configured_small(
        tiny: Path, tmp_path: Path, oom_when: dict[str, Any]) -> None:
    oom_when["train"] = 2
    changes: list[dict[str, Any]] = []
    result = train(_req(tiny, tmp_path / "backoff", SETTINGS, changes))
    assert [(c["phase"], c["reason"], c["at_step"], c["from"]["micro"], c["to"]["micro"], c["to"]["accumulation"])
            for c in changes] == [("train", "oom", 0, 8, 4, 2), ("train", "oom", 0, 4, 2, 4)]
    assert result.batch["final"] == {"micro": 2, "accumulation": 4, "eval_micro": 8}
    assert result.batch["effective"] == 8 and result.batch["adjustments"] == changes
    assert result.global_step == SETTINGS.max_steps

    oom_when["train"] = None
    small = SETTINGS.model_copy(update={"per_device_batch_size": 2, "gradient_accumulation_steps": 4})
    direct: TrainResult = train(_req(tiny, tmp_path / "direct", small))
    assert direct.batch["adjustments"] == []
    _assert_same_adapter(result.adapter_dir, direct.adapter_dir, atol=1e-5)
    assert [s for s, _ in result.losses] == [s for s, _ in direct.losses]
    for (_, a), (_, b) in zip(result.losses, direct.losses, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_retries_are_bounded(tiny: Path, tmp_path: Path, oom_when: dict[str, Any]) -> None:
    oom_when["train"] = 1
    settings = SETTINGS.model_copy(update={"gpu": SETTINGS.gpu.model_copy(update={"oom_retries": 2})})
    changes: list[dict[str, Any]] = []
    with pytest.raises(TrainingError, match="after 2 back-off") as err:
        train(_req(tiny, tmp_path, settings, changes))
    assert [c["to"]["micro"] for c in changes] == [4, 2]
    assert "per_device_batch_size" in err.value.fix
    assert not (tmp_path / "adapter").exists()


def test_oom_after_the_first_step_is_not_retried(tiny: Path, tmp_path: Path, oom_when: dict[str, Any]) -> None:
    oom_when.update(train=2, after_calls=2)  # micro-batch 8, accumulation 1: calls 1-2 are steps 1-2
    changes: list[dict[str, Any]] = []
    with pytest.raises(TrainingError, match="at optimizer step 3") as err:
        train(_req(tiny, tmp_path, SETTINGS, changes))
    assert changes == [] and "resumes from its last checkpoint" in err.value.fix
    assert (tmp_path / "checkpoints" / "checkpoint-2").is_dir()  # the work before the OOM is kept


def test_eval_oom_reduces_only_the_eval_batch(tiny: Path, tmp_path: Path, oom_when: dict[str, Any]) -> None:
    oom_when["eval"] = 1
    settings = SETTINGS.model_copy(update={"per_device_batch_size": 2, "gradient_accumulation_steps": 2,
                                           "eval_fraction": 0.25, "per_device_eval_batch_size": 4})
    changes: list[dict[str, Any]] = []
    result = train(_req(tiny, tmp_path, settings, changes))
    assert [(c["phase"], c["at_step"], c["from"], c["to"]) for c in changes] == [
        ("eval", 2, {"micro": 2, "accumulation": 2, "eval_micro": 4}, {"micro": 2, "accumulation": 2, "eval_micro": 2}),
        ("eval", 2, {"micro": 2, "accumulation": 2, "eval_micro": 2}, {"micro": 2, "accumulation": 2, "eval_micro": 1}),
    ]
    assert result.batch["final"] == {"micro": 2, "accumulation": 2, "eval_micro": 1}
    assert [s for s, _ in result.eval_losses] == [2, 4] and all(v > 0 for _, v in result.eval_losses)
    assert result.global_step == settings.max_steps


def test_auto_batch_size_finds_the_largest_micro_batch_that_fits(tiny: Path, tmp_path: Path,
                                                                oom_when: dict[str, Any]) -> None:
    oom_when["train"] = 4
    settings = SETTINGS.model_copy(update={"per_device_batch_size": 1, "gradient_accumulation_steps": 8,
                                           "gpu": SETTINGS.gpu.model_copy(update={"auto_batch_size": True})})
    changes: list[dict[str, Any]] = []
    result = train(_req(tiny, tmp_path, settings, changes))
    assert [(c["reason"], c["to"]["micro"], c["to"]["accumulation"]) for c in changes] == [("auto", 4, 2)]
    assert result.batch["configured"] == {"micro": 1, "accumulation": 8, "auto": True}
    assert result.batch["final"]["micro"] == 4 and result.batch["effective"] == 8
