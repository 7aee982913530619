"""cvm-tune attestation: TDX quotes, dstack event logs, manifest binding and verification.

Imports only the standard library, ``cryptography``, ``dcap-qvl``, ``pydantic`` and ``PyYAML`` —
never torch or the training stack — so a relying party can verify bundles on a small machine.

Public API::

    from attestation import load_policy, verify_bundle, verify_quote, parse_collateral, DEFAULT_POLICY
    verdict = verify_bundle(Path("exports/<run_id>"), policy=load_policy(None), now=int(time.time()))
    verdict.accepted, verdict.failed, verdict.to_json()
"""

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
)
from attestation.eventlog import parse_event_log, replay
from attestation.policy import DEFAULT_POLICY, Policy, TrustedRoot, load_policy
from attestation.quote import Quote, decode_quote_input, read_quote_file
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
    "TrustedRoot",
    "Verdict",
    "decode_quote_input",
    "load_policy",
    "manifest_report_data",
    "parse_collateral",
    "parse_event_log",
    "read_quote_file",
    "replay",
    "verify_bundle",
    "verify_quote",
]
