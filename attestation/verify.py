"""Quote verification against an explicit policy at an explicit time.

``verify_quote(quote, policy=..., now=..., collateral=..., events=..., expected_report_data=...)``
runs the numbered quote-level steps; ``attestation.verify_bundle`` adds the bundle-level ones.
Every step is a named :class:`Check` (pass / fail / skip with a reason); the verdict accepts only
when no check failed. Nothing is taken from a field that can be recomputed: report_data is
recomputed from the manifest bytes, RTMR0-3 from the event log, RTMR3 digests from payloads.

Steps (quote level):
 1. ``quote.parse``        the bytes are a DCAP quote
 2. ``quote.tee_type``     TDX (an SGX quote is rejected)
 3. ``quote.padding``      nothing but zero padding after the declared signature data
 4. ``collateral.window``  collateral present and valid at ``now`` (else: cannot verify)
 5. ``quote.signature``    dcap-qvl: chain to the policy's root, CRLs, TCB info, QE identity, signatures
 6. ``quote.tcb_status``   status in the policy's allow-list, no denied advisory
 7. ``quote.td_attributes`` not debug, SEPT_VE_DISABLE set, MRSIGNERSEAM zero
 8. ``report_data``        equals the expected value (when one is given)
 9. ``event_log.replay``   RTMR0-3 recomputed from the log equal the quote's
10. ``event_log.boot``     system-ready present, trusted boot events once and before it
11. ``policy.measurements`` MRTD/RTMR0-2 in the policy's allow-lists (skip when none listed)
12. ``policy.compose_hash`` / ``policy.app_id`` from the event log in the policy's lists (skip when none)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from attestation.dcap import Collateral, dcap_verify
from attestation.errors import QuoteParseError
from attestation.eventlog import BootInfo, Event, boot_info, replay
from attestation.policy import Policy
from attestation.quote import Quote, TdReport

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
    boot: BootInfo | None = None
    replayed: tuple[bytes, ...] | None = None
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
        return line

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` schema (see README, "verify --json")."""
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
        }


def verify_quote(
    raw: bytes,
    *,
    policy: Policy,
    now: int,
    collateral: Collateral | None,
    events: tuple[Event, ...] | None = None,
    expected_report_data: bytes | None = None,
    findings: QuoteFindings | None = None,
) -> QuoteFindings:
    """Run steps 1-12 and return the findings (checks appended in order)."""
    f = findings or QuoteFindings()
    # (1) parse
    try:
        q = Quote.from_bytes(raw)
    except QuoteParseError as exc:
        f.add("quote.parse", "fail", exc.message)
        return f
    f.quote = q
    f.add("quote.parse", "pass", f"DCAP v{q.version} {q.tee_name} quote, {len(q.raw)} bytes")
    # (2) TEE type
    if q.td is None:
        f.add("quote.tee_type", "fail", f"{q.tee_name} quote: cvm-tune attests Intel TDX CVMs only")
        return f
    f.add("quote.tee_type", "pass", "TDX")
    # (3) nothing unsigned but zero padding (real dstack quotes carry 70 zero bytes)
    if any(q.trailing):
        f.add("quote.padding", "fail", f"{len(q.trailing)} bytes after the signed region are not all zero")
    else:
        f.add("quote.padding", "pass", f"{len(q.trailing)} zero padding bytes after the signed region")
    # (4) + (5) + (6) collateral window, signature chain, TCB status
    _signature_steps(f, q, policy, now, collateral)
    # (7) TD attributes
    problems = q.td.attribute_problems()
    f.add("quote.td_attributes", "fail" if problems else "pass", "; ".join(problems) or "not debug, SEPT_VE_DISABLE set")
    # (8) report_data
    if expected_report_data is None:
        f.add("report_data", "skip", "no expected report_data given")
    elif q.td.report_data == expected_report_data.ljust(64, b"\0"):
        f.add("report_data", "pass", "all 64 bytes equal the expected value")
    else:
        f.add("report_data", "fail", "report_data differs from the expected value (quote is for other content)")
    # (9) + (10) event log
    if events is None:
        f.add("event_log.replay", "skip", "no event log given: RTMRs not replayed")
    else:
        _event_log_steps(f, q.td, events)
    # (11) + (12) policy pins
    _policy_steps(f, q.td, policy)
    return f


def _signature_steps(f: QuoteFindings, q: Quote, policy: Policy, now: int, coll: Collateral | None) -> None:
    if coll is None:
        f.add("collateral.window", "fail", "no collateral: the quote signature cannot be verified")
        return
    if not coll.not_before <= now <= coll.not_after:
        f.add(
            "collateral.window",
            "fail",
            f"cannot verify: collateral valid {coll.not_before}..{coll.not_after}, now is {now} "
            "(fetch fresh collateral, or pass --now inside the window for an as-of check)",
        )
        return
    f.add("collateral.window", "pass", f"valid {coll.not_before}..{coll.not_after}")
    root = None if policy.trusted_root == "intel" else policy.trusted_root.der
    root_name = "Intel SGX root CA" if root is None else f"test root '{policy.trusted_root.name}'"
    res = dcap_verify(q.raw, coll, root_der=root, now=now)
    if not res.ok:
        f.add("quote.signature", "fail", f"dcap-qvl rejected it against the {root_name}: {res.error}")
        return
    f.add("quote.signature", "pass", f"chains to the {root_name}; TCB info, QE identity and CRLs verified")
    f.tcb_status, f.advisory_ids = res.status, res.advisory_ids
    denied = sorted(set(res.advisory_ids) & set(policy.denied_advisories))
    advisories = f" advisories: {', '.join(res.advisory_ids)}" if res.advisory_ids else ""
    if res.status not in policy.allowed_tcb_statuses:
        f.add("quote.tcb_status", "fail", f"TCB status {res.status} not in {list(policy.allowed_tcb_statuses)};{advisories}")
    elif denied:
        f.add("quote.tcb_status", "fail", f"denied advisories present: {', '.join(denied)}")
    else:
        f.add("quote.tcb_status", "pass", f"{res.status}{';' + advisories if advisories else ''}")


def _event_log_steps(f: QuoteFindings, td: TdReport, events: tuple[Event, ...]) -> None:
    rep = replay(events)
    f.replayed = rep.rtmrs
    bad = [f"RTMR{i}" for i in range(4) if rep.rtmrs[i] != td.rtmrs[i]]
    if rep.problems or bad:
        detail = "; ".join([*rep.problems, *(f"{n} replay differs from the quote" for n in bad)])
        f.add("event_log.replay", "fail", detail)
    else:
        f.add("event_log.replay", "pass", f"RTMR0-3 replayed from {len(events)} events (RTMR3 digests recomputed)")
    f.boot = boot_info(events)
    f.add("event_log.boot", "fail" if f.boot.problems else "pass", "; ".join(f.boot.problems) or "boot events well-formed")


def _policy_steps(f: QuoteFindings, td: TdReport, policy: Policy) -> None:
    pins = {
        "MRTD": (policy.expected_mrtd, td.mr_td),
        "RTMR0": (policy.expected_rtmr0, td.rt_mr0),
        "RTMR1": (policy.expected_rtmr1, td.rt_mr1),
        "RTMR2": (policy.expected_rtmr2, td.rt_mr2),
    }
    listed = {k: v for k, v in pins.items() if v[0]}
    if not listed:
        f.add("policy.measurements", "skip", "policy pins no OS-image measurements")
    else:
        wrong = [k for k, (allowed, got) in listed.items() if got.hex() not in allowed]
        f.add("policy.measurements", "fail" if wrong else "pass", f"not allowed: {', '.join(wrong)}" if wrong else
              f"{', '.join(listed)} allowed")
    for name, allowed, event in (("policy.compose_hash", policy.compose_hashes, "compose-hash"), ("policy.app_id", policy.app_ids, "app-id")):
        if not allowed:
            f.add(name, "skip", f"policy lists no {event} values")
            continue
        got = f.boot.hex(event) if f.boot else None
        ok = got is not None and got in allowed
        f.add(name, "pass" if ok else "fail", f"{event} {got or '(absent)'} {'is' if ok else 'is not'} allowed")
