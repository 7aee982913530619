"""Helpers shared by the benchmarks: timing (``bench/verify.py``, ``bench/cpu_perf.py``) and writing a result file.

Importing this module has no side effects (no ``sys.path`` changes, no project imports), so ``cpu_perf.py --tree``
still measures the tree it was pointed at.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def times_ms(fn: Callable[[], object], n: int, before: Callable[[], None] = lambda: None) -> list[float]:
    """``n`` wall times of ``fn()`` in ms, after one untimed warm-up call; ``before()`` runs untimed before each."""
    fn()  # warm imports and lazy module state once
    out = []
    for _ in range(n):
        before()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def clear_dcap_caches() -> None:
    """Forget every memo of the chain checks (parsed chains, issuer signatures, CRLs): a cold verification."""
    import attestation.tdx.dcap as dcap

    for cached in vars(dcap).values():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def write_json(doc: object, out: Path | None) -> None:
    """Write a benchmark's result ``doc`` as indented JSON to ``out`` (its folder created); nothing when None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
