"""Share of a demo run's wall time spent outside training (decrypt, hashing, audit events, quote, export).

    python bench/overhead.py [--steps N] [--out bench/results/overhead-cpu.json]

Runs the embedded demo (simulator, bundled sample, tiny model) twice in one process: a warm-up run
(imports, tiny-model build, dataset encryption) and a measured run. Prints the per-phase seconds and
the ratios measured within the same run, so machine noise cancels out of the ratios.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from app.config import Config, OutputSettings, TrainingSettings
from app.run.pipeline import run_once
from timing import write_json  # bench/timing.py: the script directory is on sys.path

PHASES = ("agent", "key", "decrypt_validate", "base_model", "hashing", "audit", "gpu_evidence", "train", "export",
          "quote", "collateral", "self_verify")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-") as tmp:
        cfg = Config(output=OutputSettings(dir=Path(tmp)), training=TrainingSettings(max_steps=args.steps))
        t = time.perf_counter()
        run_once(cfg)
        cold = time.perf_counter() - t
        res = run_once(cfg)
    tm = res.timings
    total = tm["total"]
    outside_train_phase = total - tm["train"]
    outside_trainer = total - res.train_runtime_s
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "steps": args.steps,
        "cold_run_s": round(cold, 3),
        "measured_run_s": round(total, 3),
        "phases_s": {k: round(tm.get(k, 0.0), 4) for k in PHASES},
        "trainer_train_s": round(res.train_runtime_s, 3),
        "share_outside_train_phase": round(outside_train_phase / total, 4),
        "share_outside_trainer_train": round(outside_trainer / total, 4),
        "note": "export includes quote, collateral and the export audit event; train includes model load and trainer setup",
    }
    print(f"demo run ({args.steps} steps): cold {cold:.2f} s, warm {total:.2f} s")
    for k in PHASES:
        print(f"  {k:17s} {tm.get(k, 0.0) * 1000:9.1f} ms")
    print(f"  trainer.train()   {res.train_runtime_s * 1000:9.1f} ms")
    print(f"share of wall time outside the train phase:      {report['share_outside_train_phase']:.1%}")
    print(f"share of wall time outside trainer.train() itself: {report['share_outside_trainer_train']:.1%}")
    write_json(report, args.out)


if __name__ == "__main__":
    main()
