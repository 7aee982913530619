"""cvm-tune attestation: TDX quotes, dstack event logs, manifest binding and verification.

Imports only the standard library, ``cryptography``, ``dcap-qvl``, ``pydantic`` and ``PyYAML`` —
never torch or the training stack — so a relying party can verify bundles on a small machine.
Verification is offline; the one networked module, :mod:`attestation.pccs` (collateral from a
PCCS, with ``requests``), is not imported by ``import attestation``.

Public API::

    from attestation import load_policy, verify_bundle, verify_quote, parse_collateral, DEFAULT_POLICY
    verdict = verify_bundle(Path("exports/<run_id>"), policy=load_policy(None), now=int(time.time()))
    verdict.accepted, verdict.failed, verdict.to_json()

    from attestation.verify import quote_verdict   # one quote (cvm-tune verify-quote)
    verdict = quote_verdict(raw, policy=..., now=..., collateral=read_collateral_file(path), events=..., expected_report_data=...)
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers
    from attestation.bundle import Manifest, manifest_report_data
    from attestation.bundle_verify import verify_bundle
    from attestation.dcap import Collateral, parse_collateral
    from attestation.errors import (
        AttestationError,
        BundleError,
        CollateralError,
        EventLogError,
        PolicyError,
        QuoteParseError,
        ReportDataError,
    )
    from attestation.eventlog import parse_event_log, replay
    from attestation.inputs import (
        decode_quote_input,
        parse_report_data_hex,
        read_collateral_file,
        read_event_log_file,
        read_quote_file,
        read_quote_input,
    )
    from attestation.policy import DEFAULT_POLICY, Policy, TrustedRoot, load_policy
    from attestation.quote import Quote
    from attestation.verify import Check, Verdict, verify_quote

# Loaded on first use (PEP 562): `import attestation.errors` or `from attestation import AttestationError`
# does not build the pydantic models or load dcap-qvl, so a CLI start pays only for what it uses.
_EXPORTS = {
    "AttestationError": "attestation.errors",
    "BundleError": "attestation.errors",
    "Check": "attestation.verify",
    "Collateral": "attestation.dcap",
    "CollateralError": "attestation.errors",
    "DEFAULT_POLICY": "attestation.policy",
    "EventLogError": "attestation.errors",
    "Manifest": "attestation.bundle",
    "Policy": "attestation.policy",
    "PolicyError": "attestation.errors",
    "Quote": "attestation.quote",
    "QuoteParseError": "attestation.errors",
    "ReportDataError": "attestation.errors",
    "TrustedRoot": "attestation.policy",
    "Verdict": "attestation.verify",
    "decode_quote_input": "attestation.inputs",
    "load_policy": "attestation.policy",
    "manifest_report_data": "attestation.bundle",
    "parse_collateral": "attestation.dcap",
    "parse_event_log": "attestation.eventlog",
    "parse_report_data_hex": "attestation.inputs",
    "read_collateral_file": "attestation.inputs",
    "read_event_log_file": "attestation.inputs",
    "read_quote_file": "attestation.inputs",
    "read_quote_input": "attestation.inputs",
    "replay": "attestation.eventlog",
    "verify_bundle": "attestation.bundle_verify",
    "verify_quote": "attestation.verify",
}

__all__ = [
    "DEFAULT_POLICY",
    "AttestationError",
    "BundleError",
    "Check",
    "Collateral",
    "CollateralError",
    "EventLogError",
    "Manifest",
    "Policy",
    "PolicyError",
    "Quote",
    "QuoteParseError",
    "ReportDataError",
    "TrustedRoot",
    "Verdict",
    "decode_quote_input",
    "load_policy",
    "manifest_report_data",
    "parse_collateral",
    "parse_event_log",
    "parse_report_data_hex",
    "read_collateral_file",
    "read_event_log_file",
    "read_quote_file",
    "read_quote_input",
    "replay",
    "verify_bundle",
    "verify_quote",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attestation' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
