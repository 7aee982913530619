"""Fault injection: SIGKILL a `cvm-tune serve --once` run at N random points, resume, compare adapters.

    python bench/faults.py [--kills N] [--seed S] [--steps 24] [--save-steps 4] [--out bench/results/faults-cpu.json]

Each trial gets a fresh output volume and is killed once with SIGKILL, either from outside at a
random moment of training (after a random step, plus a random delay up to one mean step time: like a
host reset) or at a random named point inside the process (mid checkpoint seal, between the seal and
the LATEST pointer, mid audit append, mid export staging: see ``KILL_POINTS``). Then ``serve
--once`` runs again until the slot is done. Reported per trial: whether the run resumed, the step it
resumed from, the work lost (last step logged before the kill minus the resume step; target <= one
checkpoint interval, ``--save-steps``), the max |difference| between the resumed adapter and an
uninterrupted run's (target: identical within 1e-5), and the verifier's verdict on the resumed
bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
# "module:function:N" = SIGKILL the process at the Nth call of that function (N drawn at random).
KILL_POINTS = {
    "mid-seal (between blob writes)": ("app.training.sealed", "_seal_file", (2, 40)),
    "sealed, LATEST not yet moved": ("app.training.checkpoints", "atomic_write_bytes", (1, 6)),
    "mid audit append": ("app.audit", "fsync_dir", (1, 8)),
    "mid export staging": ("app.export.report", "write", (1, 1)),
    "export staged, self-verification running": ("app.export.stage", "publish_gate", (1, 1)),
    "bundle published, run state not yet updated": ("app.run.pipeline", "write_state", (2, 2)),
}
_INJECT = """
import importlib, os, signal, sys
mod, fn, n = os.environ["CVM_TUNE_KILL_AT"].split(":")
m, calls = importlib.import_module(mod), [0]
orig = getattr(m, fn)
def wrapped(*a, **k):
    calls[0] += 1
    if calls[0] == int(n):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(*a, **k)
setattr(m, fn, wrapped)
from app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def write_config(root: Path, *, steps: int, save_steps: int) -> Path:
    """A demo config whose daily slot is 12 h away from now (no slot boundary during a trial)."""
    hhmm = (datetime.now(timezone.utc) - timedelta(hours=12)).strftime("%H:%M")
    cfg = root / "cfg.yaml"
    cfg.write_text(json.dumps({"output": {"dir": str(root / "out")}, "schedule": {"time": hhmm, "max_attempts": 5},
                               "training": {"max_steps": steps, "save_steps": save_steps, "logging_steps": 1}}))
    return cfg


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def start(cfg: Path, log: Path, *, kill_at: str | None = None, args: tuple[str, ...] = ("serve", "--once")) -> subprocess.Popen:
    """Start ``cvm-tune <args> --config cfg`` (stdout+stderr to ``log``), optionally with a kill point."""
    e = env()
    if kill_at:
        e["CVM_TUNE_KILL_AT"] = kill_at
        cmd = [sys.executable, "-c", _INJECT, *args, "--config", str(cfg)]
    else:
        cmd = [sys.executable, "-m", "app", *args, "--config", str(cfg)]
    return subprocess.Popen(cmd, env=e, cwd=cfg.parent, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


def last_step(log: Path) -> int:
    steps = re.findall(rb"^  step (\d+)/", log.read_bytes(), re.M)
    return int(steps[-1]) if steps else 0


def bundle(cfg: Path) -> Path | None:
    exports = [p for p in (cfg.parent / "out" / "exports").glob("nightly-*") if p.is_dir()]
    return exports[0] if exports else None


def adapter_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "adapter" / "adapter_model.safetensors")), load_file(str(b / "adapter" / "adapter_model.safetensors"))
    if sorted(ta) != sorted(tb):
        return float("inf")
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


def finish(cfg: Path, log: Path, tries: int = 3) -> Path | None:
    """``serve --once`` until the slot's bundle exists."""
    for _ in range(tries):
        if bundle(cfg) is not None:
            break
        start(cfg, log).wait(timeout=600)
    return bundle(cfg)


def verdict(b: Path, cfg: Path) -> bool:
    proc = subprocess.run([sys.executable, "-m", "app", "verify", str(b), "--policy",
                           str(cfg.parent / "out" / "simulator-test-policy.yaml")], env=env(), capture_output=True)
    return proc.returncode == 0


def first_step_time(proc: subprocess.Popen, log: Path) -> float:
    """Wait until the run logs its first optimizer step (or ends); returns that monotonic time."""
    while proc.poll() is None and last_step(log) < 1:
        time.sleep(0.01)
    return time.monotonic()


def trial(root: Path, rng: random.Random, *, steps: int, save_steps: int, ref: Path, train_seconds: float) -> dict[str, Any]:
    cfg = write_config(root, steps=steps, save_steps=save_steps)
    log = root / "log.txt"
    if rng.random() < 0.5:  # from outside, at a random moment of training (robust to a slow machine)
        after, delay = rng.randint(1, steps), rng.random() * train_seconds / steps
        point, proc = f"SIGKILL {delay:.2f} s after step {after} was logged", start(cfg, log)
        while proc.poll() is None and last_step(log) < after:
            time.sleep(0.005)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    else:
        name = rng.choice(sorted(KILL_POINTS))
        mod, fn, (lo, hi) = KILL_POINTS[name]
        n = rng.randint(lo, hi)
        point, proc = f"{name} ({fn} call {n})", start(cfg, log, kill_at=f"{mod}:{fn}:{n}")
        proc.wait(timeout=600)
    killed = proc.returncode == -signal.SIGKILL
    before = last_step(log)
    exported_before_restart = bundle(cfg) is not None  # killed after the bundle's rename: nothing to redo
    b = finish(cfg, log)
    manifest = json.loads((b / "manifest.json").read_text()) if b else {}
    resumed = (manifest.get("training") or {}).get("resumed_from_step")
    return {
        "kill_point": point, "killed": killed, "last_step_before_kill": before if killed else None,
        "completed": b is not None, "resumed_from_step": resumed,
        "exported_before_restart": exported_before_restart,
        "work_lost_steps": (0 if exported_before_restart else before - (resumed or 0)) if killed and b else None,
        "max_abs_diff": adapter_diff(b, ref) if b else None, "verified": verdict(b, cfg) if b else False,
    }


def lock_removal(root: Path, *, steps: int, save_steps: int, ref: Path) -> dict[str, Any]:
    """Delete state/lock (and the whole state/ directory's lock file) while a run trains, start a second
    `serve --once`: it must say 'skipped: locked'; the first run must finish with a bundle that verifies."""
    cfg = write_config(root, steps=steps, save_steps=save_steps)
    log, log2 = root / "log.txt", root / "log2.txt"
    proc = start(cfg, log)
    first_step_time(proc, log)
    lock = root / "out" / "state" / "lock"
    lock.unlink(missing_ok=True)
    second = start(cfg, log2)
    second.wait(timeout=600)
    refused = second.returncode == 0 and "skipped: locked" in log2.read_text()
    proc.wait(timeout=600)
    b = bundle(cfg)
    return {"kill_point": "state/lock deleted mid-run, second serve --once started", "killed": False,
            "second_refused": refused, "completed": b is not None,
            "max_abs_diff": adapter_diff(b, ref) if b else None, "verified": verdict(b, cfg) if b else False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="cvm-tune-faults-") as tmp:
        ref_root = Path(tmp) / "ref"
        ref_root.mkdir()
        cfg = write_config(ref_root, steps=args.steps, save_steps=args.save_steps)
        proc = start(cfg, ref_root / "log.txt")
        t0 = first_step_time(proc, ref_root / "log.txt")
        while proc.poll() is None and last_step(ref_root / "log.txt") < args.steps:
            time.sleep(0.01)
        train_seconds = time.monotonic() - t0
        proc.wait(timeout=600)
        ref = bundle(cfg)
        if ref is None:
            raise SystemExit(f"the reference run failed: see {ref_root / 'log.txt'}")
        trials = []
        for i in range(args.kills):
            root = Path(tmp) / f"t{i}"
            root.mkdir()
            trials.append(trial(root, rng, steps=args.steps, save_steps=args.save_steps, ref=ref, train_seconds=train_seconds))
            print(json.dumps(trials[-1]), flush=True)
        root = Path(tmp) / "lock"
        root.mkdir()
        lock_trial = lock_removal(root, steps=args.steps, save_steps=args.save_steps, ref=ref)
        print(json.dumps(lock_trial), flush=True)
    killed = [t for t in trials if t["killed"]]
    identical = [t for t in killed if t["completed"] and t["max_abs_diff"] is not None and t["max_abs_diff"] <= TOLERANCE]
    lost = [t["work_lost_steps"] for t in killed if t["work_lost_steps"] is not None]
    summary = {
        "schema": "cvm-tune/bench/faults/v1", "measured": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
        "cpu_count": os.cpu_count(), "steps": args.steps, "save_steps": args.save_steps, "seed": args.seed,
        "reference_train_s": round(train_seconds, 2), "kills": len(killed), "trials": len(trials),
        "resumed_identical": len(identical), "tolerance": TOLERANCE, "all_verified": all(t["verified"] for t in trials),
        "work_lost_steps_max": max(lost, default=0), "work_lost_steps_mean": round(sum(lost) / len(lost), 2) if lost else 0,
        "within_one_interval": all(x <= args.save_steps for x in lost), "results": trials,
        "lock_removed_mid_run": lock_trial,
    }
    print(f"{len(identical)}/{len(killed)} killed runs resumed to an identical adapter (|diff| <= {TOLERANCE}); "
          f"work lost per kill: max {summary['work_lost_steps_max']} steps, mean {summary['work_lost_steps_mean']} "
          f"(checkpoint interval {args.save_steps}); all bundles verified: {summary['all_verified']}; "
          f"lock removed mid-run: second run refused {lock_trial['second_refused']}, first verified {lock_trial['verified']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
