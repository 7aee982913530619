// The audit chain (verifier-spec §4) and its RTMR3 binding (§6, audit.rtmr3).
import { canonical, enc, filesDigestOf, isObj, jsonEqual, parseJsonExact, plain, sha256hex, utf8 } from "./util.js";
import { WEIGHTS, storedName } from "./confidential.js";

const KEYS = ["data", "prev", "run_id", "seq", "time", "type", "v"];
const TYPES = ["run.start", "run.resume", "gpu.evidence", "train.batch", "train.done", "export", "checkpoint",
  "checkpoint.rejected", "run.abort", "privacy.spent", "promote"];
const GENESIS = "0".repeat(64);
const ADAPTER_FILES = ["adapter/adapter_config.json", WEIGHTS]; // plaintext names: train.done's keys
const ARTIFACT_FILES = [...ADAPTER_FILES, "config.json", "app-compose.json", "README.md"];

class AuditFormatError extends Error {}

/** One canonical audit line (bytes, no newline) -> entry, or throws AuditFormatError. */
export function parseEntry(line) {
  const text = utf8(line);
  let parsed;
  try { parsed = parseJsonExact(text ?? ""); } catch { throw new AuditFormatError("audit line is not JSON"); }
  const o = parsed.value;
  const v = o && o.v;
  if (!isObj(o) || Object.keys(o).length !== 7 || !KEYS.every((k) => k in o) || !(v && v.isInt && v.value === 1)) {
    throw new AuditFormatError("audit line does not have the v1 fields");
  }
  let canon;
  try { canon = canonical(o); } catch { canon = null; }
  if (parsed.dupes || canon !== text) throw new AuditFormatError("audit line is not in canonical form");
  if (!TYPES.includes(o.type) || !isObj(o.data)) throw new AuditFormatError(`unknown audit entry type '${o.type}'`);
  if (!(o.seq && o.seq.isInt) || typeof o.prev !== "string" || o.prev.length !== 64) throw new AuditFormatError("audit line has a bad seq or prev");
  return { seq: o.seq.value, run_id: o.run_id, type: o.type, data: plain(o.data), prev: o.prev, line: text, hash: sha256hex(line) };
}

/** The entries of audit.jsonl, or an Error saying why they cannot be read. */
export function auditEntries(bytes) {
  if (!bytes) return new Error("[Errno 2] No such file or directory: 'audit.jsonl'");
  if (bytes.length && bytes[bytes.length - 1] !== 10) return new AuditFormatError("audit log does not end with a newline (truncated write?)");
  const out = [];
  let start = 0;
  try {
    for (let i = 0; i < bytes.length; i++) if (bytes[i] === 10) { out.push(parseEntry(bytes.subarray(start, i))); start = i + 1; }
  } catch (e) { return e; }
  return out;
}

function chainProblems(entries) {
  const problems = [];
  for (let i = 1; i < entries.length; i++) {
    const [a, b] = [entries[i - 1], entries[i]];
    if (b.prev !== a.hash) problems.push(`entry seq ${b.seq}: prev does not match the hash of entry seq ${a.seq}`);
    if (b.seq !== a.seq + 1) problems.push(`entry seq ${b.seq} follows seq ${a.seq}`);
  }
  if (entries.length && entries[0].seq === 0 && entries[0].prev !== GENESIS) problems.push("entry seq 0 does not start from the genesis hash");
  return problems;
}

/** SHA-256 of the canonical JSON of config.json's base_model and training sections (Python's ensure_ascii form). */
function trainingConfigSha256(config) {
  try {
    const doc = parseJsonExact(utf8(config)).value;
    if (!isObj(doc) || !("base_model" in doc) || !("training" in doc)) return "invalid";
    return sha256hex(enc.encode(canonical({ base_model: doc.base_model, training: doc.training }, true)));
  } catch { return "invalid"; }
}

const trainedHash = (m, rel) => (m.confidentiality && m.confidentiality.plaintext_sha256[rel]) || m.files[rel];

function entryContents(entries, m, config) {
  const parent = m.lineage ? m.lineage.parent_manifest_sha256 : null;
  const inputs = {
    config_sha256: m.files["config.json"], dataset_encrypted_sha256: m.dataset.encrypted_sha256,
    dataset_plaintext_sha256: m.dataset.plaintext_sha256, base_model_tree_sha256: m.base_model.tree_sha256,
    code_source_sha256: m.code.source_sha256,
  };
  const training = config !== null ? trainingConfigSha256(config) : null;
  const artifacts = ARTIFACT_FILES.map((k) => storedName(k, m.confidentiality != null)); // encrypted weights: <name>.age
  const last = {
    "train.done": { global_step: m.training.global_step, adapter_sha256: Object.fromEntries(ADAPTER_FILES.map((k) => [k, trainedHash(m, k)])) },
    export: { artifacts_sha256: filesDigestOf(Object.fromEntries(artifacts.map((k) => [k, m.files[k]]))) },
    "privacy.spent": m.privacy != null ? m.privacy : { mechanism: null },
  };
  const problems = [];
  if (m.privacy != null && !entries.some((e) => e.type === "privacy.spent")) problems.push("the manifest records DP-SGD but the audit chain has no privacy.spent entry");
  const opens = entries.filter((e) => e.type === "run.start" || (e.type === "run.resume" && "config_sha256" in e.data));
  for (const e of opens) {
    const want = { ...inputs };
    const isLast = e === opens[opens.length - 1];
    if (!isLast) delete want.config_sha256;
    if ("training_config_sha256" in e.data) want.training_config_sha256 = training;
    else if (!isLast) want.config_sha256 = inputs.config_sha256;
    for (const [k, v] of [["dataset_id", m.dataset.dataset_id], ["dataset_version", m.dataset.dataset_version]]) if (k in e.data) want[k] = v;
    if ("parent_manifest_sha256" in e.data || parent !== null) want.parent_manifest_sha256 = parent;
    if (Object.entries(want).some(([k, v]) => !jsonEqual(k in e.data ? e.data[k] : null, v))) {
      problems.push(`${e.type} entry (seq ${e.seq}) commits to different hashes than the manifest`);
    }
    problems.push(...opChainProblems(e, m));
  }
  for (const [kind, expected] of Object.entries(last)) {
    const final = entries.filter((e) => e.type === kind);
    const e = final[final.length - 1];
    if (e && Object.entries(expected).some(([k, v]) => !jsonEqual(k in e.data ? e.data[k] : null, v))) {
      problems.push(`${kind} entry (seq ${e.seq}) commits to different hashes than the manifest`);
    }
  }
  return problems;
}

/** An opening entry's op_chain member is the manifest's block (null members left out of both); none without one. */
function opChainProblems(e, m) {
  if (m.op_chain == null) return "op_chain" in e.data ? [`${e.type} entry (seq ${e.seq}) names an op chain the manifest does not have`] : [];
  const present = (b) => (isObj(b) ? Object.fromEntries(Object.entries(b).filter(([, v]) => v !== null)) : b ?? null);
  const want = present({ schema: "cvm-tune/op-chain/v1", ...m.op_chain });
  return jsonEqual(present(e.data.op_chain), want) ? [] : [`${e.type} entry (seq ${e.seq}) commits to another op chain than the manifest's`];
}

export function auditSteps(f, entries, config, m, policy) {
  if (entries instanceof Error) { f.add("audit.chain", "fail", `audit.jsonl unreadable: ${entries.message}`); return; }
  const problems = chainProblems(entries);
  if (!entries.length) problems.push("audit.jsonl is empty");
  else {
    const first = entries[0], last = entries[entries.length - 1];
    if (first.type !== "run.start" || last.type !== "export") problems.push("the slice must run from a run.start entry to an export entry");
    if (first.prev !== m.audit.start_prev || first.seq !== m.audit.first_seq || entries.length !== m.audit.entries) problems.push("slice start/length differ from the manifest");
    if (last.hash !== m.audit.head) problems.push("chain head differs from the manifest");
    if (entries.some((e) => e.run_id !== m.run_id)) problems.push("an entry belongs to another run");
    problems.push(...entryContents(entries, m, config));
  }
  f.add("audit.chain", problems.length ? "fail" : "pass", problems.join("; ") || `${entries.length} entries, head ${m.audit.head.slice(0, 16)}…`);
  auditRtmr3(f, entries, m, policy);
}

function auditRtmr3(f, entries, m, policy) {
  if (m.audit.rtmr3 === "unsupported") {
    f.add("audit.rtmr3", policy.require_rtmr3_audit ? "fail" : "skip", "the guest agent did not support EmitEvent: audit chain is bound by report_data only");
    return;
  }
  if (!f.boot) { f.add("audit.rtmr3", "fail", "no usable event log to match the audit entries against"); return; }
  const measured = [];
  for (const ev of f.boot.app) {
    let entry = null;
    try { entry = parseEntry(ev.payload); } catch { entry = null; }
    if (!entry || ev.event !== "cvm-tune." + entry.type) {
      f.add("audit.rtmr3", "fail", `RTMR3 app event '${ev.event}' (index ${ev.index}) is not a cvm-tune audit entry`);
      return;
    }
    measured.push(entry);
  }
  const problems = chainProblems(measured);
  const lines = entries.map((e) => e.line), seen = measured.map((e) => e.line);
  let start = null;
  for (let i = 0; i < lines.length; i++) {
    const n = lines.length - i;
    if (n <= seen.length && seen.slice(seen.length - n).every((l, j) => l === lines[i + j])) { start = i; break; }
  }
  if (start === null || (start > 0 && entries[start].type !== "run.resume")) problems.push("the audit entries of this run are not the last events measured into RTMR3");
  f.add("audit.rtmr3", problems.length ? "fail" : "pass", problems.join("; ") || `${lines.length - (start || 0)} audit entries measured into RTMR3 and replayed`);
}
