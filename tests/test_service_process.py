"""Real processes: `cvm-tune serve` killed with SIGKILL at several points, stopped with SIGTERM (also as
PID 1), a second process locked out, and the stale lock of a killed one (cases 31-34, 40, 42, 43).

Each subprocess runs the real pipeline (embedded simulator, tiny model) on its own output volume.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import load_config
from app.run.pipeline import run_once
from app.state import RunDB, run_lock
from app.training.checkpoints import latest_name

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("faults", REPO / "bench" / "faults.py")
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)  # type: ignore[union-attr]

STEPS, SAVE = 12, 4
TOL = 1e-5  # resumed vs uninterrupted adapter: max |difference| (CPU; identical in practice)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's bundle (same config, in this process)."""
    root = tmp_path_factory.mktemp("reference")
    cfg = load_config(faults.write_config(root, steps=STEPS, save_steps=SAVE))
    return run_once(cfg).bundle_dir


def _wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"process ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < end, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)


def _row(cfg: Path):
    return RunDB(cfg.parent / "out").recent(1)[0]


def test_sigkill_at_several_points_resumes_to_the_same_adapter(tmp_path: Path, reference: Path) -> None:
    """Cases 33, 34, 40: SIGKILL mid-training (from outside), then mid checkpoint seal (inside), then resume."""
    cfg = faults.write_config(tmp_path, steps=STEPS, save_steps=SAVE)
    log = tmp_path / "log.txt"
    ckpts = lambda: next((tmp_path / "out" / "runs").glob("nightly-*/checkpoints"), tmp_path / "none")  # noqa: E731

    # 1. A host reset mid-step: SIGKILL as soon as checkpoint-4 is sealed and step 5 has been logged.
    proc = faults.start(cfg, log)
    _wait_for(lambda: latest_name(ckpts()) == "checkpoint-4" and faults.last_step(log) >= 5, proc, log)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert _row(cfg).status == "running"  # the DB says what it was doing; nothing else was cleaned up
    lost_first = faults.last_step(log) - 4

    # 2. Killed inside the next seal: after 3 of checkpoint-8's blobs (the 4th _seal_file call of this process).
    proc = faults.start(cfg, log, kill_at="app.training.sealed:_seal_file:4")
    assert proc.wait(timeout=300) == -signal.SIGKILL
    assert latest_name(ckpts()) == "checkpoint-4" and list(ckpts().glob(".tmp-checkpoint-8-*"))  # a partial save

    # 3. Next start: the partial save is ignored and removed, training resumes from checkpoint-4.
    proc = faults.start(cfg, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    bundle = faults.bundle(cfg)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4 and manifest["training"]["global_step"] == STEPS
    assert not list(ckpts().glob(".tmp-*"))
    assert faults.adapter_diff(bundle, reference) <= TOL
    assert lost_first <= SAVE  # work lost by the external kill: at most one checkpoint interval
    row = _row(cfg)
    assert (row.status, row.attempts, row.bundle) == ("succeeded", 3, str(bundle))
    types = [json.loads(x)["type"] for x in (bundle / "audit.jsonl").read_text().splitlines()]
    assert types[0] == "run.start" and types.count("run.resume") == 2 and types[-2:] == ["train.done", "export"]
    report = json.loads((bundle / "report" / "report.json").read_text())
    assert report["resume"]["from_step"] == 4 and report["slot"] == row.slot_time
    assert faults.verdict(bundle, cfg)


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _until_unlocked(out: Path, timeout: float = 60) -> None:
    """Wait until nothing holds the volume's run lock (a process of the stopped PID namespace may still be exiting)."""
    from app.state import Locked, run_lock

    deadline = time.monotonic() + timeout
    while True:
        try:
            with run_lock(out):
                return
        except Locked:
            assert time.monotonic() < deadline, "the stopped service's lock was never released"
            time.sleep(0.2)


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-pfr", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("pid1", [False, True], ids=["child", "pid1"])
def test_sigterm_checkpoints_at_the_step_boundary_and_exits_0(tmp_path: Path, reference: Path, pid1: bool) -> None:
    """Cases 31, 32: `docker compose stop` -> SIGTERM -> checkpoint at the next step, exit 0; also as PID 1."""
    if pid1 and not _unshare_works():
        pytest.skip("unshare -pfr (user + PID namespace) is not permitted here")
    cfg = faults.write_config(tmp_path, steps=STEPS, save_steps=SAVE)
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "app", "serve", "--config", str(cfg)]
    if pid1:
        cmd = ["unshare", "-pfr", "--mount-proc", *cmd]
    proc = subprocess.Popen(cmd, env=faults.env(), cwd=tmp_path, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        _wait_for(lambda: faults.last_step(log) >= 2, proc, log)
        target = proc.pid
        if pid1:
            (target,) = _children(proc.pid)  # unshare -f forks the service: PID 1 of the new namespace
            assert json.loads((tmp_path / "out" / "state" / "heartbeat.json").read_text())["pid"] == 1
        t = time.monotonic()
        os.kill(target, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert time.monotonic() - t < 30  # well inside the 60 s stop grace period
    finally:
        for pid in [*_children(proc.pid), proc.pid]:
            if proc.poll() is None:
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    assert "service: stopped" in text
    row = _row(cfg)
    stopped = int(row.reason.split("stopped at step ")[1].split()[0])
    assert row.status == "pending" and row.attempts == 0 and "SIGTERM received" in row.reason
    assert latest_name(next((tmp_path / "out" / "runs").glob("nightly-*/checkpoints"))) == f"checkpoint-{stopped}"

    _until_unlocked(tmp_path / "out")  # as a container restart comes after the old one is gone
    proc = faults.start(cfg, log)  # restart: resumes from exactly that step
    assert proc.wait(timeout=300) == 0
    bundle = faults.bundle(cfg)
    assert bundle is not None, log.read_text()[-3000:]
    assert json.loads((bundle / "manifest.json").read_text())["training"]["resumed_from_step"] == stopped
    assert faults.adapter_diff(bundle, reference) <= TOL


def test_second_process_is_skipped_locked_and_a_killed_holders_lock_is_free(tmp_path: Path) -> None:
    """Cases 42, 43: a second `serve --once` exits 0 with 'skipped: locked' (a `run` exits 7 naming the holder);
    SIGKILL of the holder frees it."""
    cfg = faults.write_config(tmp_path, steps=STEPS, save_steps=SAVE)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from app.state import run_lock\n"
        "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)"), str(tmp_path / "out")],
        env=faults.env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    second = subprocess.run([sys.executable, "-m", "app", "serve", "--once", "--config", str(cfg)], env=faults.env(),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "skipped: locked" in second.stdout + second.stderr
    assert not (tmp_path / "out" / "runs").exists()  # it did nothing
    manual = subprocess.run([sys.executable, "-m", "app", "run", "--config", str(cfg)], env=faults.env(),
                            capture_output=True, text=True, timeout=120)
    assert manual.returncode == 7 and f"in use by another cvm-tune process (pid {holder.pid})" in manual.stderr
    assert not (tmp_path / "out" / "runs").exists()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with run_lock(tmp_path / "out"):  # no cleanup needed: the kernel released the flock
        pass
