"""Quote verification against an explicit policy at an explicit time.

``verify_quote(quote, policy=..., now=..., collateral=..., events=..., expected_report_data=...)``
runs the numbered quote-level steps; ``attestation.verify_bundle`` adds the bundle-level ones.
Every step is a named :class:`Check` (pass / fail / skip with a reason); the verdict accepts only
when no check failed. Nothing is taken from a field that can be recomputed: report_data is
recomputed from the manifest bytes, RTMR0-3 from the event log, RTMR3 digests from payloads.

Steps (quote level):
 1. ``quote.parse``        the bytes are a DCAP quote; TDX signature data exactly as declared
 2. ``quote.tee_type``     TDX (an SGX quote is rejected)
 3. ``quote.padding``      nothing but zero bytes after the declared signature data
 4. ``quote.cert_chain``   the quote's PCK chain: canonical PEM + one NUL, each cert issued by the
                           next, ending in the policy's root
 5. ``collateral.window``  collateral present and valid at ``now`` (else: cannot verify)
 6. ``collateral.chains``  collateral PEM chains canonical and issued up to the root; CRLs signed by
                           their issuers; a ``pck_certificate_chain`` equal to the quote's chain
 7. ``quote.signature``    dcap-qvl: chain to the policy's root, CRLs, TCB info, QE identity, signatures
 8. ``quote.tcb_status``   status in the policy's allow-list (or OutOfDate inside the policy's grace
                           period), no denied advisory
 9. ``collateral.tcb_evaluation`` tcbEvaluationDataNumber >= the policy's minimum (skip when none)
10. ``quote.td_attributes`` not debug, SEPT_VE_DISABLE set, MRSIGNERSEAM zero
11. ``report_data``        equals the expected value (when one is given)
12. ``event_log.replay``   RTMR0-3 recomputed from the log equal the quote's
13. ``event_log.boot``     system-ready present, trusted boot events once and before it
14. ``event_log.names``    RTMR3 names in the policy's boot / app allow-lists, none with ':'
15. ``policy.measurements`` MRTD/RTMR0-2 in the policy's allow-lists (skip when none listed)
16. ``policy.compose_hash`` / ``policy.app_id`` from the event log in the policy's lists (skip when none); a pinned compose-hash
    must also be the one a non-zero MRCONFIGID binds (v1, v2, or v3 with its MrConfigV3 document)
16b. ``gpu.policy``       the measured gpu-policy-hash in the policy's ``expected_gpu_policy_hashes`` (skip when none)

An ``Attest`` answer (:func:`attest_verdict`, dstack's VersionedAttestation) adds two steps around these:
 0. ``attestation.parse``  the answer decodes (SCALE V0 or MessagePack V1, TDX); else the verdict is this one failure
17. ``attestation.stack``  the answer's report_data is the quote's, and its runtime events are the log's RTMR3 events
"""

from __future__ import annotations

from typing import Any

from attestation.compose.app_compose import check_mr_config_id
from attestation.tdx.attest import AttestationFormatError, VersionedAttestation, answer_attestation
from attestation.tdx.dcap import Collateral, DcapResult, collateral_chain_problems, dcap_verify, quote_chain_problems
from attestation.errors import QuoteParseError
from attestation.tdx.eventlog import Event, boot_info, name_problems, replay
from attestation.tdx.gpu_dstack import policy_step
from attestation.policy import Policy
from attestation.tdx.quote import Quote, TdReport
from attestation.tdx.roots import INTEL_SGX_ROOT_CA_DER
from attestation.verdict import Check, QuoteFindings, Status, Verdict, iso_utc

__all__ = ["Check", "QuoteFindings", "Status", "Verdict", "attest_verdict", "quote_verdict", "verify_quote"]


def quote_verdict(
    raw: bytes,
    *,
    policy: Policy,
    now: int,
    collateral: Collateral | None,
    events: tuple[Event, ...] | None = None,
    expected_report_data: bytes | None = None,
    mr_config: bytes | None = None,
) -> Verdict:
    """``cvm-tune verify-quote``: the quote-level steps as a :class:`Verdict`.

    Raises:
        QuoteParseError: the bytes are not a DCAP quote at all (an input error, not a rejection).
    """
    Quote.from_bytes(raw)
    f = verify_quote(raw, policy=policy, now=now, collateral=collateral, events=events,
                     expected_report_data=expected_report_data, mr_config=mr_config)
    return Verdict.of(f, policy, now)


def attest_verdict(
    answer: dict[str, Any] | str,
    *,
    source: str,
    policy: Policy,
    now: int,
    collateral: Collateral | None,
    events: tuple[Event, ...] | None = None,
    expected_report_data: bytes | None = None,
    mr_config: bytes | None = None,
) -> Verdict:
    """``cvm-tune verify-quote`` on a guest agent's ``Attest`` answer (``{"attestation": hex}``).

    An answer that does not decode is a rejection (``attestation.parse`` fails, saying why), not an input error:
    the file was read, and what it holds is not evidence. ``events`` (``--event-log``) replaces the answer's log;
    ``mr_config`` (``--mr-config``) the MrConfigV3 document of its ``vm_config``. A str ``answer`` is why the file
    did not parse as JSON (:func:`attestation.tdx.inputs.attest_answer`).
    """
    f = QuoteFindings()
    try:
        if isinstance(answer, str):
            raise AttestationFormatError(f"{source}: {answer}")
        att = answer_attestation(answer, source)
    except AttestationFormatError as exc:
        f.add("attestation.parse", "fail", exc.message)
        return Verdict.of(f, policy, now)
    f.add("attestation.parse", "pass", f"{'MessagePack V1' if att.encoding == 'msgpack-v1' else 'SCALE V0'} "
          f"VersionedAttestation, platform {att.platform}: a {len(att.quote)}-byte quote, {len(att.events)} events")
    use = events if events is not None else att.events
    verify_quote(att.quote, policy=policy, now=now, collateral=collateral, events=use,
                 expected_report_data=expected_report_data, findings=f,
                 mr_config=mr_config if mr_config is not None else att.mr_config)
    _stack_step(f, att)
    return Verdict.of(f, policy, now)


def _stack_step(f: QuoteFindings, att: VersionedAttestation) -> None:
    """(17) What the answer says beside the quote agrees with what the quote signs (nothing of it is used otherwise)."""
    problems = []
    td = f.quote.td if f.quote else None
    if td is None:
        problems.append("no TDX quote to compare the answer with")
    elif td.report_data != att.report_data:
        problems.append("stack report_data is not the quote's report_data")
    rtmr3 = [(e.event, e.payload) for e in att.events if e.imr == 3 and e.is_runtime]
    if list(att.runtime_events) != rtmr3:
        problems.append(f"stack runtime_events ({len(att.runtime_events)}) are not the event log's RTMR3 events "
                        f"({len(rtmr3)}) in order")
    f.add("attestation.stack", "fail" if problems else "pass", "; ".join(problems) or
          "report_data and runtime events agree with the quote and its event log")


def verify_quote(
    raw: bytes,
    *,
    policy: Policy,
    now: int,
    collateral: Collateral | None,
    events: tuple[Event, ...] | None = None,
    expected_report_data: bytes | None = None,
    findings: QuoteFindings | None = None,
    mr_config: bytes | None = None,
) -> QuoteFindings:
    """Run steps 1-16 and return the findings (checks appended in order)."""
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
    # (4) the quote's own PCK chain, byte-exact
    root_der = INTEL_SGX_ROOT_CA_DER if policy.trusted_root == "intel" else policy.trusted_root.der
    problems = quote_chain_problems(q.pck_chain or b"", root_der)
    f.add("quote.cert_chain", "fail" if problems else "pass", "; ".join(problems) or "canonical PEM chain to the trusted root")
    # (5)-(9) collateral window and chains, signature, TCB status, TCB evaluation number
    _signature_steps(f, q, policy, now, collateral)
    # (10) TD attributes
    problems = q.td.attribute_problems()
    f.add("quote.td_attributes", "fail" if problems else "pass", "; ".join(problems) or "not debug, SEPT_VE_DISABLE set")
    # (11) report_data
    if expected_report_data is None:
        f.add("report_data", "skip", "no expected report_data given")
    elif q.td.report_data == expected_report_data.ljust(64, b"\0"):
        f.add("report_data", "pass", "all 64 bytes equal the expected value")
    else:
        f.add("report_data", "fail", "report_data differs from the expected value (quote is for other content)")
    # (12)-(14) event log
    if events is None:
        for name in ("event_log.replay", "event_log.boot", "event_log.names"):
            f.add(name, "skip", "no event log given: RTMRs not replayed, boot events not read")
    else:
        _event_log_steps(f, q.td, events, policy)
    # (15) + (16) policy pins
    _policy_steps(f, q.td, policy, mr_config)
    return f


def _signature_steps(f: QuoteFindings, q: Quote, policy: Policy, now: int, coll: Collateral | None) -> None:
    if coll is None:
        f.add("collateral.window", "fail", "no collateral: cannot verify the quote signature "
              "(fetch it with `cvm-tune collateral QUOTE -o FILE` and pass --collateral FILE)")
        return
    f.collateral = coll
    if not coll.not_before <= now <= coll.not_after:
        f.add(
            "collateral.window",
            "fail",
            f"cannot verify: collateral valid {iso_utc(coll.not_before)}..{iso_utc(coll.not_after)}, now is {iso_utc(now)} "
            "(fetch fresh collateral, or pass --now inside the window for an as-of check)",
        )
        return
    f.add("collateral.window", "pass", f"valid {iso_utc(coll.not_before)}..{iso_utc(coll.not_after)}")
    root = None if policy.trusted_root == "intel" else policy.trusted_root.der
    problems = collateral_chain_problems(coll.text, root or INTEL_SGX_ROOT_CA_DER, q.pck_chain)
    f.add("collateral.chains", "fail" if problems else "pass",
          "; ".join(problems) or "canonical PEM chains to the trusted root; CRLs signed by their issuers")
    root_name = "Intel SGX root CA" if root is None else f"test root '{policy.trusted_root.name}'"
    chain_failed = problems or any(c.name == "quote.cert_chain" and c.status == "fail" for c in f.checks)
    if chain_failed:
        # dcap-qvl is only handed chains that reach the trusted root: certificate/CRL chains that do not can make
        # its certificate library abort the whole process (an assertion in its CRL path) instead of failing.
        f.add("quote.signature", "fail", f"not checked: the quote's or the collateral's chains do not reach the {root_name}")
        return
    res = dcap_verify(q.raw, coll, root_der=root, now=now)
    if not res.ok:
        f.add("quote.signature", "fail", f"dcap-qvl rejected it against the {root_name}: {res.error}")
        return
    f.add("quote.signature", "pass", f"chains to the {root_name}; TCB info, QE identity and CRLs verified")
    f.tcb_status, f.advisory_ids, f.tcb_date = res.status, res.advisory_ids, res.tcb_date
    f.tcb_evaluation_data_number = res.tcb_evaluation_data_number
    _tcb_steps(f, res, policy, now)


def _tcb_steps(f: QuoteFindings, res: DcapResult, policy: Policy, now: int) -> None:
    advisories = f"; advisories: {', '.join(res.advisory_ids)}" if res.advisory_ids else ""
    denied = sorted(set(res.advisory_ids) & set(policy.denied_advisories))
    grace = policy.outofdate_grace_period_s
    grace_end = (res.tcb_date or 0) + grace
    if denied:
        f.add("quote.tcb_status", "fail", f"TCB status {res.status}; denied advisories present: {', '.join(denied)}")
    elif res.status in policy.allowed_tcb_statuses:
        f.add("quote.tcb_status", "pass", f"{res.status}{advisories}")
    elif res.status == "OutOfDate" and grace and now <= grace_end:
        f.add("quote.tcb_status", "pass", f"WARNING: OutOfDate accepted inside the policy's grace period (TCB level "
              f"dated {iso_utc(res.tcb_date)}, grace ends {iso_utc(grace_end)}): update the platform{advisories}")
    else:
        expired = f"; grace period ended {iso_utc(grace_end)}" if res.status == "OutOfDate" and grace else ""
        f.add("quote.tcb_status", "fail",
              f"TCB status {res.status} not in {list(policy.allowed_tcb_statuses)}{expired}{advisories}")
    minimum, got = policy.min_tcb_evaluation_data_number, res.tcb_evaluation_data_number
    if minimum is None:
        f.add("collateral.tcb_evaluation", "skip", f"policy sets no minimum (collateral has {got})")
    elif got is None or got < minimum:
        f.add("collateral.tcb_evaluation", "fail", f"tcbEvaluationDataNumber {got} < policy minimum {minimum}: stale "
              "collateral may hide a TCB recovery (fetch fresh collateral)")
    else:
        f.add("collateral.tcb_evaluation", "pass", f"tcbEvaluationDataNumber {got} >= {minimum}")


def _event_log_steps(f: QuoteFindings, td: TdReport, events: tuple[Event, ...], policy: Policy) -> None:
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
    bad = name_problems(events, boot_names=policy.allowed_boot_events, app_names=policy.allowed_app_events)
    f.add("event_log.names", "fail" if bad else "pass", "; ".join(bad) or "every RTMR3 event name is allowed by the policy")


def _policy_steps(f: QuoteFindings, td: TdReport, policy: Policy, mr_config: bytes | None = None) -> None:
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
        detail = f"{event} {got or '(absent)'} {'is' if ok else 'is not'} allowed"
        if ok and f.boot and event == "compose-hash":  # and the VMM's MRCONFIGID, when set, binds the same compose
            ok, how = check_mr_config_id(td.mr_config_id, got, f.boot.hex("app-id"), f.boot.values.get("key-provider"),
                                         boot=f.boot, mr_config=mr_config)
            detail += f"; {how}"
        f.add(name, "pass" if ok else "fail", detail)
    # (16b) the GPU policy dstack 0.6 measured (gpu-policy-hash) is one the policy allows
    f.add("gpu.policy", *policy_step(f.boot.hex("gpu-policy-hash") if f.boot else None, policy.expected_gpu_policy_hashes))
