// The page's own functions on inputs from tests/test_web_units.py (stdin: a JSON list of [function, args]);
// stdout: a JSON list of their results. The same modules the page bundles, run by node.
import { readFileSync } from "node:fs";
import { opChainCheck } from "../src/opchain.js";
import { rdpEpsilon } from "../src/rdp.js";
import { Findings } from "../src/bundle.js";
import { checkMrConfigId } from "../src/compose.js";
import { manifestMembers } from "../src/schema.js";
import { canonical, parseJsonExact, pyFloat, unhex } from "../src/util.js";

const enc = new TextEncoder();
const FUNCTIONS = {
  pyFloat: (x) => pyFloat(x),
  canonical: (text, asciiOnly) => canonical(parseJsonExact(text).value, asciiOnly),
  rdpEpsilon: (history, delta) => rdpEpsilon(history, delta),
  mrConfigId: (v) => checkMrConfigId(unhex(v.mr_config_id), v.compose_hash, v.app_id,
    v.key_provider === null ? null : enc.encode(JSON.stringify(v.key_provider)))[0],
  manifestMembers: () => manifestMembers(),
  opChain: (manifestOpChain, opsText) => {
    const f = new Findings();
    opChainCheck(f, { op_chain: manifestOpChain }, enc.encode(opsText));
    return f.checks[0];
  },
};
const calls = JSON.parse(readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(calls.map(([name, args]) => FUNCTIONS[name](...args))));
