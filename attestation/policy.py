"""Verification policy: explicit, closed, YAML on disk. Nothing is trusted that a policy does not name.

The built-in :data:`DEFAULT_POLICY` ("strict but practical"):

* the quote must chain to **Intel's SGX root CA** (compiled into dcap-qvl) — a simulator quote fails;
* TCB status ``UpToDate`` only (``SWHardeningNeeded``, ``OutOfDate`` ... are rejected; add them to
  ``allowed_tcb_statuses`` deliberately); ``Revoked`` is always rejected by dcap-qvl;
* TD not in debug mode, SEPT_VE_DISABLE set (never configurable);
* report_data, manifest file hashes, RTMR0-3 replay and the audit chain are always checked;
* OS-image measurements (MRTD, RTMR0-2), compose-hash and app-id are checked only when listed:
  pin them in your own policy for production (``cvm-tune compose-hash`` computes the values).

A test root (the simulator's) is trusted only by a policy that embeds its certificate under
``trusted_root`` and says ``test_only: true``; verdicts under it say it is NOT evidence of a TEE.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from attestation.errors import PolicyError

TCB_STATUSES = (
    "UpToDate",
    "SWHardeningNeeded",
    "ConfigurationNeeded",
    "ConfigurationAndSWHardeningNeeded",
    "OutOfDate",
    "OutOfDateConfigurationNeeded",
    "TDRelaunchAdvised",
    "TDRelaunchAdvisedConfigurationNeeded",
)
_HEX96 = r"^[0-9a-f]{96}$"
_HEX64 = r"^[0-9a-f]{64}$"
_HEX40 = r"^[0-9a-f]{40}$"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrustedRoot(_Closed):
    """A root CA other than Intel's: its DER certificate, hex encoded."""

    name: str = Field(min_length=1)
    der_hex: str = Field(pattern=r"^([0-9a-f]{2})+$")
    test_only: bool = Field(True, description="True for test CAs: verdicts say the quote is NOT evidence of a TEE.")

    @property
    def der(self) -> bytes:
        """The certificate bytes."""
        return bytes.fromhex(self.der_hex)


class Policy(_Closed):
    """What a relying party accepts."""

    schema_version: Literal[1] = 1
    name: str = "default"
    trusted_root: Literal["intel"] | TrustedRoot = "intel"
    allowed_tcb_statuses: tuple[str, ...] = Field(("UpToDate",), min_length=1)
    denied_advisories: tuple[str, ...] = ()
    expected_mrtd: tuple[str, ...] = Field((), description="Allowed MRTD values (hex); empty = not checked.")
    expected_rtmr0: tuple[str, ...] = ()
    expected_rtmr1: tuple[str, ...] = ()
    expected_rtmr2: tuple[str, ...] = ()
    compose_hashes: tuple[str, ...] = Field((), description="Allowed compose-hash values; empty = not checked.")
    app_ids: tuple[str, ...] = Field((), description="Allowed app-id values; empty = not checked.")
    require_rtmr3_audit: bool = Field(
        False, description="Reject bundles whose audit events were not measured into RTMR3 (EmitEvent unsupported)."
    )

    @field_validator("allowed_tcb_statuses")
    @classmethod
    def _known_statuses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [s for s in value if s not in TCB_STATUSES]
        if unknown:
            raise ValueError(f"unknown TCB status {unknown[0]!r}; known: {', '.join(TCB_STATUSES)}")
        return value

    @field_validator("expected_mrtd", "expected_rtmr0", "expected_rtmr1", "expected_rtmr2")
    @classmethod
    def _hex96(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX96, "96 lowercase hex characters (48 bytes)")

    @field_validator("compose_hashes")
    @classmethod
    def _hex64(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX64, "64 lowercase hex characters")

    @field_validator("app_ids")
    @classmethod
    def _hex40(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX40, "40 lowercase hex characters")

    @property
    def uses_test_root(self) -> bool:
        """True when the trusted root is a test CA (simulator)."""
        return isinstance(self.trusted_root, TrustedRoot) and self.trusted_root.test_only

    def to_yaml(self) -> str:
        """Serialise for a policy file."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _all_match(values: tuple[str, ...], pattern: str, what: str) -> tuple[str, ...]:
    for v in values:
        if not re.fullmatch(pattern, v):
            raise ValueError(f"{v!r} is not {what}")
    return values


DEFAULT_POLICY = Policy()


def simulator_policy(root_der: bytes) -> Policy:
    """A policy that trusts ONLY the cvm-tune simulator's TEST root CA (for demos and tests)."""
    return Policy(
        name="cvm-tune-simulator-test-ca",
        trusted_root=TrustedRoot(name="cvm-tune dstack simulator TEST root CA", der_hex=root_der.hex(), test_only=True),
    )


def policy_file_text(policy: Policy) -> str:
    """YAML for a policy file, with a warning header when it trusts a test CA."""
    head = "# Trusts ONLY a TEST root CA: never use this policy for real bundles.\n" if policy.uses_test_root else ""
    return head + policy.to_yaml()


def load_policy(path: Path | None) -> Policy:
    """Read a YAML policy file; ``None`` gives :data:`DEFAULT_POLICY`.

    Raises:
        PolicyError: unreadable file, bad YAML or schema violations.
    """
    if path is None:
        return DEFAULT_POLICY
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}", fix="pass an existing policy file") from exc
    except yaml.YAMLError as exc:
        raise PolicyError(f"policy {path} is not valid YAML") from exc
    if not isinstance(data, dict):
        raise PolicyError(f"policy {path} must be a YAML mapping")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise PolicyError(f"policy {path} is invalid: {problems}") from exc
