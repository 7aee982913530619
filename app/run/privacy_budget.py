"""Lifetime privacy budget: epsilon spent per dataset version across runs (nights) on this output volume.

``<output>/state/privacy-budget.json`` records, per ``dataset_id`` and ``dataset_version``, each DP
run's epsilon and delta. A run *reserves* its planned epsilon before it trains (a run that dies and is
never resumed keeps its reservation: its steps touched the data) and replaces it with what it spent
when training ends. The lifetime total is the sum over runs (basic composition: a valid, conservative
bound for (epsilon, delta) guarantees); ``training.privacy.lifetime_epsilon`` caps it. The file is
replaced atomically. No torch here: ``cvm-tune status`` reads it.

The ledger is a copy, never the authority. What a run spent is also in records it cannot rewrite after the fact
(:func:`trusted_spend`): the audit chain (``run.start``/``run.resume`` commit to the planned epsilon, ``privacy.spent``
to the epsilon spent) and the exported bundles, whose manifests carry the ``privacy`` block under a quote. Before
it is used, the ledger is checked against them: a run missing from it, or recorded with less than they say, makes
it a :class:`~app.errors.PrivacyLedgerError` (exit 7), as does an epsilon that is not a finite non-negative number.
A deleted ledger is rebuilt from them.

What this does NOT protect: the host can roll the whole output volume back (chain, bundles and ledger together);
pair it with ``state.rollback_anchor``. Another dataset version (new rows) starts a new budget, although
rows shared between versions are the same people: the data owner decides what a version is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from attestation.bundle.audit import AuditEntry, AuditFormatError, parse_lines
from attestation.io.safe_yaml import parse_json

from app.dataset.versions import load_state, save_state
from app.errors import PrivacyBudgetError, PrivacyLedgerError

SCHEMA = "cvm-tune/privacy-budget/v1"
FILE = "privacy-budget.json"
STATUSES = ("reserved", "spent")
_FIX = ("restore state/privacy-budget.json from a backup of the output volume, or delete it: it is then rebuilt from "
        "the audit chain and the exported bundles")
_TOL = 1e-9  # relative: a ledger figure this much below the record is float noise, not a lower spend


def _key(dataset_id: str, version: int) -> str:
    return f"{dataset_id}@v{version}"


def _finite(value: object, low: float, high: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and low <= value <= high  # a huge int: no float()


def _valid_run(run: object) -> bool:
    return (isinstance(run, dict) and _finite(run.get("epsilon"), 0.0, math.inf)
            and _finite(run.get("delta"), 0.0, 1.0) and 0 < run["delta"] < 1 and run.get("status") in STATUSES)


def load(state_dir: Path) -> dict[str, dict[str, Any]]:
    """``{"<id>@v<version>": {"dataset_id", "dataset_version", "runs": {run_id: {"epsilon", "delta", "status"}}}}``
    (``{}`` when the file is absent).

    Raises:
        PrivacyLedgerError: the file is unreadable, not a ledger, or holds an epsilon that is not a finite number >= 0
            (or a delta outside (0, 1)).
    """
    path = Path(state_dir) / FILE
    datasets = load_state(state_dir, FILE, SCHEMA, _FIX, error=PrivacyLedgerError)
    for key, entry in datasets.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("dataset_id"), str)
              and type(entry.get("dataset_version")) is int and key == _key(entry["dataset_id"], entry["dataset_version"])
              and isinstance(entry.get("runs"), dict))
        if not ok:
            raise PrivacyLedgerError(f"{path}: the entry {str(key)[:80]!r} is malformed", fix=_FIX)
        bad = [str(rid)[:80] for rid, run in entry["runs"].items() if not _valid_run(run)]
        if bad:
            raise PrivacyLedgerError(f"{path}: run {bad[0]} of dataset {entry['dataset_id']!r} v{entry['dataset_version']} "
                                     "has no valid epsilon (a finite number >= 0), delta or status", fix=_FIX)
    return datasets


def chain_entries(path: Path) -> list[AuditEntry]:
    """The audit chain's entries, read without repairing anything (``cvm-tune status``; a partial last line is
    left out, as the next run drops it).

    Raises:
        PrivacyLedgerError: the chain cannot be parsed.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise PrivacyLedgerError(f"{path} is unreadable ({exc.strerror})") from exc
    try:
        return parse_lines(data[: data.rfind(b"\n") + 1])
    except AuditFormatError as exc:
        raise PrivacyLedgerError(f"audit log {path} is corrupt: {exc}", fix="restore it from a backup; never edit it") from exc


def trusted_spend(entries: Iterable[AuditEntry], exports: Path | None) -> dict[str, dict[str, Any]]:
    """Epsilon per run and dataset version from the records a run cannot rewrite: the audit chain (the last
    ``privacy.spent`` of a run, else the epsilon its ``run.start``/``run.resume`` planned) and the ``privacy`` block
    of every exported manifest under ``exports``; the larger figure when both know a run. Same shape as :func:`load`.

    Raises:
        PrivacyLedgerError: a record holds no valid epsilon, or a spend cannot be attributed to a dataset version.
    """
    opens: dict[str, dict[str, Any]] = {}
    spent: dict[str, tuple[Any, Any, int]] = {}
    planned: dict[str, tuple[Any, Any, int]] = {}
    for e in entries:
        if e.type in ("run.start", "run.resume"):
            opens[e.run_id] = e.data
            plan = e.data.get("privacy_planned")
            if isinstance(plan, dict):
                planned[e.run_id] = (plan.get("epsilon"), plan.get("delta"), e.seq)
        elif e.type == "privacy.spent":
            spent[e.run_id] = (e.data.get("epsilon"), e.data.get("delta"), e.seq)
    found: dict[str, dict[str, Any]] = {}

    def add(run_id: str, ds_id: object, version: object, eps: object, delta: object, where: str) -> None:
        if not isinstance(ds_id, str) or type(version) is not int:
            raise PrivacyLedgerError(f"{where}: run {run_id} spent privacy budget, but no dataset version is recorded "
                                     "for it", fix="restore the output volume's state from a backup")
        if not _valid_run({"epsilon": eps, "delta": delta, "status": "spent"}):
            raise PrivacyLedgerError(f"{where}: run {run_id} records no valid epsilon (a finite number >= 0) or delta",
                                     fix="restore the output volume's state from a backup")
        entry = found.setdefault(_key(ds_id, version), {"dataset_id": ds_id, "dataset_version": version, "runs": {}})
        old = entry["runs"].get(run_id)
        if old is None or float(eps) > old["epsilon"]:  # type: ignore[arg-type]
            entry["runs"][run_id] = {"epsilon": float(eps), "delta": float(delta), "status": "spent"}  # type: ignore[arg-type]

    for run_id, (eps, delta, seq) in {**planned, **spent}.items():  # spent replaces the plan
        ds = opens.get(run_id, {})
        add(run_id, ds.get("dataset_id"), ds.get("dataset_version"), eps, delta, f"the audit chain (seq {seq})")
    for run_id, ds_id, version, eps, delta, where in _exported(exports):
        add(run_id, ds_id, version, eps, delta, where)
    return found


def _exported(exports: Path | None) -> list[tuple[str, Any, Any, Any, Any, str]]:
    """(run id, dataset id, version, epsilon, delta, where) of every exported DP bundle."""
    rows: list[tuple[str, Any, Any, Any, Any, str]] = []
    if exports is None or not Path(exports).is_dir():
        return rows
    for path in sorted(Path(exports).glob("*/manifest.json")):
        if path.parent.name.startswith("."):  # a staged bundle, not exported
            continue
        where = f"exports/{path.parent.name}/manifest.json"
        try:
            m = parse_json(path.read_bytes(), where, PrivacyLedgerError)
        except OSError as exc:
            raise PrivacyLedgerError(f"{where} is unreadable ({exc.strerror})") from exc
        privacy = m.get("privacy") if isinstance(m, dict) else None
        if privacy is None:
            continue
        ds = m.get("dataset") if isinstance(m.get("dataset"), dict) else {}  # type: ignore[union-attr]
        if not isinstance(privacy, dict) or not isinstance(m.get("run_id"), str):  # type: ignore[union-attr]
            raise PrivacyLedgerError(f"{where} has a malformed privacy block",
                                     fix="restore the bundle from a backup of the output volume")
        rows.append((m["run_id"], ds.get("dataset_id"), ds.get("dataset_version"), privacy.get("epsilon"),  # type: ignore[index]
                     privacy.get("delta"), where))
    return rows


def check_agrees(datasets: dict[str, dict[str, Any]], trusted: dict[str, dict[str, Any]], state_dir: Path) -> None:
    """The ledger must hold every run the records know, with at least the epsilon they record.

    Raises:
        PrivacyLedgerError: it does not (it was replaced, emptied or edited); it is never trusted to allow more.
    """
    for key, entry in trusted.items():
        runs = datasets.get(key, {}).get("runs", {})
        for run_id, run in entry["runs"].items():
            got = runs.get(run_id)
            if got is None or got["epsilon"] < run["epsilon"] * (1 - _TOL) - 1e-12:
                recorded = "nothing" if got is None else f"epsilon {got['epsilon']:.6g}"
                raise PrivacyLedgerError(
                    f"{Path(state_dir) / FILE} disagrees with the audit chain and the exported bundles: run {run_id} "
                    f"spent epsilon {run['epsilon']:.6g} on dataset {entry['dataset_id']!r} v{entry['dataset_version']}, "
                    f"the ledger records {recorded}", fix=_FIX)


def rebuild_if_missing(state_dir: Path, audit_entries: list[Any], exports: Path | None = None) -> int:
    """Recreate the ledger from the audit chain and the exported bundles when the file is gone.

    Every DP run's planned epsilon (``run.start``), spent epsilon (``privacy.spent``) and exported ``privacy`` block
    name its dataset version, so deleting the file does not reset the lifetime budget. Returns the runs restored.

    Raises:
        PrivacyLedgerError: a record names no dataset version or no valid epsilon (refuse rather than under-count).
    """
    if (Path(state_dir) / FILE).exists():
        return 0
    datasets = trusted_spend(audit_entries, exports)
    if not datasets:
        return 0
    save_state(state_dir, datasets, what="the rebuilt privacy budget", file=FILE, schema=SCHEMA)
    return sum(len(e["runs"]) for e in datasets.values())


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
            delta: float, trusted: dict[str, dict[str, Any]] | None = None) -> None:
    """Check the lifetime cap and reserve this run's planned epsilon (a resumed run replaces its own reservation).

    ``trusted``: :func:`trusted_spend` of the audit chain and the exports; the ledger must agree with it.

    Raises:
        PrivacyBudgetError: the earlier runs on this dataset version plus this one would exceed ``cap``
            (nothing is written).
        PrivacyLedgerError: the ledger is damaged or disagrees with ``trusted`` (nothing is written).
        StateError: the file cannot be written.
    """
    datasets = load(state_dir)
    check_agrees(datasets, trusted or {}, state_dir)
    entry = datasets.get(_key(dataset_id, version), {})
    spent, _delta, runs = totals(entry, exclude=run_id)
    if cap is not None and not spent + epsilon <= cap:
        raise PrivacyBudgetError(
            f"privacy budget: dataset {dataset_id!r} v{version} has spent epsilon {spent:.3f} in {runs} run(s); this run "
            f"plans {epsilon:.3f}, which exceeds training.privacy.lifetime_epsilon {cap:g}")
    _record(state_dir, dataset_id, version, run_id, {"epsilon": epsilon, "delta": delta, "status": "reserved"})


def record_spent(state_dir: Path, dataset: dict[str, Any], run_id: str, privacy: dict[str, Any]) -> None:
    """Replace the run's reservation with the epsilon it spent (the manifest's ``privacy`` block)."""
    _record(state_dir, dataset["dataset_id"], int(dataset["dataset_version"]), run_id,
            {"epsilon": privacy["epsilon"], "delta": privacy["delta"], "status": "spent"})


def summary(state_dir: Path, trusted: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per dataset version: id, version, epsilon and delta sums, runs (for ``cvm-tune status``).

    Raises:
        PrivacyLedgerError: the ledger is damaged or disagrees with ``trusted``.
    """
    datasets = load(state_dir)
    check_agrees(datasets, trusted or {}, state_dir)
    rows = []
    for entry in datasets.values():
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
