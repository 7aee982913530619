"""Verification policy: explicit, closed, YAML on disk. Nothing is trusted that a policy does not name.

The built-in :data:`DEFAULT_POLICY` ("strict but practical"):

* the quote must chain to **Intel's SGX root CA** (compiled into dcap-qvl) — a simulator quote fails;
* TCB status ``UpToDate`` only (``SWHardeningNeeded``, ``OutOfDate`` ... are rejected; add them to
  ``allowed_tcb_statuses`` deliberately); ``Revoked`` is always rejected by dcap-qvl;
* no TCB grace period (``outofdate_grace_period_s: 0``) and no minimum ``tcbEvaluationDataNumber``
  (``min_tcb_evaluation_data_number: null``): both off until you set them;
* TD not in debug mode, SEPT_VE_DISABLE set (never configurable);
* RTMR3 event names: dstack's own boot events before ``system-ready`` (:data:`DSTACK_BOOT_EVENTS`),
  cvm-tune's audit events after it (:data:`CVM_TUNE_APP_EVENTS`); any other name, or a name with
  ``:`` (the v1 digest cannot tell ``a:b``+``c`` from ``a``+``b:c``), is rejected;
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
from attestation.io.safe_yaml import parse_yaml
from attestation.tdx.eventlog import ENTRY_TYPES, EVENT_PREFIX
from attestation.tdx.inputs import read_bounded

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
_EVENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # no ':' (V1 digest ambiguity), no spaces
MAX_POLICY_BYTES = 1 << 20
MAX_GRACE_PERIOD_S = 90 * 86400
# RTMR3 events dstack itself writes before system-ready (dstack.md §3.4: OS 0.5.x, and the HEAD additions).
DSTACK_BOOT_EVENTS = (
    "system-preparing", "app-id", "compose-hash", "instance-id", "boot-mr-done", "mr-kms", "os-image-hash",
    "key-provider", "storage-fs", "system-ready", "init-script-hash", "gpu-policy-hash", "gpu-attestation",
    "app-epoch",  # dstack 0.6.7+, KMS: the app key epoch, after key-provider
)
# The app-compose findings of dstack 0.6 fields a policy may accept by name (check compose.audit; attestation.compose.audit).
COMPOSE_FINDINGS = ("init_script", "gpu_policy.attest_gpu", "gpu_policy.allow_devtools", "gpu_policy.allow_debug",
                    "gpu_policy.allow_insecure_boot")
CVM_TUNE_APP_EVENTS = tuple(EVENT_PREFIX + t for t in ENTRY_TYPES)


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
        False, description="Reject bundles whose audit events were not measured into RTMR3 (EmitEvent unsupported: "
        "every dstack 0.6 bundle)."
    )
    require_audit_anchors: bool = Field(
        False, description="Reject bundles whose audit chain is neither measured into RTMR3 nor anchored by a quote "
        "at each checkpoint (dstack 0.6: audit-anchors.jsonl)."
    )
    outofdate_grace_period_s: int = Field(
        0, ge=0, le=MAX_GRACE_PERIOD_S,
        description="Accept TCB status OutOfDate while the platform TCB level's tcbDate + this many seconds >= now "
        "(dcap-qvl's platform grace period); 0 = off. At most 90 days.",
    )
    min_tcb_evaluation_data_number: int | None = Field(
        None, ge=1,
        description="Reject collateral whose tcbEvaluationDataNumber (min of TCB info and QE identity) is lower: "
        "a PCCS cannot forge collateral but can serve stale collateral that hides a TCB recovery. null = off.",
    )
    max_epsilon: float | None = Field(
        None, gt=0, description="Require differential privacy (check privacy.policy): reject bundles trained without "
        "DP-SGD or whose epsilon (recomputed from the manifest, at its delta) is above this. null = not required.",
    )
    max_delta: float | None = Field(None, gt=0, lt=1, description="Require differential privacy with a delta at most "
                                    "this (check privacy.policy). null = any.")
    allowed_compose_findings: tuple[str, ...] = Field(
        (), description="app-compose findings accepted by name (check compose.audit): init_script, "
        "gpu_policy.attest_gpu (false), gpu_policy.allow_devtools / allow_debug / allow_insecure_boot (true). "
        "Empty = every finding fails.",
    )
    expected_gpu_policy_hashes: tuple[str, ...] = Field(
        (), description="Allowed gpu-policy-hash values (SHA-256 of the JCS of requirements.gpu_policy; "
        "44136fa3...aff8a when there is none); empty = not checked (check gpu.policy).",
    )
    allowed_boot_events: tuple[str, ...] = Field(
        DSTACK_BOOT_EVENTS, description="RTMR3 event names allowed before system-ready (dstack's own boot events)."
    )
    allowed_app_events: tuple[str, ...] = Field(
        CVM_TUNE_APP_EVENTS, description="RTMR3 event names allowed after system-ready (the app's own events)."
    )

    @field_validator("allowed_tcb_statuses")
    @classmethod
    def _known_statuses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_known(value, TCB_STATUSES, "TCB status")

    @field_validator("expected_mrtd", "expected_rtmr0", "expected_rtmr1", "expected_rtmr2")
    @classmethod
    def _hex96(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX96, "96 lowercase hex characters (48 bytes)")

    @field_validator("allowed_compose_findings")
    @classmethod
    def _findings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_known(value, COMPOSE_FINDINGS, "compose finding")

    @field_validator("compose_hashes", "expected_gpu_policy_hashes")
    @classmethod
    def _hex64(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX64, "64 lowercase hex characters")

    @field_validator("app_ids")
    @classmethod
    def _hex40(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _HEX40, "40 lowercase hex characters")

    @field_validator("allowed_boot_events", "allowed_app_events")
    @classmethod
    def _event_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(value, _EVENT_NAME, "an event name (letters, digits, '.', '_', '-'; never ':')")

    @property
    def uses_test_root(self) -> bool:
        """True when the trusted root is a test CA (simulator)."""
        return isinstance(self.trusted_root, TrustedRoot) and self.trusted_root.test_only

    def to_yaml(self) -> str:
        """Serialise for a policy file."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _all_known(values: tuple[str, ...], known: tuple[str, ...], what: str) -> tuple[str, ...]:
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}; known: {', '.join(known)}")
    return values


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
    text = read_bounded(Path(path), MAX_POLICY_BYTES, PolicyError, "policy")
    data = parse_yaml(text, f"policy {path}", PolicyError)
    if not isinstance(data, dict):
        raise PolicyError(f"policy {path} must be a YAML mapping")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise PolicyError(f"policy {path} is invalid: {problems}") from exc
