"""The attestation package's one exception hierarchy.

These are *input* errors: the verifier could not read what it was given. A quote or bundle that
reads fine but fails a check is not an exception: it is a :class:`attestation.verify.Verdict`
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


class EventLogError(AttestationError):
    """The event log is not valid dstack event-log JSON."""


class CollateralError(AttestationError):
    """The collateral JSON is unreadable."""


class PolicyError(AttestationError):
    """The policy file is invalid."""

    default_fix = "correct the policy file (YAML; see README 'Verification policy')"


class BundleError(AttestationError):
    """The export bundle cannot be read (missing directory, unreadable manifest)."""
