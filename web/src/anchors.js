// Audit anchors (verifier-spec §4a, attestation/bundle/anchors.py): on dstack 0.6 (no EmitEvent) each checkpoint or
// promote entry of the audit chain is anchored by a quote over its hash, taken in the boot that wrote it; a bundle
// carries its slice's anchors as audit-anchors.jsonl (listed in manifest.files when manifest.audit.anchors is set).
// Each anchor quote is verified with the page's own quote steps (quotechecks.js), as the bundle's quote is.
import { EventLogError, parseEventLog } from "./eventlog.js";
import { verifyQuote } from "./quotechecks.js";
import { Num, canonical, enc, equal, hex, isObj, parseJsonExact, sha512, unhex, utf8 } from "./util.js";

export const ANCHORS_FILE = "audit-anchors.jsonl";
const TAG = "cvm-tune-audit-anchor-v1";
const ANCHORED_TYPES = ["checkpoint", "promote"];
export const MAX_ANCHORS = 10000;
const KEYS = ["event_log", "head", "quote", "seq", "v"];
const HEX64 = /^[0-9a-f]{64}$/;
const HEX = /^(?:[0-9a-f]{2})+$/;
// What an anchor's quote must share with the bundle's own quote (the same TD) and its boot events (the same app and
// deployment); RTMR3 may differ across a reboot.
const SAME_TD = ["mr_td", "mr_config_id", "mr_owner", "mr_owner_config", "td_attributes", "xfam", "rt_mr0", "rt_mr1", "rt_mr2"];
const SAME_BOOT = ["app-id", "compose-hash", "instance-id", "os-image-hash", "key-provider"];

export class AnchorFormatError extends Error {}

/** The 64-byte report_data of the anchor of entry `seq` (a BigInt or an integer) whose hash is `head`. */
export function reportData(seq, head) {
  return sha512(enc.encode(`${TAG}:${seq}:${head}`));
}

// A string Python's UTF-8 encoder refuses (a lone surrogate): such a line has no canonical form.
const wellFormed = (v) => (typeof v === "string" ? !/\p{Cs}/u.test(v)
  : Array.isArray(v) ? v.every(wellFormed) : isObj(v) ? Object.entries(v).every(([k, x]) => wellFormed(k) && wellFormed(x)) : true);

/** One anchor line (bytes, no newline) -> {seq (BigInt), head, quote (bytes), eventLog (text), line}, or throws
 * AnchorFormatError: not JSON, not canonical, or not exactly the v1 members with their types. */
export function parseAnchor(line) {
  const text = utf8(line);
  let parsed;
  try { parsed = parseJsonExact(text ?? "\u0000"); } catch { throw new AnchorFormatError("anchor line is not JSON"); }
  const o = parsed.value;
  if (!isObj(o) || Object.keys(o).length !== KEYS.length || !KEYS.every((k) => Object.hasOwn(o, k))
      || !(o.v instanceof Num && o.v.isInt && o.v.value === 1)) {
    throw new AnchorFormatError("anchor line does not have the v1 members");
  }
  let canon;
  try { canon = wellFormed(o) ? canonical(o) : null; } catch { canon = null; }
  if (canon === null || !equal(enc.encode(canon), line)) throw new AnchorFormatError("anchor line is not in canonical form");  // bytes: a BOM too
  const { seq, head, quote, event_log: log } = o;
  if (!(seq instanceof Num && seq.isInt) || BigInt(seq.text) < 0n || typeof head !== "string" || !HEX64.test(head)) {
    throw new AnchorFormatError("anchor line has a bad seq or head");
  }
  if (typeof quote !== "string" || !HEX.test(quote) || typeof log !== "string") {
    throw new AnchorFormatError("anchor line has a bad quote or event_log");
  }
  return { seq: BigInt(seq.text), head, quote: unhex(quote), eventLog: log, line: text };
}

/** An audit-anchors.jsonl body -> anchors, or throws AnchorFormatError (a bad line, no final newline, too many lines). */
export function parseAnchorLines(bytes) {
  if (bytes.length && bytes[bytes.length - 1] !== 10) throw new AnchorFormatError(`${ANCHORS_FILE} does not end with a newline`);
  const ends = [];
  for (let i = 0; i < bytes.length; i++) if (bytes[i] === 10) ends.push(i);
  if (ends.length > MAX_ANCHORS) throw new AnchorFormatError(`more than ${MAX_ANCHORS} anchors`);
  let start = 0;
  return ends.map((end) => { const a = parseAnchor(bytes.subarray(start, end)); start = end + 1; return a; });
}

const tdFields = (q) => (q && q.td ? Object.fromEntries(SAME_TD.map((k) => [k, hex(q.td[k])])) : {});
const bootFields = (boot) => (boot ? Object.fromEntries(SAME_BOOT.map((k) => [k, boot.hex(k)])) : {});
const get = (o, k) => (Object.hasOwn(o, k) ? o[k] : null);

/** audit.anchors, after the quote and audit steps: `f` holds what the bundle's own quote showed. Reads
 * audit-anchors.jsonl only when the manifest says the bundle is anchored. */
export function anchorsStep(f, b, m, entries, { policy, now, coll, mrConfig }) {
  const count = m.audit.anchors;
  if (count == null) {
    if (m.audit.rtmr3 === "emit_event") f.add("audit.anchors", "skip", "not anchored: every audit entry was measured into RTMR3 as it was written");
    else f.add("audit.anchors", policy.require_audit_anchors ? "fail" : "skip", "no audit anchors: between the run's start and its export only report_data binds the chain");
    return;
  }
  if (entries instanceof Error) { f.add("audit.anchors", "fail", "audit.jsonl unreadable: the anchors name entries of it"); return; }
  let anchors;
  try {
    const body = b.files.get(ANCHORS_FILE);
    if (!body) throw new AnchorFormatError(`[Errno 2] No such file or directory: '${ANCHORS_FILE}'`);
    anchors = parseAnchorLines(body);
  } catch (e) {
    if (!(e instanceof AnchorFormatError)) throw e;
    f.add("audit.anchors", "fail", `${ANCHORS_FILE} unreadable: ${e.message}`);
    return;
  }
  const problems = anchors.length === count ? [] : [`${anchors.length} anchors, the manifest says ${count}`];
  const mainFailed = new Set(f.checks.filter((c) => c.status === "fail").map((c) => c.name));
  const quoteCheck = (raw, log, expected) => {
    let events = null;
    try { events = log.startsWith("\ufeff") ? null : parseEventLog(enc.encode(log)); } catch (e) {
      if (!(e instanceof EventLogError)) throw e;  // its event_log.* steps are then skipped: the boot identity cannot match
    }
    const g = { checks: [], boot: null, quote: null, add(name, status, reason) { this.checks.push({ name, status, reason }); } };
    verifyQuote(g, raw, { policy, now, coll, events, expectedReportData: expected, mrConfig });
    return [new Set(g.checks.filter((c) => c.status === "fail").map((c) => c.name)), tdFields(g.quote), bootFields(g.boot)];
  };
  problems.push(...anchorProblems(anchors, entries, quoteCheck, { mainFailed, mainTd: tdFields(f.quote), mainBoot: bootFields(f.boot) }));
  f.add("audit.anchors", problems.length ? "fail" : "pass", problems.slice(0, 5).join("; ")
    || (anchors.length ? `${anchors.length} checkpoint(s) anchored by quotes of this TD` : "no checkpoint to anchor"));
}

/** Why the anchors do not anchor this slice (empty: they do). `check(quote, eventLog, reportData)` verifies one
 * anchor quote: [names of its failed quote checks, its TD fields (hex), its boot event payloads (hex or null)]. */
export function anchorProblems(anchors, entries, check, { mainFailed, mainTd, mainBoot }) {
  const problems = [];
  const bySeq = new Map(entries.map((e) => [String(e.seq), e]));
  if (anchors.some((a, i) => i > 0 && anchors[i - 1].seq >= a.seq)) problems.push("anchors are not in increasing seq order, or one entry has two");
  for (const a of anchors) {
    const e = bySeq.get(String(a.seq));
    if (!e || e.hash !== a.head) { problems.push(`anchor seq ${a.seq}: no entry of the slice has that seq and hash`); continue; }
    if (!ANCHORED_TYPES.includes(e.type)) { problems.push(`anchor seq ${a.seq}: a ${e.type} entry is not anchored`); continue; }
    const [failed, td, boot] = check(a.quote, a.eventLog, reportData(a.seq, a.head));
    const extra = [...failed].filter((n) => !mainFailed.has(n)).sort();
    if (extra.length) problems.push(`anchor seq ${a.seq}: its quote fails ${extra.join(", ")}`);
    let differ = SAME_TD.filter((k) => get(td, k) !== get(mainTd, k));
    if (differ.length) problems.push(`anchor seq ${a.seq}: its quote is of another TD (${differ.join(", ")} differ)`);
    differ = SAME_BOOT.filter((k) => get(boot, k) !== get(mainBoot, k));
    if (differ.length) problems.push(`anchor seq ${a.seq}: its boot events name another deployment (${differ.join(", ")} differ)`);
  }
  const anchored = new Set(anchors.map((a) => String(a.seq)));
  for (const e of entries) if (e.type === "checkpoint" && !anchored.has(String(e.seq))) problems.push(`checkpoint entry seq ${e.seq} has no anchor`);
  return problems;
}
