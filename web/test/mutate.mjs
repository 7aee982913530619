// The page's verifier (the modules it bundles, run by node) on single-bit changes of a bundle or a round bundle, for
// tests/test_web_verify.py and tests/test_web_rounds.py. stdin: {"bundle": DIR, "policy": YAML, "now": N, "flips": [[FILE, OFFSET, BIT], ...]};
// stdout: a JSON list, per flip, of [[check name, status], ...] (or the exception's text).
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { verifyBundle } from "../src/bundle.js";
import { verifyRound } from "../src/rounds.js";
import { loadPolicy } from "../src/policy.js";

const input = JSON.parse(readFileSync(0, "utf8"));
const files = new Map(), dirs = new Set();
(function walk(d) {
  for (const e of readdirSync(d)) {
    const p = join(d, e);
    if (statSync(p).isDirectory()) { dirs.add(relative(input.bundle, p)); walk(p); }
    else files.set(relative(input.bundle, p), new Uint8Array(readFileSync(p)));
  }
})(input.bundle);
const policy = loadPolicy(input.policy);
const out = [];
for (const [file, at, bit] of input.flips) {
  const bytes = files.get(file).slice();
  bytes[at] ^= bit;
  try {
    const verify = files.has("round-manifest.json") ? verifyRound : verifyBundle;
    const f = await verify({ files: new Map([...files, [file, bytes]]), dirs, odd: [] }, { policy, now: input.now });
    out.push(f.checks.map((c) => [c.name, c.status]));
  } catch (e) {
    out.push(String(e.stack));
  }
}
process.stdout.write(JSON.stringify(out));
