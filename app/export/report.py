"""The per-run report in the bundle: ``report/report.json`` and ``report/loss.png``.

Both are listed in the manifest's ``files`` (so report_data binds them and the verifier
hash-checks them). Metrics and counts only: no row, token or key ever goes into a report.
matplotlib (Agg, no display) is imported only here, only when a report is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPORT_SCHEMA = "cvm-tune/report/v1"


def build(*, run_id: str, slot: str | None, timings: dict[str, float], train: Any, effective_batch_size: int,
          rows: Any, checks: list[str], validation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report body.

    Args:
        run_id: The run.
        slot: The scheduled slot instant (``None`` for a manual ``cvm-tune run``).
        timings: Seconds per pipeline phase so far.
        train: The ``TrainResult``.
        effective_batch_size: Examples per optimizer step.
        rows: The ``RowReport`` from data validation.
        checks: What was checked during the run, one line each.
        validation: Counted policy decisions (duplicates dropped, too-long rows, rows without a
            trainable token: the manifest's ``dataset.validation``).
    """
    steps_here = train.global_step - (train.resumed_from_step or 0)
    runtime = max(train.train_runtime_s, 1e-9)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss = rss_kib if sys.platform == "darwin" else rss_kib * 1024
    return {
        "schema": REPORT_SCHEMA,
        "run_id": run_id,
        "slot": slot,
        "phases_s": {k: round(v, 3) for k, v in sorted(timings.items())},
        "throughput": {
            "optimizer_steps_this_process": steps_here,
            "steps_per_s": round(steps_here / runtime, 4),
            "examples_per_s": round(steps_here * effective_batch_size / runtime, 3),
            "tokens_seen_total": train.tokens_seen,
            "train_runtime_s": round(train.train_runtime_s, 3),
        },
        "cpu": dict(train.cpu_threads),  # torch's CPU thread count and why (training.cpu_threads)
        "memory": {"peak_rss_bytes": int(rss), "peak_gpu_bytes": train.peak_gpu_memory_bytes},
        "data_validation": {"rows_total": rows.rows_total, "rows_kept": rows.rows_kept,
                            "duplicates_dropped": rows.duplicates_dropped, "by_kind": dict(sorted(rows.by_kind.items())),
                            **(validation or {})},
        "resume": {"from_step": train.resumed_from_step,
                   "rejected_checkpoints": [{"checkpoint": n, "reason": r} for n, r in train.rejected_checkpoints]},
        "losses": [[s, round(v, 6)] for s, v in train.losses],
        "checks": checks,
    }


def write(stage: Path, report: dict[str, Any]) -> dict[str, Path]:
    """Write ``report/report.json`` and ``report/loss.png`` under ``stage``; returns ``{relative: path}``."""
    folder = Path(stage) / "report"
    folder.mkdir(exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / "loss.png").write_bytes(loss_png(report["losses"], title=report["run_id"]))
    return {f"report/{name}": folder / name for name in ("report.json", "loss.png")}


def loss_png(losses: list[list[float]], *, title: str) -> bytes:
    """A PNG of the training loss per optimizer step (deterministic bytes: no timestamps)."""
    with _private_mplconfig():
        return _loss_png(losses, title=title)


@contextlib.contextmanager
def _private_mplconfig() -> Iterator[None]:
    """Unless ``MPLCONFIGDIR`` is set (``cvm-tune`` sets it for every command), matplotlib's first import writes its
    font cache to a temporary directory removed afterwards, not ``~/.cache/matplotlib`` or ``$TMPDIR``."""
    if "MPLCONFIGDIR" in os.environ or "matplotlib" in sys.modules:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="cvm-tune-mpl-") as tmp:
        os.environ["MPLCONFIGDIR"] = tmp
        try:
            yield
        finally:
            del os.environ["MPLCONFIGDIR"]


def _loss_png(losses: list[list[float]], *, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.add_subplot()
    if losses:
        ax.plot([s for s, _ in losses], [v for _, v in losses], marker="." if len(losses) < 60 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{title}: training loss")
    ax.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.91)  # fixed margins: tight_layout costs a draw
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
