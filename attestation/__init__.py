"""cvm-tune attestation: TDX quotes, dstack event logs, manifest binding and verification.

Imports only the standard library, ``cryptography``, ``dcap-qvl``, ``pydantic`` and ``PyYAML`` —
never torch or the training stack — so a relying party can verify bundles on a small machine.
Verification is offline; the one networked module, :mod:`attestation.tdx.pccs` (collateral from a
PCCS, with ``requests``), is not imported by ``import attestation``.

Public API::

    from attestation import load_policy, verify_bundle, verify_quote, parse_collateral, DEFAULT_POLICY
    verdict = verify_bundle(Path("exports/<run_id>"), policy=load_policy(None), now=int(time.time()))
    verdict.accepted, verdict.failed, verdict.to_json()

    from attestation.verify import quote_verdict   # one quote (cvm-tune verify-quote)
    verdict = quote_verdict(raw, policy=..., now=..., collateral=read_collateral_file(path), events=..., expected_report_data=...)
"""

from attestation.bundle.manifest import Manifest, manifest_report_data
from attestation.bundle.verify import verify_bundle
from attestation.tdx.dcap import Collateral, parse_collateral
from attestation.errors import (
    AttestationError,
    BundleError,
    CollateralError,
    EventLogError,
    PolicyError,
    QuoteParseError,
    ReportDataError,
)
from attestation.tdx.eventlog import parse_event_log, replay
from attestation.tdx.inputs import (
    decode_quote_input,
    parse_report_data_hex,
    read_collateral_file,
    read_event_log_file,
    read_quote_file,
    read_quote_input,
)
from attestation.policy import DEFAULT_POLICY, Policy, TrustedRoot, load_policy
from attestation.tdx.quote import Quote
from attestation.verify import Check, Verdict, verify_quote

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
