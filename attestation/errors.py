"""The attestation package's one exception hierarchy.

These are *input* errors: the verifier could not read what it was given. A quote or bundle that
reads fine but fails a check is not an exception: it is a :class:`attestation.verdict.Verdict`
with failed checks. The CLI maps :class:`AttestationError` to exit code 2.
"""

from __future__ import annotations


class AttestationError(Exception):
    """Base class: a one-line message plus a fix."""

    exit_code = 2
    default_fix = "check the file you passed"

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix or self.default_fix


class QuoteParseError(AttestationError):
    """The bytes are not a well-formed DCAP quote."""

    default_fix = "pass a DCAP quote: raw bytes, hex text (0x and whitespace allowed) or a dstack GetQuote JSON response"


class EventLogError(AttestationError):
    """The event log is not valid dstack event-log JSON."""

    default_fix = "pass the event log returned with the quote (GetQuote's event_log: a JSON list of events)"


class CollateralError(AttestationError):
    """The collateral JSON is unreadable."""

    default_fix = "pass collateral JSON as written by `cvm-tune collateral QUOTE -o FILE` (dcap-qvl QuoteCollateralV3)"


class PolicyError(AttestationError):
    """The policy file is invalid."""

    default_fix = "correct the policy file (YAML; see docs/verifier.md, 'Policy file')"


class BundleError(AttestationError):
    """The export bundle cannot be read (missing directory, unreadable manifest)."""


class ReportDataError(AttestationError):
    """An expected report_data value given on the command line is not valid hex of at most 64 bytes."""

    default_fix = "pass the expected report_data as hex, at most 128 hex digits (shorter values are zero-padded)"
