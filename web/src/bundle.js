// An export bundle: the bundle-level steps around the quote steps, in cvm-tune's order (attestation/bundle/verify.py).
// `b` is { files: Map(path -> bytes), dirs: Set(path), odd: [path] }: what a folder or an archive holds.
import { parseCollateral, CollateralError } from "./dcap.js";
import { EventLogError, parseEventLog } from "./eventlog.js";
import { MAX_QUOTE_BYTES } from "./quote.js";
import { verifyQuote } from "./quotechecks.js";
import { checkMrConfigId, dstack06Audit, gpuPolicyHash, serviceImage } from "./compose.js";
import { auditEntries, auditSteps } from "./audit.js";
import { ANCHORS_FILE, anchorsStep } from "./anchors.js";
import { bootEvidenceStep, gpuStatus, gpuStep } from "./gpu.js";
import { manifestProblem } from "./schema.js";
import { modelSignature } from "./signature.js";
import { WEIGHTS, confidentialOutputs, namingProblems, storedName } from "./confidential.js";
import { privacyStep } from "./privacy.js";
import { opChainCheck } from "./opchain.js";
import { enc, filesDigestOf, hex, plain, parseJsonExact, sha256hex, sha512, concat, utf8 } from "./util.js";
export const ADAPTER_FILES = ["adapter/adapter_config.json", WEIGHTS];
const HASHED = [...ADAPTER_FILES, "config.json", "app-compose.json", "README.md", "audit.jsonl"];
export const ARTIFACT_FILES = HASHED.filter((f) => f !== "audit.jsonl");
const ATTESTATION = ["manifest.json", "quote.bin", "quote.hex", "event_log.json"];
const OPTIONAL = ["collateral.json", "mr-config.json", "gpu-boot-evidence.json"];  // platform files, checked by what they reproduce
const REPORT = ["report/report.json", "report/loss.png"];
const LISTED = /^(?:adapter|merged)\/[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$/;

/** The findings of one verification: checks in order plus what the JSON verdict reports. */
export class Findings {
  constructor() { this.checks = []; this.boot = null; this.quote = null; }
  add(name, status, reason) { this.checks.push({ name, status, reason }); }
}


function hashedFiles(m) {
  if (!m) return HASHED;
  const base = HASHED.map((f) => storedName(f, m.confidentiality != null));
  const gpu = m.gpu != null ? ["gpu-evidence.json"] : [];
  if (m.audit.anchors != null) gpu.push(ANCHORS_FILE);  // verifier-spec §4a: listed when the manifest counts anchors
  const report = REPORT.some((f) => f in m.files) ? REPORT : [];
  const signed = m.signing ? m.signing.signed.map((d) => `${d}/model.sig`) : [];
  const listed = Object.keys(m.files).filter((f) => LISTED.test(f) && !base.includes(f) && !signed.includes(f)).sort();
  return [...base, ...gpu, ...report, ...signed, ...listed];
}

function manifestStep(f, b, manifestBytes) {
  let m = null;
  try {
    const text = utf8(manifestBytes);
    if (text === null) throw new Error("not UTF-8");
    const parsed = parseJsonExact(text);
    const why = manifestProblem(parsed.value);
    if (why) throw new Error(why);
    m = plain(parsed.value);
    Object.defineProperty(m, "exact", { value: parsed.value }); // numbers as written (opchain.js hashes from it)
    const naming = namingProblems(Object.keys(m.files), m.confidentiality != null);
    if (naming.length) throw new Error(naming.slice(0, 3).join("; "));
    const want = new Set(hashedFiles(m));
    const have = Object.keys(m.files);
    if (have.length !== want.size || have.some((k) => !want.has(k))) {
      throw new Error(`manifest lists ${JSON.stringify(have.sort())}, expected ${JSON.stringify([...want].sort())}`);
    }
    f.add("manifest.schema", "pass", "cvm-tune/manifest/v1");
  } catch (e) {
    f.add("manifest.schema", "fail", `manifest.json is not a valid cvm-tune/manifest/v1 manifest: ${e.message}`);
    m = null;
  }
  const expected = new Set([...hashedFiles(m), ...ATTESTATION]);
  const present = new Set(b.files.keys());
  const extra = [...present].filter((p) => !expected.has(p) && !OPTIONAL.includes(p)).sort();
  const missing = [...expected].filter((p) => !present.has(p)).sort();
  const wanted = new Set([...expected, ...OPTIONAL].filter((p) => p.includes("/")).map((p) => p.slice(0, p.lastIndexOf("/"))));
  const problems = [...extra.map((p) => `unexpected file ${p}`), ...missing.map((p) => `missing ${p}`),
    ...[...b.dirs].filter((d) => !wanted.has(d)).sort().map((d) => `unexpected directory ${d}/`),
    ...[...b.odd].sort().map((p) => `${p} is a symlink or special file`)];
  f.add("bundle.files", problems.length ? "fail" : "pass", problems.join("; ") || `${present.size} files, none unexpected`);
  return m;
}

export function quoteBytes(f, b) {
  const raw = b.files.get("quote.bin");
  if (!raw) { f.add("quote.parse", "fail", "quote.bin missing or unreadable"); return null; }
  if (!raw.length || raw.length > MAX_QUOTE_BYTES) {
    f.add("quote.parse", "fail", `quote.bin is ${raw.length ? `larger than ${MAX_QUOTE_BYTES} bytes` : "empty"}: not a TDX quote`);
    return null;
  }
  const h = b.files.get("quote.hex");
  let ok = false;
  if (h) {
    let s = 0, e = Math.min(h.length, 2 * MAX_QUOTE_BYTES + 2);
    const ws = (c) => c === 32 || (c >= 9 && c <= 13);
    while (s < e && ws(h[s])) s++;
    while (e > s && ws(h[e - 1])) e--;
    const body = h.subarray(s, e);
    ok = body.every((c) => c < 128) && String.fromCharCode(...body).toLowerCase() === hex(raw);
  }
  f.add("quote.hex", ok ? "pass" : "fail", ok ? "quote.hex = hex(quote.bin)" : "quote.hex differs from quote.bin");
  return raw;
}

export async function verifyBundle(b, { policy, now, ops = null }) {
  const f = new Findings();
  const manifestBytes = b.files.get("manifest.json");
  const m = manifestStep(f, b, manifestBytes);
  const raw = quoteBytes(f, b);
  const coll = readCollateral(f, b);
  const events = readEvents(f, b);
  const mrConfig = b.files.get("mr-config.json") ?? null;
  if (raw) {
    const expected = sha512(concat(enc.encode("cvm-tune-manifest-v1:"), manifestBytes));
    verifyQuote(f, raw, { policy, now, coll, events, expectedReportData: expected, mrConfig });
  }
  if (m) {
    f.bundle = { run_id: m.run_id, created_at: m.created_at, audit_head: m.audit.head, audit_last_seq: m.audit.first_seq + m.audit.entries - 1 };
    const bad = Object.keys(m.files).sort().filter((rel) => !b.files.has(rel) || sha256hex(b.files.get(rel)) !== m.files[rel])
      .map((rel) => (b.files.has(rel) ? `${rel} changed` : `${rel} unreadable`));
    f.add("manifest.files", bad.length ? "fail" : "pass", bad.join("; ") || `${Object.keys(m.files).length} file hashes match`);
    composeAndAppId(f, b, m);
    composeAudit(f, b, policy);
    build(f, b, m);
    const entries = auditEntries(b.files.get("audit.jsonl"));
    const config = b.files.get("config.json") ?? null;
    auditSteps(f, entries, config, m, policy);
    anchorsStep(f, b, m, entries, { policy, now, coll, mrConfig });
    gpuStep(f, b.files.get("gpu-evidence.json") ?? null, m, events, entries);
    f.add("gpu.boot_evidence", ...bootEvidenceStep(events, b.files.get("gpu-boot-evidence.json") ?? null));
    f.gpu = gpuStatus(events, m.gpu != null && m.gpu.present === true, f.checks);
    evaluation(f, m, config);
    if (m.confidentiality) {
      f.add("confidential.outputs", ...confidentialOutputs(b, m));
      f.add("confidential.plaintext", "skip", "the weights are encrypted: a recipient checks them with --identity KEY");
      f.add("model.signature", "skip", "the signature covers the plaintext: a recipient checks it with --identity KEY");
    } else {
      await modelSignature(f, b, m);
    }
    privacyStep(f, m, policy, config);
    inputs(f, m);
  }
  if (ops !== null) opChainCheck(f, m, ops);
  return f;
}

/** collateral.json parsed (null when absent; collateral.parse fails when it does not parse). */
export function readCollateral(f, b) {
  if (!b.files.has("collateral.json")) return null;
  try { return parseCollateral(b.files.get("collateral.json")); } catch (e) {
    if (!(e instanceof CollateralError)) throw e;
    f.add("collateral.parse", "fail", e.message);
    return null;
  }
}

/** event_log.json parsed (null, and event_log.parse failed, when it is missing or does not parse). */
export function readEvents(f, b) {
  try {
    if (!b.files.has("event_log.json")) throw new EventLogError("event_log.json missing or unreadable");
    return parseEventLog(b.files.get("event_log.json"));
  } catch (e) {
    if (!(e instanceof EventLogError)) throw e;
    f.add("event_log.parse", "fail", e.message);
    return null;
  }
}

export function composeAndAppId(f, b, m) {
  const app = b.files.get("app-compose.json");
  const actual = app ? sha256hex(app) : null;
  const measured = f.boot ? f.boot.hex("compose-hash") : null;
  const td = f.quote && f.quote.td;
  const problems = [];
  if (actual !== m.tee.compose_hash) problems.push("app-compose.json does not hash to the manifest's compose_hash");
  if (measured !== m.tee.compose_hash) problems.push(`event-log compose-hash ${measured || "(absent)"} differs from the manifest`);
  const mrConfig = b.files.get("mr-config.json") ?? null;
  const [bound, how] = td ? checkMrConfigId(td.mr_config_id, m.tee.compose_hash, f.boot ? f.boot.hex("app-id") : null,
    f.boot ? f.boot.values.get("key-provider") : null, f.boot, mrConfig) : [true, "no quote"];
  if (!bound) problems.push(how);
  if (mrConfig !== null && td && td.mr_config_id[0] !== 3) problems.push("mr-config.json is in the bundle but MRCONFIGID is not v3: nothing binds it");
  f.add("compose.hash", problems.length ? "fail" : "pass", problems.join("; ") || `compose-hash ${m.tee.compose_hash.slice(0, 16)}… consistent; ${how}`);
  const appId = f.boot ? f.boot.hex("app-id") : null;
  const ok = appId === m.tee.app_id;
  f.add("tee.app_id", ok ? "pass" : "fail", `app-id ${appId || "(absent)"}` + (ok ? "" : ` != manifest ${m.tee.app_id}`));
}

/** compose.audit: the dstack 0.6 app-compose findings, each accepted only when the policy names it. */
export function composeAudit(f, b, policy) {
  let doc = null;
  try { const t = utf8(b.files.get("app-compose.json") || new Uint8Array()); doc = t === null ? null : parseJsonExact(t).value; } catch { doc = null; }
  if (!doc || typeof doc !== "object" || Array.isArray(doc)) { f.add("compose.audit", "fail", "app-compose.json missing or not a JSON object"); return; }
  const [findings, problems, notes] = dstack06Audit(doc);
  const measured = f.boot ? f.boot.hex("gpu-policy-hash") : null;
  if (measured !== null && measured !== gpuPolicyHash(doc)) problems.push("the measured gpu-policy-hash is not the hash of app-compose.json's requirements.gpu_policy");
  const allowed = policy.allowed_compose_findings || [];
  const refused = [...findings.filter(([n]) => !allowed.includes(n)).map(([, msg]) => msg), ...problems];
  const said = [...findings.filter(([n]) => allowed.includes(n)).map(([n]) => `accepted by the policy: ${n}`), ...notes];
  if (refused.length) {
    f.add("compose.audit", "fail", refused.join("; ") + (findings.length ? " (a policy may accept a finding by name: allowed_compose_findings)" : "") + said.map((x) => `; ${x}`).join(""));
  } else f.add("compose.audit", "pass", said.join("; ") || "no init_script, GPU policy not weakened");
}

function build(f, b, m) {
  const app = b.files.get("app-compose.json");
  const image = app ? serviceImage(app, "cvm-tune") ?? null : null;
  const bi = m.build;
  if (!bi || bi.image == null) {
    if (image !== null) f.add("build.image", "fail", `the manifest omits the measured cvm-tune image ${image}`);
    else f.add("build.image", "skip", "no cvm-tune image in app-compose.json and none recorded");
  } else {
    const digest = /^[^@\s]+@(sha256:[0-9a-f]{64})$/.exec(image || "");
    if (bi.image !== image || bi.image_digest == null || !digest || bi.image_digest !== digest[1]) {
      f.add("build.image", "fail", `manifest image ${bi.image} is not the app-compose's cvm-tune image ${image}`);
    } else f.add("build.image", "pass", `${bi.image_digest} (measured through the compose-hash)`);
  }
  if (!bi || bi.lock_file == null) f.add("build.lock", "skip", "no dependency lock recorded (not a container build)");
  else if (bi.lock_mismatches.length) f.add("build.lock", "fail", `the environment differed from ${bi.lock_file}: ${bi.lock_mismatches.slice(0, 5).join("; ")}`);
  else f.add("build.lock", "pass", `${bi.lock_file} sha256 ${bi.lock_sha256}; every pin installed`);
}

function evaluation(f, m, config) {
  const ev = m.evaluation;
  if (!ev) return;
  const problems = [];
  if (ev.promote !== (ev.candidate_loss <= ev.parent_loss * (1 + ev.max_regression))) {
    problems.push(`promote=${ev.promote ? "True" : "False"} contradicts the scores (${ev.candidate_loss.toFixed(4)} vs ${ev.parent_loss.toFixed(4)} x (1 + ${ev.max_regression}))`);
  }
  let configured = null;
  try { configured = JSON.parse(utf8(config)).evaluation.max_regression; } catch { configured = null; }
  if (configured !== ev.max_regression) problems.push(`max_regression ${ev.max_regression} is not the bundle config's (${configured})`);
  f.add("evaluation.decision", problems.length ? "fail" : "pass", problems.join("; ") ||
    `${ev.promote ? "promoted" : "not promoted"}: eval loss ${ev.candidate_loss.toFixed(4)} vs ${ev.parent_loss.toFixed(4)} (${ev.parent}) on ${ev.rows} owner eval rows`);
}

function inputs(f, m) {
  const ok = filesDigestOf(m.base_model.files) === m.base_model.tree_sha256;
  f.add("base_model.tree", ok ? "pass" : "fail", ok ? "tree hash recomputed" : "base_model.tree_sha256 does not match its file list");
  f.add("dataset.file", "skip", "no --dataset given: the encrypted dataset hash was not checked");
  const d = m.dataset;
  if (d.owner_public_key == null) {
    const fine = d.owner_key_id == null && d.commitment == null;
    f.add("dataset.owner", fine ? "skip" : "fail", fine ? "the dataset was not owner-signed (format version 1)" : "owner fields without an owner public key");
    return;
  }
  const good = d.owner_key_id === sha256hex(Uint8Array.from(d.owner_public_key.match(/../g), (x) => parseInt(x, 16))) && d.commitment != null;
  f.add("dataset.owner", good ? "pass" : "fail", good ? `owner key ${d.owner_key_id.slice(0, 16)}… (pass --dataset to check the file's signature)`
    : "owner_key_id is not the SHA-256 of owner_public_key, or the commitment is missing");
}

