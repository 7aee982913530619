"""Lifetime privacy budget: epsilon spent per dataset version across runs (nights) on this output volume.

``<output>/state/privacy-budget.json`` records, per ``dataset_id`` and ``dataset_version``, each DP
run's epsilon and delta. A run *reserves* its planned epsilon before it trains (a run that dies and is
never resumed keeps its reservation: its steps touched the data) and replaces it with what it spent
when training ends. The lifetime total is the sum over runs (basic composition: a valid, conservative
bound for (epsilon, delta) guarantees); ``training.privacy.lifetime_epsilon`` caps it. The file is
replaced atomically. No torch here: ``cvm-tune status`` reads it.

What this does NOT protect: the host can roll the output volume back (this file with it); pair it
with ``state.rollback_anchor``. Another dataset version (new rows) starts a new budget, although
rows shared between versions are the same people: the data owner decides what a version is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.dataset.versions import load_state, save_state
from app.errors import PrivacyBudgetError, StateError

SCHEMA = "cvm-tune/privacy-budget/v1"
FILE = "privacy-budget.json"


def _key(dataset_id: str, version: int) -> str:
    return f"{dataset_id}@v{version}"


def load(state_dir: Path) -> dict[str, dict[str, Any]]:
    """``{"<id>@v<version>": {"dataset_id", "dataset_version", "runs": {run_id: {"epsilon", "delta", "status"}}}}``."""
    return load_state(state_dir, FILE, SCHEMA, "restore it from a backup; without it the lifetime privacy budget is unknown")


def rebuild_if_missing(state_dir: Path, audit_entries: list[Any]) -> int:
    """Recreate the ledger from the audit chain when the file is gone but DP runs were recorded.

    Every ``privacy.spent`` entry holds a run's epsilon and delta, and that run's ``run.start``/``run.resume``
    names its dataset id and version, so deleting the file does not reset the lifetime budget. (Reservations of runs
    that died before spending are not in the chain: those runs released nothing.) Returns the runs restored.

    Raises:
        StateError: a ``privacy.spent`` entry whose run names no dataset version (refuse rather than under-count).
    """
    if (Path(state_dir) / FILE).exists():
        return 0
    spent = [e for e in audit_entries if e.type == "privacy.spent"]
    if not spent:
        return 0
    opens = {e.run_id: e.data for e in audit_entries if e.type in ("run.start", "run.resume")}
    datasets: dict[str, dict[str, Any]] = {}
    for e in spent:
        ds_id, version = opens.get(e.run_id, {}).get("dataset_id"), opens.get(e.run_id, {}).get("dataset_version")
        if not isinstance(ds_id, str) or not isinstance(version, int):
            raise StateError(f"{Path(state_dir) / FILE} is missing and the audit chain cannot say which dataset version "
                             f"run {e.run_id} spent its privacy budget on",
                             fix="restore state/privacy-budget.json from a backup of the output volume")
        entry = datasets.setdefault(_key(ds_id, version), {"dataset_id": ds_id, "dataset_version": version, "runs": {}})
        entry["runs"][e.run_id] = {"epsilon": float(e.data["epsilon"]), "delta": float(e.data["delta"]), "status": "spent"}
    save_state(state_dir, datasets, what="the rebuilt privacy budget", file=FILE, schema=SCHEMA)
    return len(spent)


def totals(entry: dict[str, Any], *, exclude: str | None = None) -> tuple[float, float, int]:
    """(epsilon sum, delta sum, runs) of one dataset version, without run ``exclude``."""
    runs = [r for rid, r in entry.get("runs", {}).items() if rid != exclude]
    return sum(float(r["epsilon"]) for r in runs), sum(float(r["delta"]) for r in runs), len(runs)


def _record(state_dir: Path, dataset_id: str, version: int, run_id: str, run: dict[str, Any]) -> None:
    datasets = load(state_dir)
    entry = datasets.setdefault(_key(dataset_id, version), {"dataset_id": dataset_id, "dataset_version": version, "runs": {}})
    entry["runs"][run_id] = run
    save_state(state_dir, datasets, what="the privacy budget", file=FILE, schema=SCHEMA)


def reserve(state_dir: Path, *, cap: float | None, dataset_id: str, version: int, run_id: str, epsilon: float,
            delta: float) -> None:
    """Check the lifetime cap and reserve this run's planned epsilon (a resumed run replaces its own reservation).

    Raises:
        PrivacyBudgetError: the earlier runs on this dataset version plus this one would exceed ``cap``
            (nothing is written).
        StateError: the file cannot be read or written.
    """
    entry = load(state_dir).get(_key(dataset_id, version), {})
    spent, _delta, runs = totals(entry, exclude=run_id)
    if cap is not None and spent + epsilon > cap:
        raise PrivacyBudgetError(
            f"privacy budget: dataset {dataset_id!r} v{version} has spent epsilon {spent:.3f} in {runs} run(s); this run "
            f"plans {epsilon:.3f}, which exceeds training.privacy.lifetime_epsilon {cap:g}")
    _record(state_dir, dataset_id, version, run_id, {"epsilon": epsilon, "delta": delta, "status": "reserved"})


def record_spent(state_dir: Path, dataset: dict[str, Any], run_id: str, privacy: dict[str, Any]) -> None:
    """Replace the run's reservation with the epsilon it spent (the manifest's ``privacy`` block)."""
    _record(state_dir, dataset["dataset_id"], int(dataset["dataset_version"]), run_id,
            {"epsilon": privacy["epsilon"], "delta": privacy["delta"], "status": "spent"})


def summary(state_dir: Path) -> list[dict[str, Any]]:
    """One row per dataset version: id, version, epsilon and delta sums, runs (for ``cvm-tune status``)."""
    rows = []
    for entry in load(state_dir).values():
        eps, delta, runs = totals(entry)
        rows.append({"dataset_id": entry["dataset_id"], "dataset_version": entry["dataset_version"],
                     "epsilon": eps, "delta": delta, "runs": runs})
    return rows


def privacy_lines(budget: list[dict[str, Any]], cap: float | None) -> list[str]:
    """``cvm-tune status`` lines: epsilon spent per dataset version, the lifetime cap and what is left of it."""
    lines = []
    for b in budget:
        left = f", lifetime cap {cap:g} ({max(cap - b['epsilon'], 0.0):.4g} left)" if cap is not None else ""
        lines.append(f"privacy: dataset {b['dataset_id']} v{b['dataset_version']}: epsilon {b['epsilon']:.4g} spent in "
                     f"{b['runs']} DP run(s) (delta {b['delta']:.3g}){left}")
    return lines
