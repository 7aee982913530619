// dstack event log: parse, replay RTMR0-3 with RTMR3 digests recomputed, read the boot events (verifier-spec §6, §11).
import { Num, canonical, concat, enc, equal, hex, isObj, parseJsonExact, sha384, unhex, utf8 } from "./util.js";

export const RUNTIME = 0x08000001;
// dstack's RTMR3 boot events in the order dstack emits them (attestation/tdx/eventlog.py BOOT_ORDER).
export const BOOT_ORDER = { "system-preparing": 1, "app-id": 2, "compose-hash": 3, "init-script-hash": 4, "gpu-policy-hash": 5,
  "gpu-attestation": 6, "instance-id": 7, "boot-mr-done": 8, "mr-kms": 9, "os-image-hash": 9, "key-provider": 10,
  "app-epoch": 11, "storage-fs": 12, "system-ready": 13 };
export const BOOT_TRUSTED = Object.keys(BOOT_ORDER).filter((n) => n !== "init-script-hash" && n !== "system-ready");
const MAX_INIT_SCRIPTS = 5;
const isInt = (v) => v instanceof Num && v.isInt;

export class EventLogError extends Error {}

export function parseEventLog(bytes) {
  const text = utf8(bytes);
  let data;
  try { data = parseJsonExact(text ?? "").value; } catch (e) { throw new EventLogError(`event log is not valid JSON: ${e.message}`); }
  if (!Array.isArray(data)) throw new EventLogError("event log must be a JSON list of events");
  if (data.length > 10000) throw new EventLogError(`event log has ${data.length} events (limit 10000)`);
  return data.map((e, i) => {
    if (!isObj(e)) throw new EventLogError(`event ${i} is not an object`);
    for (const k of ["imr", "event_type", "digest", "event", "event_payload"]) {
      if (!(k in e)) throw new EventLogError(`event ${i} lacks field '${k}'`);
    }
    const version = "version" in e ? e.version : new Num("1");
    if (!(isInt(e.imr) && e.imr.value >= 0 && e.imr.value <= 3)) throw new EventLogError(`event ${i}: imr must be 0..3`);
    if (!(isInt(e.event_type) && e.event_type.value >= 0 && e.event_type.value < 2 ** 32)) throw new EventLogError(`event ${i}: event_type must be a u32`);
    if (![e.digest, e.event, e.event_payload].every((x) => typeof x === "string") || !isInt(version) || ![1, 2].includes(version.value)) {
      throw new EventLogError(`event ${i}: digest/event/event_payload must be strings, version 1 or 2`);
    }
    const digest = unhex(e.digest), payload = unhex(e.event_payload);
    if (!digest || !payload) throw new EventLogError(`event ${i}: digest/event_payload are not hex`);
    if (digest.length && digest.length !== 48) throw new EventLogError(`event ${i}: digest is ${digest.length} bytes, expected 48 (SHA-384)`);
    const preimage = "preimage" in e ? e.preimage : null;
    if (preimage !== null && typeof preimage !== "string") throw new EventLogError(`event ${i}: preimage must be a hex string`);
    return { index: i, imr: e.imr.value, type: e.event_type.value, digest, event: e.event, payload, version: version.value, preimage };
  });
}

const v2Preimage = (name, payload) => enc.encode(canonical({ name, payload: hex(payload), type: RUNTIME }));

export function runtimeDigest(name, payload, version) {
  if (version === 2) return sha384(v2Preimage(name, payload));
  return sha384(concat(new Uint8Array([1, 0, 0, 8]), enc.encode(":" + name + ":"), payload));
}

export function replay(events) {
  const mrs = [0, 1, 2, 3].map(() => new Uint8Array(48));
  const problems = [];
  for (const ev of events) {
    let digest;
    if (ev.type === RUNTIME) {
      digest = runtimeDigest(ev.event, ev.payload, ev.version);
      if (ev.digest.length && !equal(ev.digest, digest)) problems.push(`event ${ev.index} (${pyRepr(ev.event)}): digest field does not match its payload`);
      const why = preimageProblem(ev);
      if (why) problems.push(why);
    } else if (ev.digest.length) digest = ev.digest;
    else { problems.push(`event ${ev.index} (imr ${ev.imr}): boot event without a digest`); continue; }
    mrs[ev.imr] = sha384(concat(mrs[ev.imr], digest));
  }
  return { rtmrs: mrs, problems };
}

/** Why a version 2 runtime event's preimage is not the canonical JSON of its name and payload (null: it is). */
export function preimageProblem(ev) {
  if (ev.version !== 2 || ev.type !== RUNTIME) return null;
  const shown = pyRepr(Array.from(ev.event).slice(0, 80).join(""));
  if (ev.preimage === null || ev.preimage === undefined) return `event ${ev.index} (${shown}): version 2 event without its preimage`;
  const pre = /^([0-9a-fA-F]{2})*$/.test(ev.preimage) ? unhex(ev.preimage.toLowerCase()) : null;
  if (!pre) return `event ${ev.index} (${shown}): preimage is not hex`;
  if (!equal(pre, v2Preimage(ev.event, ev.payload))) {
    return `event ${ev.index} (${shown}): preimage is not the canonical JSON of its name and payload (a reordered or altered preimage is refused even when its SHA-384 is the digest)`;
  }
  return null;
}

/** Python's repr() of a str (enough for event names in reasons). */
export function pyRepr(s) {
  return s.includes("'") && !s.includes('"') ? `"${s}"` : `'${s.replace(/\\/g, "\\\\").replace(/'/g, "\\'")}'`;
}

export function bootInfo(events) {
  const values = new Map(), problems = [], app = [], scripts = [];
  let ready = false, rank = 0, last = "";
  for (const ev of events.filter((e) => e.imr === 3)) {
    if (ev.type !== RUNTIME) {
      problems.push(`event ${ev.index}: RTMR3 event of type 0x${ev.type.toString(16).padStart(8, "0")} is not a dstack runtime event`);
      continue;
    }
    if (!ready) {
      if (BOOT_TRUSTED.includes(ev.event)) {
        if (values.has(ev.event)) problems.push(`event ${ev.index}: second ${pyRepr(ev.event)} before system-ready`);
        else values.set(ev.event, ev.payload);
      } else if (ev.event === "init-script-hash") {
        scripts.push(ev.payload);
        if (scripts.length === MAX_INIT_SCRIPTS + 1) problems.push(`event ${ev.index}: more than ${MAX_INIT_SCRIPTS} init-script-hash events`);
      }
      if (Object.hasOwn(BOOT_ORDER, ev.event)) {
        if (BOOT_ORDER[ev.event] < rank) problems.push(`event ${ev.index}: ${pyRepr(ev.event)} after ${pyRepr(last)}: not the order dstack measures its boot events in`);
        rank = Math.max(rank, BOOT_ORDER[ev.event]);
        last = ev.event;
      }
      if (ev.event === "system-ready") ready = true;
      continue;
    }
    if (Object.hasOwn(BOOT_ORDER, ev.event)) problems.push(`event ${ev.index}: ${pyRepr(ev.event)} after system-ready (privileged append)`);
    app.push(ev);
  }
  if (!ready) problems.push("no system-ready event: the boot measurements are incomplete");
  const dstack06 = values.has("gpu-policy-hash");
  if (dstack06 && app.length) {
    problems.push(`event ${app[0].index}: ${pyRepr(Array.from(app[0].event).slice(0, 80).join(""))} after system-ready on a dstack 0.6 boot (${app.length} such event(s)): 0.6 has no EmitEvent, so only privileged code in the CVM could have extended RTMR3; nothing after system-ready is trusted`);
  }
  return { values, ready, app, problems, initScripts: scripts, dstack06, hex: (n) => (values.has(n) ? hex(values.get(n)) : null) };
}

export function nameProblems(events, bootNames, appNames) {
  const problems = [];
  let ready = false;
  for (const ev of events) {
    if (ev.imr !== 3 || ev.type !== RUNTIME) continue;
    const shown = pyRepr(Array.from(ev.event).slice(0, 80).join(""));
    if (ev.event.includes(":")) problems.push(`event ${ev.index}: name ${shown} contains ':' (v1 digests of such names can collide)`);
    else if (!(ready ? appNames : bootNames).includes(ev.event)) {
      problems.push(`event ${ev.index}: ${shown} is not an allowed event name ${ready ? "after system-ready (app events)" : "before system-ready (dstack boot events)"}`);
    }
    ready = ready || ev.event === "system-ready";
  }
  return problems;
}
