// The page's own functions on inputs from tests/test_web_units.py (stdin: a JSON list of [function, args]);
// stdout: a JSON list of their results. The same modules the page bundles, run by node.
import { readFileSync } from "node:fs";
import { opChainCheck } from "../src/opchain.js";
import { rdpEpsilon } from "../src/rdp.js";
import { historyProblems, recomputeEpsilon } from "../src/epsilon.js";
import { weightedSum } from "../src/aggregate.js";
import { DtypeLookupError, loadSafetensors } from "../src/safetensors.js";
import { Findings } from "../src/bundle.js";
import { anchorProblems, parseAnchorLines, reportData } from "../src/anchors.js";
import { auditEntries } from "../src/audit.js";
import { checkMrConfigId, dstack06Audit } from "../src/compose.js";
import { bootInfo, parseEventLog, replay } from "../src/eventlog.js";
import { bootEvidenceStep, gpuPolicyStep, gpuStatus } from "../src/gpu.js";
import { manifestMembers, manifestProblem, roundManifestProblem } from "../src/schema.js";
import { bootGpuAttestation, gpuCheck, summarize } from "../src/gpu.js";
import { canonical, parseJsonExact, plain, pyFloat, unhex } from "../src/util.js";

const enc = new TextEncoder();
const FUNCTIONS = {
  pyFloat: (x) => pyFloat(x),
  canonical: (text, asciiOnly) => canonical(parseJsonExact(text).value, asciiOnly),
  rdpEpsilon: (history, delta) => rdpEpsilon(history, delta),
  mrConfigId: (v) => checkMrConfigId(unhex(v.mr_config_id), v.compose_hash, v.app_id,
    v.key_provider === null ? null : enc.encode(JSON.stringify(v.key_provider)))[0],
  // [ok, why] for MRCONFIGID with an event log's boot events and a MrConfigV3 document (hex; null: none)
  mrConfigV3: (configId, composeHash, logText, docHex) => {
    const boot = bootInfo(parseEventLog(enc.encode(logText)));
    return checkMrConfigId(unhex(configId), composeHash, boot.hex("app-id"), boot.values.get("key-provider") ?? null, boot,
      docHex === null ? null : unhex(docHex));
  },
  dstack06Audit: (text) => dstack06Audit(parseJsonExact(text).value),
  // what the page reads from an event log: replay problems and boot problems (or the parse error)
  eventLog: (text) => {
    let events;
    try { events = parseEventLog(enc.encode(text)); } catch (e) { return { error: e.message }; }
    return { replay: replay(events).problems, boot: bootInfo(events).problems };
  },
  gpu06: (logText, evidenceHex, allowed, recorded) => {
    const events = parseEventLog(enc.encode(logText));
    const boot = bootInfo(events);
    const checks = [{ name: "gpu.policy", status: gpuPolicyStep(boot.hex("gpu-policy-hash"), allowed)[0] }];
    const step = bootEvidenceStep(events, evidenceHex === null ? null : unhex(evidenceHex));
    checks.push({ name: "gpu.boot_evidence", status: step[0] });
    return { policy: gpuPolicyStep(boot.hex("gpu-policy-hash"), allowed), evidence: step, status: gpuStatus(events, recorded, checks) };
  },
  manifestMembers: () => manifestMembers(),
  manifestProblem: (text) => manifestProblem(parseJsonExact(text).value),
  roundManifestProblem: (text) => roundManifestProblem(parseJsonExact(text).value),
  roundManifestMembers: () => manifestMembers("round"),
  epsilon: (accountant, history, delta) => {
    try { return recomputeEpsilon(accountant, history, delta); } catch (e) { return { error: e.message }; }
  },
  historyProblems: (accountant, history, delta) => historyProblems(accountant, history, delta),
  safetensors: (b64) => {  // what loads, or how it fails: "parse" (SafetensorError) or "lookup" (a dtype numpy lacks)
    try {
      const t = loadSafetensors(new Uint8Array(Buffer.from(b64, "base64")));
      return Object.fromEntries(Object.entries(t).map(([k, v]) => [k, { dtype: v.dtype, shape: v.shape, values: [...v.values] }]));
    } catch (e) { return e instanceof DtypeLookupError ? "lookup" : "parse"; }
  },
  weightedSum: (weights, clients) => {  // Σ weight · tensors, as round.aggregate computes it (clients: base64 files)
    const loaded = clients.map((b64) => loadSafetensors(new Uint8Array(Buffer.from(b64, "base64"))));
    const total = weightedSum({ admitted: weights.map((weight) => ({ weight })) }, loaded);
    return Object.fromEntries(Object.entries(total).map(([k, v]) => [k, [...v.values]]));
  },
  bootGpu: (events) => bootGpuAttestation(events.map(([event, payload]) => ({ imr: 3, type: 0x08000001, event, payload: enc.encode(payload) }))),
  gpu: (text) => {  // gpu-evidence.json's summary, and gpu.evidence for a manifest and audit entry that agree with it
    const data = enc.encode(text);
    let info;
    try { info = summarize(data); } catch (e) { return { error: e.message }; }
    const entry = { type: "gpu.evidence", data: { evidence_sha256: info.evidence_sha256 }, prev: info.nonce };
    return { summary: info, check: gpuCheck(data, info, [entry]) };
  },
  // the same from the manifest's text (numbers as written, as the page reads a bundle's manifest.json)
  opChainExact: (manifestText, opsText) => {
    const f = new Findings();
    const exact = parseJsonExact(manifestText).value;
    const m = plain(exact);
    Object.defineProperty(m, "exact", { value: exact });
    opChainCheck(f, m, enc.encode(opsText));
    return f.checks[0];
  },
  // audit-anchors.jsonl (base64) as anchors.js reads it: [[seq, head, quote hex, event log]] or {error}
  anchorLines: (b64) => {
    try {
      return parseAnchorLines(new Uint8Array(Buffer.from(b64, "base64"))).map((a) => [String(a.seq), a.head, Buffer.from(a.quote).toString("hex"), a.eventLog]);
    } catch (e) { return { error: e.message }; }
  },
  // anchorProblems on anchor lines and audit lines (base64), each quote's check result looked up by its hex in
  // `results` ([failed names, TD fields, boot payloads]); returns the problems and the (quote, report_data) asked
  anchorProblems: (anchorsB64, auditB64, results, mainFailed, mainTd, mainBoot) => {
    const asked = [];
    const check = (quote, log, expected) => {
      const q = Buffer.from(quote).toString("hex");
      asked.push([q, Buffer.from(expected).toString("hex")]);
      const [failed, td, boot] = results[q];
      return [new Set(failed), td, boot];
    };
    const anchors = parseAnchorLines(new Uint8Array(Buffer.from(anchorsB64, "base64")));
    const entries = auditEntries(new Uint8Array(Buffer.from(auditB64, "base64")));
    return { problems: anchorProblems(anchors, entries, check, { mainFailed: new Set(mainFailed), mainTd, mainBoot }), asked };
  },
  anchorReportData: (seq, head) => Buffer.from(reportData(BigInt(seq), head)).toString("hex"),
  opChain: (manifestOpChain, opsText) => {
    const f = new Findings();
    opChainCheck(f, { op_chain: manifestOpChain }, enc.encode(opsText));
    return f.checks[0];
  },
};
const calls = JSON.parse(readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(calls.map(([name, args]) => FUNCTIONS[name](...args))));
