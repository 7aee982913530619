"""The verifier's result: named checks, the findings behind them, and the ``--json`` schema.

A :class:`Verdict` accepts iff no :class:`Check` failed. :meth:`Verdict.to_json` is the stable
``cvm-tune/verdict/v1`` document (docs/verifier.md, "--json"); fields are only ever added within v1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

import dcap_qvl

from attestation.tdx.dcap import Collateral
from attestation.tdx.eventlog import BootInfo
from attestation.tdx.quote import Quote

if TYPE_CHECKING:
    from attestation.policy import Policy

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One named verification step."""

    name: str
    status: Status
    detail: str


@dataclass
class QuoteFindings:
    """What the quote-level steps learned (for the bundle level and the JSON output)."""

    quote: Quote | None = None
    tcb_status: str | None = None
    advisory_ids: tuple[str, ...] = ()
    tcb_date: int | None = None
    collateral: Collateral | None = None
    tcb_evaluation_data_number: int | None = None
    boot: BootInfo | None = None
    replayed: tuple[bytes, ...] | None = None
    bundle: dict[str, Any] | None = None  # run id, creation time, audit head (freshness: case 63)
    gpu: tuple[str, str] | None = None  # bundles: (verified | not_verified | none, why) (attestation.tdx.gpu_dstack)
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: Status, detail: str) -> None:
        self.checks.append(Check(name, status, detail))


@dataclass(frozen=True)
class Verdict:
    """The result: accepted iff no check failed."""

    checks: tuple[Check, ...]
    policy_name: str
    test_root: bool
    now: int
    findings: QuoteFindings

    @classmethod
    def of(cls, findings: QuoteFindings, policy: Policy, now: int) -> Verdict:
        """The verdict of ``findings``' checks (so far) under ``policy`` at ``now``."""
        return cls(tuple(findings.checks), policy.name, policy.uses_test_root, now, findings)

    @property
    def accepted(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.status == "fail")

    def summary(self) -> str:
        """One human line: the verdict and, for a test root, that it is not TEE evidence."""
        word = "ACCEPTED" if self.accepted else "REJECTED"
        line = f"{word} under policy '{self.policy_name}'"
        if self.test_root:
            line += " — quote signed by a TEST CA (the cvm-tune simulator): this is NOT evidence of a real TEE"
        if self.findings.gpu is not None and self.findings.gpu[0] == "not_verified":
            line += f" — {self.findings.gpu[1]}"
        return line

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` schema (see docs/verifier.md, "--json")."""
        f = self.findings
        td = f.quote.td if f.quote else None
        return {
            "schema": "cvm-tune/verdict/v1",
            "verdict": "accepted" if self.accepted else "rejected",
            "policy": self.policy_name,
            "test_root": self.test_root,
            "now": self.now,
            "checks": [{"name": c.name, "status": c.status, "reason": c.detail} for c in self.checks],
            "tcb_status": f.tcb_status,
            "advisory_ids": list(f.advisory_ids),
            "measurements": None
            if td is None
            else {
                "mrtd": td.mr_td.hex(),
                "rtmr0": td.rt_mr0.hex(),
                "rtmr1": td.rt_mr1.hex(),
                "rtmr2": td.rt_mr2.hex(),
                "rtmr3": td.rt_mr3.hex(),
                "mr_config_id": td.mr_config_id.hex(),
                "report_data": td.report_data.hex(),
            },
            "replayed_rtmrs": [m.hex() for m in f.replayed] if f.replayed else None,
            "compose_hash": f.boot.hex("compose-hash") if f.boot else None,
            "app_id": f.boot.hex("app-id") if f.boot else None,
            "quote_hex": f.quote.raw.hex() if f.quote else None,
            "tcb_date": iso_utc(f.tcb_date),
            "collateral": None
            if f.collateral is None
            else {
                "not_before": iso_utc(f.collateral.not_before),
                "not_after": iso_utc(f.collateral.not_after),
                "tcb_evaluation_data_number": f.tcb_evaluation_data_number,
            },
            "bundle": f.bundle,
            "gpu": None if f.gpu is None else {"status": f.gpu[0], "reason": f.gpu[1]},
            "verifier": {"cvm_tune": _version("cvm-tune"), "dcap_qvl": dcap_qvl.__version__},
        }


def iso_utc(ts: int | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
