// The page's own functions on inputs from tests/test_web_units.py (stdin: a JSON list of [function, args]);
// stdout: a JSON list of their results. The same modules the page bundles, run by node.
import { readFileSync } from "node:fs";
import { opChainCheck } from "../src/opchain.js";
import { rdpEpsilon } from "../src/rdp.js";
import { Findings } from "../src/bundle.js";
import { checkMrConfigId } from "../src/compose.js";
import { manifestMembers } from "../src/schema.js";
import { bootGpuAttestation, gpuCheck, summarize } from "../src/gpu.js";
import { canonical, parseJsonExact, pyFloat, unhex } from "../src/util.js";

const enc = new TextEncoder();
const FUNCTIONS = {
  pyFloat: (x) => pyFloat(x),
  canonical: (text, asciiOnly) => canonical(parseJsonExact(text).value, asciiOnly),
  rdpEpsilon: (history, delta) => rdpEpsilon(history, delta),
  mrConfigId: (v) => checkMrConfigId(unhex(v.mr_config_id), v.compose_hash, v.app_id,
    v.key_provider === null ? null : enc.encode(JSON.stringify(v.key_provider)))[0],
  manifestMembers: () => manifestMembers(),
  bootGpu: (events) => bootGpuAttestation(events.map(([event, payload]) => ({ imr: 3, type: 0x08000001, event, payload: enc.encode(payload) }))),
  gpu: (text) => {  // gpu-evidence.json's summary, and gpu.evidence for a manifest and audit entry that agree with it
    const data = enc.encode(text);
    let info;
    try { info = summarize(data); } catch (e) { return { error: e.message }; }
    const entry = { type: "gpu.evidence", data: { evidence_sha256: info.evidence_sha256 }, prev: info.nonce };
    return { summary: info, check: gpuCheck(data, info, [entry]) };
  },
  opChain: (manifestOpChain, opsText) => {
    const f = new Findings();
    opChainCheck(f, { op_chain: manifestOpChain }, enc.encode(opsText));
    return f.checks[0];
  },
};
const calls = JSON.parse(readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(calls.map(([name, args]) => FUNCTIONS[name](...args))));
