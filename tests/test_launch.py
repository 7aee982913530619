"""Multi-GPU launch logic on the CPU: real 2-process DDP (gloo), rank-0 gating, worker errors, OOM relaunch.

Run: ``python -m pytest tests/test_launch.py -q`` (the DDP test spawns two training processes: ~30 s
on 2 cores).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from app.config import TrainingSettings  # noqa: E402
from app.errors import BaseModelError, TrainingError  # noqa: E402
from app.training import TrainingInterrupted, TrainingStopped, TrainRequest, TrainResult, build_tiny_model, launch, ranks, train  # noqa: E402
from app.training.batch import BatchPlan, OutOfMemory  # noqa: E402
from app.training.checkpoints import restore_checkpoint  # noqa: E402
from tests.test_training import CKPT_KEY, FP, INPUTS, _assert_same_adapter, _rows  # noqa: E402

SETTINGS = TrainingSettings(max_steps=4, per_device_batch_size=2, gradient_accumulation_steps=1, learning_rate=5e-3,
                            max_length=64, save_steps=2, logging_steps=1)


def _devices(s: TrainingSettings, n: int) -> TrainingSettings:
    return s.model_copy(update={"gpu": s.gpu.model_copy(update={"devices": n})})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_tiny_model(path)
    return path


def _req(base: Path, run_dir: Path, settings: TrainingSettings, **kw: Any) -> TrainRequest:
    return TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=_rows(24), run_dir=run_dir,
                        settings=settings, fingerprint=FP, checkpoint_key=CKPT_KEY, inputs=INPUTS, **kw)


def test_two_process_ddp_matches_one_process_with_the_same_effective_batch(tiny: Path, tmp_path: Path) -> None:
    logs: list[dict[str, Any]] = []
    events: list[tuple[str, int]] = []
    ddp = train(_req(tiny, tmp_path / "ddp", _devices(SETTINGS, 2), on_log=logs.append,
                     on_event=lambda t, d: events.append((t, d["global_step"]))))
    assert (ddp.global_step, ddp.device) == (4, "2 x cpu")
    assert ddp.batch["processes"] == 2 and ddp.batch["effective"] == 4
    assert [m["step"] for m in logs] == [1, 2, 3, 4]  # rank 0's metrics reach the parent's callback
    assert events == [("checkpoint", 2), ("checkpoint", 4)]  # rank 0's audit events reach the parent too
    choice = restore_checkpoint(tmp_path / "ddp" / "checkpoints", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS,
                                scratch=tmp_path / "scratch")
    assert choice.step == 4  # sealed by rank 0, with every rank's files
    assert {"rng_state_0.pth", "rng_state_1.pth", "adapter_model.safetensors"} <= {p.name for p in choice.path.iterdir()}
    assert sorted(p.name for p in (tmp_path / "ddp" / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]

    one = train(_req(tiny, tmp_path / "one", SETTINGS.model_copy(update={"per_device_batch_size": 4})))
    assert [s for s, _ in ddp.losses] == [s for s, _ in one.losses]
    for (_, a), (_, b) in zip(ddp.losses, one.losses, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert ddp.tokens_seen == one.tokens_seen
    _assert_same_adapter(ddp.adapter_dir, one.adapter_dir, atol=1e-4)


@pytest.mark.slow
def test_ddp_interrupted_run_resumes_to_the_same_adapter(tiny: Path, tmp_path: Path) -> None:
    settings = _devices(SETTINGS, 2)
    with pytest.raises(TrainingInterrupted):
        train(_req(tiny, tmp_path / "run", settings, stop_after_step=2))
    resumed = train(_req(tiny, tmp_path / "run", settings))
    assert (resumed.resumed_from_step, resumed.global_step) == (2, 4)
    straight = train(_req(tiny, tmp_path / "straight", settings))
    _assert_same_adapter(resumed.adapter_dir, straight.adapter_dir, atol=1e-5)


def test_stop_request_reaches_every_rank_which_seal_and_stop_together(tiny: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM in the service (``on_step_end`` says stop): both ranks stop at one step boundary, sealed; nothing is
    left in the temporary directory (the scratch, torch's pytorch-errorfile-*.pickle of the ranks that raised)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    events: list[tuple[str, int]] = []
    with pytest.raises(TrainingStopped, match="stopped at step"):
        # Many steps: the parent polls the stop request between log messages, so the run must outlast a poll.
        train(_req(tiny, tmp_path / "run", _devices(SETTINGS, 2).model_copy(update={"max_steps": 400}),
                   on_step_end=lambda step: "SIGTERM" if step >= 1 else None,
                   on_event=lambda t, d: events.append((t, d["global_step"]))))
    assert events and events[-1][0] == "checkpoint"
    choice = restore_checkpoint(tmp_path / "run" / "checkpoints", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS,
                                scratch=tmp_path / "scratch")
    assert choice.step == events[-1][1] < 400
    assert list((tmp_path / "tmp").iterdir()) == []


def test_worker_env_is_torchruns_contract() -> None:
    env = launch.worker_env(1, 4, 29500)
    assert env == {"CVM_TUNE_WORKER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1",
                   "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "ROLE_RANK": "1",
                   "ROLE_WORLD_SIZE": "4"}


def test_rank_helpers_trust_only_our_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(ranks.WORKER_ENV, raising=False)
    assert (ranks.world_size(), ranks.rank(), ranks.in_worker()) == (1, 0, False)
    with pytest.raises(TrainingError, match="distributed launcher") as err:
        launch.refuse_foreign_launcher()
    assert "training.gpu.devices" in err.value.fix
    monkeypatch.setenv(ranks.WORKER_ENV, "1")
    assert (ranks.world_size(), ranks.rank()) == (4, 3)
    launch.refuse_foreign_launcher()  # our own worker: fine


def test_cvm_tune_under_torchrun_is_refused(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainingError, match="distributed launcher"):
        train(_req(tiny, tmp_path, SETTINGS))


def test_worker_errors_keep_their_class_message_and_fix() -> None:
    class Failure(Exception):
        error_index = 1

    msgs = [("error", 0, {"rank": 0, "cls": "TrainingError", "oom": None, "message": "peer died", "fix": None}),
            ("error", 1, {"rank": 1, "cls": "BaseModelError", "oom": None, "message": "bad weights", "fix": "restore"})]
    err = launch._worker_error(Failure("x"), msgs)
    assert isinstance(err, BaseModelError) and (err.message, err.fix) == ("bad weights", "restore")
    oom = launch._worker_error(Failure("x"), [("error", 1, {"rank": 1, "cls": "OutOfMemory", "message": "oom", "fix": None,
                                                            "oom": {"phase": "eval", "first_step": False, "at_step": 6}})])
    assert isinstance(oom, OutOfMemory) and (oom.phase, oom.at_step) == ("eval", 6)
    stray = launch._worker_error(Failure("x"), [("error", 1, {"rank": 1, "cls": "KeyError", "oom": None,
                                                              "message": "'x'", "fix": None})])
    assert type(stray) is TrainingError
    assert "worker failed" in launch._worker_error(Failure("Traceback...\nRuntimeError: boom"), []).message


def test_oom_in_a_worker_relaunches_all_workers_with_a_smaller_plan(tiny: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[BatchPlan] = []
    done = TrainResult(adapter_dir=tmp_path / "adapter", backend="hf", device="2 x cpu", losses=[(1, 1.0)], global_step=1,
                       resumed_from_step=None, train_runtime_s=0.1, tokens_seen=1, library_versions={})

    def fake_workers(req: TrainRequest, plan: BatchPlan, world: int, parent: TrainRequest, scratch: Path,
                     choice: Any) -> TrainResult:
        assert world == 2 and scratch.is_dir() and choice.path is None
        # callbacks never cross processes
        assert (req.on_log, req.on_batch_change, req.on_event, req.on_step_end) == (None, None, None, None)
        plans.append(plan)
        if plan.micro > 2:
            raise OutOfMemory("oom", phase="train", first_step=True, at_step=0)
        if plan.eval_micro > 2:
            raise OutOfMemory("oom", phase="eval", first_step=False, at_step=2)
        return done

    monkeypatch.setattr(launch, "_run_workers", fake_workers)
    changes: list[dict[str, Any]] = []
    settings = _devices(SETTINGS.model_copy(update={"per_device_batch_size": 8, "per_device_eval_batch_size": 4}), 2)
    result = train(_req(tiny, tmp_path, settings, on_batch_change=changes.append))
    assert [(p.micro, p.accumulation, p.eval_micro) for p in plans] == [(8, 1, 4), (4, 2, 4), (2, 4, 4), (2, 4, 2)]
    assert [c["phase"] for c in changes] == ["train", "train", "eval"]
    assert result.batch == {"configured": {"micro": 8, "accumulation": 1, "auto": False},
                            "final": {"micro": 2, "accumulation": 4, "eval_micro": 2}, "processes": 2, "effective": 16,
                            "adjustments": changes}
    assert dataclasses.replace(result, batch={}) == done


def test_unsloth_is_single_gpu_in_cvm_tune(tiny: Path, tmp_path: Path) -> None:
    from app.training.backend import select_backend

    assert select_backend("auto", devices=2) == "hf"
    with pytest.raises(TrainingError):  # no CUDA here; with CUDA: "runs the HF backend only"
        train(_req(tiny, tmp_path, _devices(SETTINGS, 2).model_copy(update={"backend": "unsloth"})))
