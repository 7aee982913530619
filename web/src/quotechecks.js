// The quote-level steps, in cvm-tune's order (attestation/verify.py; docs/verifier.md "Checks, in order").
import { collateralChainProblems, dcapVerify, quoteChainProblems } from "./dcap.js";
import { bootInfo, nameProblems, replay } from "./eventlog.js";
import { QuoteParseError, attributeProblems, parseQuote } from "./quote.js";
import { checkMrConfigId } from "./compose.js";
import { gpuPolicyStep } from "./gpu.js";
import { equal, hex, isoUtc } from "./util.js";

export function verifyQuote(f, raw, { policy, now, coll, events, expectedReportData, mrConfig = null }) {
  let q;
  try { q = parseQuote(raw); } catch (e) {
    if (!(e instanceof QuoteParseError)) throw e;
    f.add("quote.parse", "fail", e.message);
    return;
  }
  f.quote = q;
  f.add("quote.parse", "pass", `DCAP v${q.version} ${q.teeName} quote, ${raw.length} bytes`);
  if (!q.td) { f.add("quote.tee_type", "fail", `${q.teeName} quote: cvm-tune attests Intel TDX CVMs only`); return; }
  f.add("quote.tee_type", "pass", "TDX");
  const trailing = q.trailing.length;
  if (q.trailing.some((x) => x)) f.add("quote.padding", "fail", `${trailing} bytes after the signed region are not all zero`);
  else f.add("quote.padding", "pass", `${trailing} zero padding bytes after the signed region`);
  let problems = quoteChainProblems(q.pckChain, policy.rootDer);
  f.add("quote.cert_chain", problems.length ? "fail" : "pass", problems.join("; ") || "canonical PEM chain to the trusted root");
  signatureSteps(f, q, policy, now, coll);
  problems = attributeProblems(q.td);
  f.add("quote.td_attributes", problems.length ? "fail" : "pass", problems.join("; ") || "not debug, SEPT_VE_DISABLE set");
  if (equal(q.td.report_data, expectedReportData)) f.add("report_data", "pass", "all 64 bytes equal the expected value");
  else f.add("report_data", "fail", "report_data differs from the expected value (quote is for other content)");
  if (events === null) {
    for (const n of ["event_log.replay", "event_log.boot", "event_log.names"]) f.add(n, "skip", "no event log given: RTMRs not replayed, boot events not read");
  } else eventLogSteps(f, q.td, events, policy);
  policySteps(f, q.td, policy, mrConfig);
}

function signatureSteps(f, q, policy, now, coll) {
  if (!coll) {
    f.add("collateral.window", "fail", "no collateral: cannot verify the quote signature (fetch it with `cvm-tune collateral QUOTE -o FILE` and pass --collateral FILE)");
    return;
  }
  f.collateral = coll;
  if (!(coll.notBefore <= now && now <= coll.notAfter)) {
    f.add("collateral.window", "fail", `cannot verify: collateral valid ${isoUtc(coll.notBefore)}..${isoUtc(coll.notAfter)}, now is ${isoUtc(now)} (fetch fresh collateral, or pass --now inside the window for an as-of check)`);
    return;
  }
  f.add("collateral.window", "pass", `valid ${isoUtc(coll.notBefore)}..${isoUtc(coll.notAfter)}`);
  const problems = collateralChainProblems(coll, policy.rootDer, q.pckChain);
  f.add("collateral.chains", problems.length ? "fail" : "pass", problems.join("; ") || "canonical PEM chains to the trusted root; CRLs signed by their issuers");
  const rootName = policy.trusted_root === "intel" ? "Intel SGX root CA" : `test root '${policy.trusted_root.name}'`;
  if (problems.length || f.checks.some((c) => c.name === "quote.cert_chain" && c.status === "fail")) {
    f.add("quote.signature", "fail", `not checked: the quote's or the collateral's chains do not reach the ${rootName}`);
    return;
  }
  const res = dcapVerify(q.raw, coll, policy.rootDer, now);
  if (!res.ok) { f.add("quote.signature", "fail", `dcap-qvl rejected it against the ${rootName}: ${res.error}`); return; }
  f.add("quote.signature", "pass", `chains to the ${rootName}; TCB info, QE identity and CRLs verified`);
  Object.assign(f, { tcbStatus: res.status, advisoryIds: res.advisoryIds, tcbDate: res.tcbDate, tcbNumber: res.tcbNumber });
  tcbSteps(f, res, policy, now);
}

function tcbSteps(f, res, policy, now) {
  const adv = res.advisoryIds.length ? `; advisories: ${res.advisoryIds.join(", ")}` : "";
  const denied = [...new Set(res.advisoryIds.filter((a) => policy.denied_advisories.includes(a)))].sort();
  const grace = policy.outofdate_grace_period_s;
  const graceEnd = (res.tcbDate || 0) + grace;
  if (denied.length) f.add("quote.tcb_status", "fail", `TCB status ${res.status}; denied advisories present: ${denied.join(", ")}`);
  else if (policy.allowed_tcb_statuses.includes(res.status)) f.add("quote.tcb_status", "pass", `${res.status}${adv}`);
  else if (res.status === "OutOfDate" && grace && now <= graceEnd) {
    f.add("quote.tcb_status", "pass", `WARNING: OutOfDate accepted inside the policy's grace period (TCB level dated ${isoUtc(res.tcbDate)}, grace ends ${isoUtc(graceEnd)}): update the platform${adv}`);
  } else {
    const expired = res.status === "OutOfDate" && grace ? `; grace period ended ${isoUtc(graceEnd)}` : "";
    f.add("quote.tcb_status", "fail", `TCB status ${res.status} not in [${policy.allowed_tcb_statuses.map((s) => `'${s}'`).join(", ")}]${expired}${adv}`);
  }
  const min = policy.min_tcb_evaluation_data_number, got = res.tcbNumber;
  if (min === null) f.add("collateral.tcb_evaluation", "skip", `policy sets no minimum (collateral has ${got ?? "None"})`);
  else if (got === null || got < min) f.add("collateral.tcb_evaluation", "fail", `tcbEvaluationDataNumber ${got ?? "None"} < policy minimum ${min}: stale collateral may hide a TCB recovery (fetch fresh collateral)`);
  else f.add("collateral.tcb_evaluation", "pass", `tcbEvaluationDataNumber ${got} >= ${min}`);
}

function eventLogSteps(f, td, events, policy) {
  const rep = replay(events);
  f.replayed = rep.rtmrs;
  const quoted = [td.rt_mr0, td.rt_mr1, td.rt_mr2, td.rt_mr3];
  const bad = [0, 1, 2, 3].filter((i) => !equal(rep.rtmrs[i], quoted[i])).map((i) => `RTMR${i} replay differs from the quote`);
  if (rep.problems.length || bad.length) f.add("event_log.replay", "fail", [...rep.problems, ...bad].join("; "));
  else f.add("event_log.replay", "pass", `RTMR0-3 replayed from ${events.length} events (RTMR3 digests recomputed)`);
  f.boot = bootInfo(events);
  f.add("event_log.boot", f.boot.problems.length ? "fail" : "pass", f.boot.problems.join("; ") || "boot events well-formed");
  const names = nameProblems(events, policy.allowed_boot_events, policy.allowed_app_events);
  f.add("event_log.names", names.length ? "fail" : "pass", names.join("; ") || "every RTMR3 event name is allowed by the policy");
}

function policySteps(f, td, policy, mrConfig) {
  const pins = [["MRTD", policy.expected_mrtd, td.mr_td], ["RTMR0", policy.expected_rtmr0, td.rt_mr0],
    ["RTMR1", policy.expected_rtmr1, td.rt_mr1], ["RTMR2", policy.expected_rtmr2, td.rt_mr2]].filter((p) => p[1].length);
  if (!pins.length) f.add("policy.measurements", "skip", "policy pins no OS-image measurements");
  else {
    const wrong = pins.filter(([, allowed, got]) => !allowed.includes(hex(got))).map((p) => p[0]);
    f.add("policy.measurements", wrong.length ? "fail" : "pass", wrong.length ? `not allowed: ${wrong.join(", ")}` : `${pins.map((p) => p[0]).join(", ")} allowed`);
  }
  for (const [name, allowed, event] of [["policy.compose_hash", policy.compose_hashes, "compose-hash"], ["policy.app_id", policy.app_ids, "app-id"]]) {
    if (!allowed.length) { f.add(name, "skip", `policy lists no ${event} values`); continue; }
    const got = f.boot ? f.boot.hex(event) : null;
    let ok = got !== null && allowed.includes(got);
    let detail = `${event} ${got || "(absent)"} ${ok ? "is" : "is not"} allowed`;
    if (ok && f.boot && event === "compose-hash") {
      const [bound, how] = checkMrConfigId(td.mr_config_id, got, f.boot.hex("app-id"), f.boot.values.get("key-provider"), f.boot, mrConfig);
      ok = bound;
      detail += `; ${how}`;
    }
    f.add(name, ok ? "pass" : "fail", detail);
  }
  f.add("gpu.policy", ...gpuPolicyStep(f.boot ? f.boot.hex("gpu-policy-hash") : null, policy.expected_gpu_policy_hashes || []));
}
