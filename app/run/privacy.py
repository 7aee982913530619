"""The pipeline's differential-privacy steps (``training.privacy.mode: dp-sgd``; each a no-op when it is off).

1. :func:`plan_stage`, once the training rows are known and before anything is written: the DP-SGD plan (noise
   multiplier derived or checked, delta below 1/N); a run that cannot fit its budget is refused (exit 2).
2. :func:`reserve_stage`, once the run id is known: the lifetime budget of the dataset version is checked and the
   planned epsilon reserved (``app.run.privacy_budget``).
3. :func:`spent_stage`, after training: the ``privacy.spent`` audit entry (the manifest's ``privacy`` block) and
   the ledger's record of what the run actually spent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import alerts
from app.run import privacy_budget
from app.audit import AuditLog, AuditRecorder
from app.errors import PrivacyLedgerError

if TYPE_CHECKING:
    from app.config import Config
    from app.training.privacy import PrivacyPlan


def plan_stage(cfg: Config, rows: int, progress: Callable[[str], None]) -> PrivacyPlan | None:
    """The DP-SGD plan for ``rows`` training rows (``None``: DP off).

    Raises:
        ConfigError: the configured budget cannot fit the run (exit 2; nothing written).
    """
    if cfg.training.privacy.mode == "off":
        return None
    from app.training.privacy import plan

    dp = plan(cfg.training, rows=rows)
    if dp is None:
        return None
    how = "derived" if dp.noise_derived else "configured"
    progress(f"privacy: DP-SGD, target (ε, δ) = ({dp.target_epsilon:g}, {dp.delta:.3g}), noise σ={dp.noise_multiplier:.4g} "
             f"({how}), clipping C={dp.max_grad_norm:g}, Poisson q={dp.sample_rate:.4g} of N={rows} rows, "
             f"{dp.max_steps} steps plan ε={dp.planned_epsilon:.4g} ({dp.accountant})")
    return dp


def reserve_stage(cfg: Config, out: Path, dataset: dict[str, Any], run_id: str, dp: PrivacyPlan | None) -> None:
    """Check the dataset version's lifetime cap and reserve the planned epsilon for ``run_id``. The spend so far is
    the ledger's only where it agrees with the audit chain and the exported bundles (``privacy_budget``).

    Raises:
        PrivacyBudgetError: the cap would be exceeded (exit 2; nothing trained).
        PrivacyLedgerError: the ledger is damaged or disagrees with those records (exit 7; an alert is sent).
        StateError: the ledger cannot be written.
    """
    if dp is None:
        return
    entries = AuditLog(out / "state" / "audit.jsonl").entries
    try:
        if not (out / "state" / privacy_budget.FILE).exists():  # deleted? rebuilt from the chain and the bundles
            privacy_budget.rebuild_if_missing(out / "state", entries, out / "exports")
        privacy_budget.reserve(out / "state", cap=cfg.training.privacy.lifetime_epsilon,
                               dataset_id=dataset["dataset_id"], version=int(dataset["dataset_version"]), run_id=run_id,
                               epsilon=dp.planned_epsilon, delta=dp.delta,
                               trusted=privacy_budget.trusted_spend(entries, out / "exports"))
    except PrivacyLedgerError as exc:
        alerts.send(cfg.alerts, {"event": "state.inconsistent", "run_id": run_id, "reason": exc.message}, output=out)
        raise


def commitment(dp: PrivacyPlan | None) -> dict[str, Any]:
    """What ``run.start``/``run.resume`` commit to for DP: the planned epsilon, so that the audit chain holds the
    reservation of a run that dies before it records ``privacy.spent``."""
    return {} if dp is None else {"privacy_planned": {"epsilon": dp.planned_epsilon, "delta": dp.delta}}


def spent_stage(recorder: AuditRecorder, out: Path, dataset: dict[str, Any], run_id: str, result: Any,
                progress: Callable[[str], None]) -> None:
    """Audit ``privacy.spent`` and replace the run's reservation with what it spent (``result``: the TrainResult)."""
    spent = result.privacy
    if spent is None:
        return
    recorder.record(run_id, "privacy.spent", spent)
    privacy_budget.record_spent(out / "state", dataset, run_id, spent)
    progress(f"privacy: spent (ε, δ) = ({spent['epsilon']:.4g}, {spent['delta']:.3g}) in {spent['steps']} DP-SGD steps")
