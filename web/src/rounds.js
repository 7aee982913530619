// A federated round bundle (verifier-spec §13, §15 "Rounds with secure aggregation"; attestation/rounds/verify.py):
// the aggregator's quote binding round-manifest.json, the round's files, every admitted client's export bundle
// verified as a bundle of its own, the clients' terms and weights, secure aggregation, and the aggregate.
import { Findings, composeAndAppId, quoteBytes, readCollateral, readEvents, verifyBundle } from "./bundle.js";
import { WEIGHTS, namingProblems, storedName, x25519Stanzas } from "./confidential.js";
import { parseQuote } from "./quote.js";
import { verifyQuote } from "./quotechecks.js";
import { aggregateCheck, clientManifest } from "./aggregate.js";
import { parseChecked, roundManifestProblem } from "./schema.js";
import { concat, enc, hex, sha256, sha256hex, sha512 } from "./util.js";

const TOP = ["round-manifest.json", "quote.bin", "quote.hex", "event_log.json", "app-compose.json"];
const TOP_DIRS = ["adapter", "clients"];
const OPTIONAL = ["collateral.json", "mr-config.json"];  // platform files: collateral, the MrConfigV3 document (v3)
const WEIGHT_TOLERANCE = 1e-9;
const globalAdapter = (secure) => storedName(WEIGHTS, secure);

function schema(f, raw) {
  try {
    const m = parseChecked(raw, roundManifestProblem);
    const names = m.admitted.map((a) => a.client);
    if (new Set(names).size !== names.length) throw new Error("a client is admitted twice");
    const naming = namingProblems(Object.keys(m.files), m.confidentiality != null);
    if (naming.length) throw new Error(naming.join("; "));
    f.add("round.schema", "pass", `cvm-tune/round-manifest/v1, round ${m.round}, ${m.admitted.length} admitted, ${m.rejected.length} rejected`);
    return m;
  } catch (e) {
    f.add("round.schema", "fail", `round-manifest.json is not a valid cvm-tune/round-manifest/v1 manifest: ${e.message}`);
    return null;
  }
}

/** round.files: exactly the expected files and directories; inside clients/<name>/ the client bundle's own check. */
function files(f, b, m) {
  const present = [...b.files.keys()].filter((p) => !p.startsWith("clients/"));
  const dirs = [...b.dirs].filter((d) => !d.startsWith("clients/"));
  // which global adapter file: the manifest says (when it does not parse: the one present)
  const found = present.filter((p) => p === globalAdapter(false) || p === globalAdapter(true));
  const top = new Set([...TOP, ...(m ? [globalAdapter(m.confidentiality != null)] : found.length ? found : [globalAdapter(false)])]);
  const problems = [...[...top].filter((p) => !b.files.has(p)).sort().map((p) => `missing ${p}`),
    ...present.filter((p) => !top.has(p) && !OPTIONAL.includes(p)).sort().map((p) => `unexpected file ${p}`),
    ...dirs.filter((d) => !TOP_DIRS.includes(d)).sort().map((d) => `unexpected directory ${d}/`)];
  if (m) {
    const want = new Set(m.admitted.map((a) => a.client));
    const have = new Set([...b.files.keys(), ...b.dirs].filter((p) => p.startsWith("clients/")).map((p) => p.split("/")[1]));
    problems.push(...[...want].filter((c) => !have.has(c)).sort().map((c) => `missing clients/${c}/`),
      ...[...have].filter((c) => !want.has(c)).sort().map((c) => `unexpected clients/${c}`));
  }
  f.add("round.files", problems.length ? "fail" : "pass", problems.slice(0, 5).join("; ") || "expected files only");
}

function fileHashes(f, b, m) {
  const secure = m.confidentiality != null;
  const bad = Object.keys(m.files).sort().filter((rel) => !b.files.has(rel) || sha256hex(b.files.get(rel)) !== m.files[rel])
    .map((rel) => (b.files.has(rel) ? `${rel} changed` : `${rel} unreadable`));
  const listed = Object.keys(m.files);
  if (listed.length !== 2 || !listed.includes("app-compose.json") || !listed.includes(globalAdapter(secure))) bad.push("the manifest's files are not app-compose.json and the global adapter");
  if (secure) {
    const conf = m.confidentiality, data = b.files.get(globalAdapter(true));
    if (m.global_adapter_sha256 !== conf.plaintext_sha256) bad.push("global_adapter_sha256 is not the global adapter's plaintext hash");
    if (!data) bad.push(`${globalAdapter(true)} missing or unreadable`);
    else {
      const n = x25519Stanzas(data);
      if (n !== conf.recipients.length) bad.push(`the global adapter is not age ciphertext with one stanza per listed recipient (${n === null ? "None" : n})`);
    }
    if (m.aggregator_recipient == null || !conf.recipients.includes(m.aggregator_recipient)) bad.push("the aggregator's recipient is not among the global adapter's recipients");
  } else if (m.files[globalAdapter(false)] !== m.global_adapter_sha256) bad.push("global_adapter_sha256 is not the global adapter file's hash");
  f.add("round.file_hashes", bad.length ? "fail" : "pass", bad.join("; ") || `${listed.length} file hashes match`);
}

/** The files and folders under clients/<name>/, relative to it: a bundle of its own. */
function subBundle(b, name) {
  const prefix = `clients/${name}/`, strip = (p) => p.slice(prefix.length);
  return { files: new Map([...b.files].filter(([p]) => p.startsWith(prefix)).map(([p, v]) => [strip(p), v])),
    dirs: new Set([...b.dirs].filter((d) => d.startsWith(prefix)).map(strip)), odd: [] };
}

async function clients(f, b, m, policy, now) {
  const out = {};
  for (const a of m.admitted) {
    const name = `client.${a.client}`;
    if (!b.dirs.has(`clients/${a.client}`)) { f.add(name, "fail", "bundle missing"); continue; }
    const c = subBundle(b, a.client);
    if (!c.files.has("manifest.json")) { f.add(name, "fail", `clients/${a.client} has no manifest.json: not a cvm-tune export bundle`); continue; }
    const verdict = await verifyBundle(c, { policy, now });
    const problems = verdict.checks.filter((x) => x.status === "fail").map((x) => `${x.name}: ${x.reason}`);
    const raw = c.files.get("manifest.json"), cm = clientManifest(raw);
    const digests = [["manifest.json", () => sha256hex(raw), a.manifest_sha256],
      ["quote.bin", () => { const q = c.files.get("quote.bin"); return hex(sha256(q.subarray(0, parseQuote(q).signedEnd))); }, a.quote_sha256],
      ["adapter", () => sha256hex(c.files.get(storedName(WEIGHTS, cm.confidentiality != null))), a.adapter_sha256]];
    for (const [what, digest, want] of digests) {
      try { if (digest() !== want) problems.push(`${what} does not hash to the round manifest's value`); } catch { problems.push(`${what} unreadable`); }
    }
    if (!problems.length) out[a.client] = cm;
    f.add(name, problems.length ? "fail" : "pass", problems.slice(0, 3).join("; ") || `bundle ${a.run_id} accepted (${verdict.checks.length} checks); hashes match the round manifest`);
  }
  return out;
}

const py = (v) => (v === null || v === undefined ? "None" : String(v));

function termsAndWeights(f, m, passed) {
  const terms = [], weights = [];
  const mu = (m.strategy.params || {}).proximal_mu ?? 0;
  const total = m.admitted.reduce((s, a) => s + a.trainable_tokens, 0);
  for (const a of m.admitted) {
    const cm = passed[a.client];
    if (!cm) continue; // its client.* check already failed
    const fed = cm.federation;
    if (!fed || fed.round !== m.round || fed.nonce !== m.nonce || (fed.global_adapter_sha256 ?? null) !== (m.global_adapter_in_sha256 ?? null) || (fed.proximal_mu ?? 0) !== mu) {
      terms.push(`${a.client} was not trained for this round (round, nonce, global adapter or mu differ)`);
    }
    const dp = cm.privacy ? [cm.privacy.epsilon, cm.privacy.delta] : [null, null];
    if (dp[0] !== (a.privacy_epsilon ?? null) || dp[1] !== (a.privacy_delta ?? null)) {
      weights.push(`${a.client}: privacy (epsilon, delta) listed (${py(a.privacy_epsilon)}, ${py(a.privacy_delta)}), its manifest says (${py(dp[0])}, ${py(dp[1])})`);
    }
    const tokens = (cm.dataset.validation || {}).trainable_tokens;
    if (tokens !== a.trainable_tokens) weights.push(`${a.client}: ${a.trainable_tokens} trainable tokens listed, its manifest says ${py(tokens)}`);
    if (Math.abs(a.weight - a.trainable_tokens / total) > WEIGHT_TOLERANCE) weights.push(`${a.client}: weight ${a.weight} != ${a.trainable_tokens}/${total}`);
  }
  f.add("round.terms", terms.length ? "fail" : "pass", terms.slice(0, 3).join("; ") || `every client trained for round ${m.round} (nonce ${m.nonce.slice(0, 16)}…) from the same global adapter`);
  f.add("round.weights", weights.length ? "fail" : "pass", weights.slice(0, 3).join("; ") || `weights = trainable tokens / ${total}`);
}

/** round.confidential (secure aggregation only). */
function confidential(f, m, passed) {
  const problems = [], cvmKeys = new Set();
  for (const a of m.admitted) {
    const cm = passed[a.client];
    if (!cm) continue;
    const conf = cm.confidentiality;
    if (!conf || !conf.recipients.includes(m.aggregator_recipient)) problems.push(`${a.client}'s update is not encrypted to the aggregator's key`);
    else cvmKeys.add(conf.cvm_recipient);
  }
  const want = [...new Set([...cvmKeys, m.aggregator_recipient ?? ""])].sort();
  const have = m.confidentiality.recipients;
  if (!problems.length && (want.length !== have.length || want.some((r, i) => r !== have[i]))) {
    problems.push("the global adapter's recipients are not the admitted clients' CVM keys and the aggregator's");
  }
  f.add("round.confidential", problems.length ? "fail" : "pass", problems.slice(0, 3).join("; ") ||
    `${m.admitted.length} client update(s) encrypted to the aggregator; the global adapter to ${have.length} CVM key(s): no plaintext update in the bundle`);
}

/** Verify a round bundle under `policy` at `now`; the client bundles in it under the same policy. */
export async function verifyRound(b, { policy, now }) {
  const f = new Findings();
  if (b.odd.length) {
    f.add("round.files", "fail", [...b.odd].sort().slice(0, 5).map((p) => `${p} is not a plain file or directory`).join("; ") + " (not opened: no other check ran)");
    return f;
  }
  const rawManifest = b.files.get("round-manifest.json");
  const m = schema(f, rawManifest);
  const raw = quoteBytes(f, b);
  const events = readEvents(f, b);
  if (raw) {
    const coll = readCollateral(f, b);
    verifyQuote(f, raw, { policy, now, coll, events, expectedReportData: sha512(concat(enc.encode("cvm-tune-round-v1:"), rawManifest)),
      mrConfig: b.files.get("mr-config.json") ?? null });
  }
  if (m) composeAndAppId(f, b, m);
  files(f, b, m);
  if (!m) return f;
  f.bundle = { run_id: `${m.federation_id}/round-${m.round}`, created_at: m.created_at };
  fileHashes(f, b, m);
  const passed = await clients(f, b, m, policy, now);
  termsAndWeights(f, m, passed);
  if (m.confidentiality) confidential(f, m, passed);
  aggregateCheck(f, b, m);
  return f;
}
