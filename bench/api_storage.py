"""Disk and time of an RL loop's sampler saves: N steps of forward_backward + optim_step + save_weights_for_sampler
(anonymous, as ``save_weights_and_get_sampling_client`` sends it) on the tiny model, the service in-process.

    python bench/api_storage.py [--steps N] [--out bench/results/api-storage-cpu.json]

Three ways, each on a fresh output volume: ``export`` every sampler save exported (``user_metadata`` ``export:
"true"``: what every sampler save did before they became sealed states only), ``sealed`` sealed states only, and
``sealed+ttl`` sealed states with ``ttl_seconds`` 3600 and the service's clock moved one hour a step (each state
expires at the next save's sweep). Prints, per 1,000 steps (measured over N, scaled): the wall time, the bytes of
``api/`` and ``exports/`` at the end, how many bundles, and the ratios against ``export``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from timing import write_json  # bench/timing.py: the script directory is on sys.path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's app, not an installed copy
MODES = ("export", "sealed", "sealed+ttl")


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def run(mode: str, steps: int, tmp: Path) -> dict[str, Any]:
    from tinker import types

    from app.api import open_service
    from app.config import load_config
    from tests.api_inproc import TOKENS, Client, fb_record, wait

    cfg = tmp / "api.yaml"
    cfg.write_text(f"output:\n  dir: {tmp / 'out'}\n")
    with open_service(load_config(cfg)) as svc:
        c = Client(svc)
        m = c.create(rank=8)
        start, t0 = time.time(), time.perf_counter()
        for i in range(steps):
            if mode == "sealed+ttl":
                svc.storage.clock = lambda i=i: start + 3600 * i
            assert c.forward_backward(m, fb_record([list(t) for t in TOKENS]))[0]
            assert c.optim_step(m)[0]
            req = types.SaveWeightsForSamplerRequest(
                model_id=m, sampling_session_seq_id=i, ttl_seconds=3600 if mode == "sealed+ttl" else None,
                user_metadata={"export": "true"} if mode == "export" else None)
            ok, body = wait(svc, svc.save(c.owner, req, "sampler"))
            assert ok, body
        wall = time.perf_counter() - t0
        out = svc.out
        return {"steps": steps, "wall_s": round(wall, 2), "s_per_1000_steps": round(wall / steps * 1000, 1),
                "api_bytes": _bytes(out / "api"), "exports_bytes": _bytes(out / "exports"),
                "bundles": sum(1 for _ in (out / "exports").iterdir()),
                "bytes_per_1000_steps": round((_bytes(out / "api") + _bytes(out / "exports")) / steps * 1000)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    results = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="api-storage-") as tmp:
            results[mode] = run(mode, args.steps, Path(tmp))
        print(mode, results[mode], flush=True)
    base = results["export"]
    ratios = {mode: {"disk": round(r["bytes_per_1000_steps"] / base["bytes_per_1000_steps"], 4),
                     "time": round(r["wall_s"] / base["wall_s"], 3)} for mode, r in results.items()}
    print("ratios against export:", ratios)
    write_json({"machine": platform.platform(), "cpus": os.cpu_count(), "results": results, "ratios": ratios},
               args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
