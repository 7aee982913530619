// compose-hash and MRCONFIGID (verifier-spec §3), and the cvm-tune service's image in app-compose.json.
import { parse as parseYaml } from "yaml";
import { Num, canonical, concat, enc, hex, isObj, keccak256, parseJsonExact, pyFloat, sha256, sha256hex, unhex, utf8 } from "./util.js";
import { pyRepr } from "./eventlog.js";

const KIND_BYTE = { none: 0, local: 1, kms: 2, tpm: 3 };
const EVENT_KIND = { none: "none", "local-sgx": "local", local: "local", kms: "kms", tpm: "tpm" };

/** The bytes of a key-provider boot event's id (verifier-spec §3; attestation/compose/mr_config.py key_provider_id):
 * hex digits of either case, an even number, after an optional lowercase 0x; absent, null or "": none. Throws otherwise. */
export function keyProviderId(kp) {
  const value = kp.id;
  if (value === undefined || value === null) return new Uint8Array();
  if (typeof value !== "string") throw new Error("the key-provider id is not a string");
  const bytes = unhex(value.startsWith("0x") ? value.slice(2) : value);
  if (!bytes) throw new Error(`the key-provider id ${pyRepr(value.slice(0, 80))} is not hex (an optional 0x, then an even number of digits)`);
  return bytes;
}

/** [ok, what was checked]: does MRCONFIGID bind this compose-hash (from measured values only)? v3 also needs the boot
 * info (bootInfo) and the MrConfigV3 document's bytes. */
export function checkMrConfigId(configId, composeHashHex, appIdHex, keyProviderEvent, boot = null, mrConfig = null) {
  if (configId.every((x) => x === 0)) return [true, "MRCONFIGID is zero: the VMM did not bind the compose-hash (use_mrconfigid off); RTMR3 alone binds it"];
  const version = configId[0];
  if (version === 1) {
    const ok = hex(configId) === "01" + composeHashHex + "00".repeat(15);
    return [ok, `MRCONFIGID v1 ${ok ? "carries" : "does not carry"} the compose-hash`];
  }
  if (version === 3) {
    const measured = boot ? new Map(boot.values) : new Map([["app-id", appIdHex ? unhex(appIdHex) : null], ["key-provider", keyProviderEvent]].filter((p) => p[1]));
    return checkV3(configId, composeHashHex, measured, boot ? boot.initScripts : null, mrConfig);
  }
  if (version !== 2) return [false, `MRCONFIGID version ${version} is not one dstack sets (1, 2 or 3): cannot be checked`];
  let kind, want = null;
  try {
    const kp = JSON.parse(utf8(keyProviderEvent || new Uint8Array()) ?? "");
    kind = EVENT_KIND[kp.name];
    if (!kind) throw new Error(`unknown key provider ${kp.name}`);
    const id = keyProviderId(kp);
    if (appIdHex) {
      const parts = [unhex(composeHashHex), unhex(appIdHex.replace(/^0x/, "")), new Uint8Array([KIND_BYTE[kind]]), id];
      if (parts.some((p) => !p)) throw new Error("compose-hash, app id and key_provider_id must be hex");
      want = "02" + hex(keccak256(concat(...parts))) + "00".repeat(15);
    }
  } catch (e) {
    return [false, `MRCONFIGID v2 needs the measured app-id and key-provider events: ${e.message}`];
  }
  const ok = want === hex(configId);
  return [ok, `MRCONFIGID v2 ${ok ? "matches" : "does not match"} keccak(compose-hash, app-id, ${kind} key provider id)`];
}

/** The image of service `name` in app-compose.json's docker-compose text; undefined when it cannot be read. */
export function serviceImage(appComposeBytes, name) {
  try {
    const doc = JSON.parse(utf8(appComposeBytes));
    if (typeof doc.docker_compose_file !== "string") return undefined;
    const svc = (parseYaml(doc.docker_compose_file).services || {})[name];
    return svc && typeof svc.image === "string" ? svc.image : null;
  } catch { return undefined; }
}

// ---- MRCONFIGID v3 (dstack 0.6): attestation/compose/mr_config.py ----
const V3_FIELDS = ["version", "app_id", "compose_hash", "gpu_policy_hash", "key_provider", "key_provider_id", "instance_id", "init_script_hashes"];
const V3_HEX = { app_id: "app-id", compose_hash: "compose-hash", gpu_policy_hash: "gpu-policy-hash", instance_id: "instance-id" };
const V3_PROVIDERS = ["none", "kms", "local", "tpm"];
const isHex = (v) => typeof v === "string" && v.length % 2 === 0 && /^[0-9a-fA-F]*$/.test(v);

export function mrConfigIdV3(documentBytes) {
  return "03" + hex(sha256(concat(enc.encode("dstack-mr-config-v3:"), new Uint8Array([0]), documentBytes))) + "00".repeat(15);
}

/** The fields of a MrConfigV3 document (hex lowercased; null members left out), or throws an Error saying why not. */
export function parseV3(bytes) {
  if (bytes.length > 64 << 10) throw new Error(`the document is ${bytes.length} bytes (limit ${64 << 10})`);
  const text = utf8(bytes);
  if (text === null) throw new Error("the document is not UTF-8");
  const parsed = parseJsonExact(text);
  if (parsed.dupes) throw new Error("a member appears twice");
  const doc = parsed.value;
  if (!isObj(doc)) throw new Error("the document is not a JSON object");
  const unknown = Object.keys(doc).filter((k) => !V3_FIELDS.includes(k)).sort();
  if (unknown.length) throw new Error(`unknown member ${pyRepr(unknown[0])} (dstack rejects unknown fields; so does this verifier)`);
  const out = {};
  for (const [k, v] of Object.entries(doc)) if (v !== null) out[k] = v;
  const version = "version" in out ? out.version : new Num("3");
  if (!(version instanceof Num && version.value === 3)) throw new Error(`version ${pyReprValue(version, 20)} is not 3`);
  out.version = 3;
  if (!("compose_hash" in out) || !("key_provider" in out)) throw new Error("compose_hash and key_provider are required");
  for (const k of [...Object.keys(V3_HEX), "key_provider_id"]) {
    if (!(k in out)) continue;
    if (!isHex(out[k])) throw new Error(`${k} is not ${typeof out[k] === "string" ? "hex" : "a hex string"}`);
    out[k] = out[k].toLowerCase();
  }
  if (!V3_PROVIDERS.includes(out.key_provider)) throw new Error(`key_provider is not one of ${V3_PROVIDERS.join(", ")}`);
  if ("init_script_hashes" in out) {
    const s = out.init_script_hashes;
    if (!Array.isArray(s) || s.length > 5) throw new Error("init_script_hashes is not a list of at most 5 hashes");
    if (!s.every(isHex)) throw new Error(`init_script_hashes is not hex`);
    out.init_script_hashes = s.map((h) => h.toLowerCase());
  }
  return out;
}

/** [ok, what was checked] for a v3 MRCONFIGID (attestation/compose/mr_config.py check_v3). */
export function checkV3(configId, composeHashHex, measured, initScripts, documentBytes) {
  if (documentBytes === null || documentBytes === undefined) {
    return [false, "MRCONFIGID v3 binds a MrConfigV3 document and none was given (a bundle carries it as mr-config.json; verify-quote reads --mr-config or the Attest answer's vm_config mr_config)"];
  }
  if (mrConfigIdV3(documentBytes) !== hex(configId)) return [false, 'MRCONFIGID v3 is not SHA-256("dstack-mr-config-v3:" ‖ 00 ‖ the given MrConfigV3 document)'];
  let doc;
  try { doc = parseV3(documentBytes); } catch (e) { return [false, `MRCONFIGID v3: the MrConfigV3 document is not one dstack writes: ${e.message}`]; }
  const problems = [];
  if (doc.compose_hash !== composeHashHex) problems.push("compose_hash is not the compose-hash");
  for (const [field, event] of Object.entries(V3_HEX)) {
    if (field in doc && field !== "compose_hash" && (!measured.has(event) || hex(measured.get(event)) !== doc[field])) {
      problems.push(`${field} is not the measured ${event}` + (measured.has(event) ? "" : " (absent)"));
    }
  }
  let kind = null, kpId = null;
  try {
    const kp = JSON.parse(utf8(measured.get("key-provider")) ?? "");
    kind = Object.hasOwn(EVENT_KIND, kp.name) ? EVENT_KIND[kp.name] : null;
  } catch { kind = null; }
  if (kind !== null) { try { kpId = hex(keyProviderId(JSON.parse(utf8(measured.get("key-provider"))))); } catch { kpId = null; } }
  if (kind === null) problems.push('the key-provider boot event is absent or not {"name": …, "id": …} with a known name');
  else if (kind !== doc.key_provider) problems.push(`key_provider ${doc.key_provider} is not the measured key provider ${kind}`);
  else if ("key_provider_id" in doc && doc.key_provider_id !== kpId) problems.push("key_provider_id is not the measured key provider id");
  if ("init_script_hashes" in doc) {
    const got = initScripts === null || initScripts === undefined ? null : initScripts.map(hex);
    if (got === null || got.length !== doc.init_script_hashes.length || got.some((h, i) => h !== doc.init_script_hashes[i])) {
      problems.push(`init_script_hashes ${doc.init_script_hashes.length} pinned, ${got === null ? "unknown" : got.length} measured (or in another order)`);
    }
  }
  if (problems.length) return [false, "MRCONFIGID v3 document hashes to MRCONFIGID but " + problems.join("; ")];
  const asserted = V3_FIELDS.filter((k) => k in doc && k !== "version");
  return [true, `MRCONFIGID v3 is the hash of the MrConfigV3 document; its ${asserted.join(", ")} equal the measured values`];
}

// ---- dstack 0.6 app-compose fields: attestation/compose/dstack06.py ----
const GPU_POLICY_FIELDS = ["attest_gpu", "rego", "allow_devtools", "allow_debug", "allow_insecure_boot"];
const REQUIREMENTS_FIELDS = ["os_version", "platforms", "tdx_measure_acpi_tables", "launch_token_hash", "gpu_policy"];
const WEAKENING = [
  ["attest_gpu", false, "no GPU attestation at all: dstack admits any GPU, or none, unchecked"],
  ["allow_devtools", true, "a GPU in CC DevTools mode (its memory readable by the host) is accepted"],
  ["allow_debug", true, "a GPU whose debug status (dbgstat) is enabled is accepted"],
  ["allow_insecure_boot", true, "a GPU that did not boot securely (secboot) is accepted"],
];
const isInt = (v) => v instanceof Num && v.isInt;

/** Python's repr() of a JSON value, cut to n characters (the `{x!r:.n}` of the Python messages). */
function pyReprValue(v, n) {
  let s;
  if (v === null) s = "None";
  else if (v === true) s = "True";
  else if (v === false) s = "False";
  else if (v instanceof Num) s = v.isInt ? BigInt(v.text).toString() : pyFloat(v.value);
  else if (typeof v === "string") s = pyRepr(v);
  else s = Array.isArray(v) ? "[…]" : "{…}";
  return Array.from(s).slice(0, n).join("");
}

/** [findings as [name, message], problems, notes] for dstack 0.6's app-compose fields (parseJsonExact values). */
export function dstack06Audit(doc) {
  const findings = [], problems = [], notes = [];
  if ("init_script" in doc) {
    const v = doc.init_script;
    const scripts = typeof v === "string" ? (v ? [v] : []) : Array.isArray(v) && v.every((x) => typeof x === "string") ? v.filter((x) => x) : null;
    if (scripts === null || scripts.length > 5) problems.push("init_script is not a bash script or a list of at most 5 (dstack refuses it)");
    else if (scripts.length) findings.push(["init_script", `init_script runs ${scripts.length} bash script(s) as root before dockerd on every boot (dstack 0.6), outside anything the docker-compose audit sees: read them`]);
  }
  requirements(doc.requirements, findings, problems, notes);
  const mv = "manifest_version" in doc ? doc.manifest_version : null;
  if (mv !== null) {
    const n = isInt(mv) ? mv.value : typeof mv === "string" && ["1", "2", "3"].includes(mv) ? Number(mv) : null;
    if (n === null || n < 1 || n > 3) problems.push(`manifest_version ${pyReprValue(mv, 20)} is not 1, 2 or 3 (a dstack 0.6 guest refuses more than 3)`);
    else if (n === 3) notes.push(`manifest_version ${pyReprValue(mv, 1000)}: dstack 0.6 format (init_script_hashes enter MrConfigV3)` + (typeof mv === "string" ? "" : '; write it as the string "3" so older guests fail closed'));
  }
  const kp = "key_provider" in doc ? doc.key_provider : null;
  if (kp !== null) {
    if (!V3_PROVIDERS.includes(kp)) problems.push(`key_provider ${pyReprValue(kp, 40)} is not one of ${V3_PROVIDERS.join(", ")}`);
    else if (kp === "tpm") notes.push("key_provider tpm: keys come from this machine's vTPM, not a KMS (no rotation, no migration)");
    else notes.push(`key_provider ${kp}`);
  }
  const st = "secure_time" in doc ? doc.secure_time : null;
  if (st !== null && typeof st !== "boolean") problems.push(`secure_time ${pyReprValue(st, 20)} is not true or false`);
  else if (st === false) notes.push("secure_time false: the CVM takes the host's clock (collateral and certificate times inside it are the host's word)");
  const ev = "event_log_version" in doc ? doc.event_log_version : null;
  if (ev !== null) {
    if (!isInt(ev) || ![1, 2].includes(ev.value)) problems.push(`event_log_version ${pyReprValue(ev, 20)} is not 1 or 2`);
    else notes.push(`event_log_version ${ev.value}` + (ev.value === 2 ? ": RTMR3 events are V2 (digest over canonical JSON; preimages checked)" : ""));
  }
  const vols = "verity_volumes" in doc ? doc.verity_volumes : null;
  if (vols !== null) {
    const ok = Array.isArray(vols) && vols.every((v) => isObj(v) && Object.keys(v).length === 3 && ["source", "verity_root", "target"].every((k) => typeof v[k] === "string" && v[k]));
    if (!ok) problems.push("verity_volumes is not a list of {source, verity_root, target} strings");
    else for (const v of vols) notes.push(`verity volume ${v.source} -> ${v.target} (dm-verity root ${Array.from(v.verity_root).slice(0, 16).join("")}…): read-only, measured through the compose-hash`);
  }
  return [findings, problems, notes];
}

function requirements(req, findings, problems, notes) {
  if (req === undefined || req === null) return;
  if (!isObj(req)) { problems.push("requirements is not a mapping"); return; }
  const unknown = Object.keys(req).filter((k) => !REQUIREMENTS_FIELDS.includes(k)).sort();
  if (unknown.length) problems.push(`requirements.${unknown[0]} is not a field dstack 0.6 knows (the guest refuses it)`);
  const others = REQUIREMENTS_FIELDS.filter((k) => k in req && k !== "gpu_policy");
  if (others.length) notes.push("requirements " + others.map((k) => `${k}=${Array.from(canonical(req[k], true)).slice(0, 80).join("")}`).join(", "));
  const pol = "gpu_policy" in req ? req.gpu_policy : null;
  if (pol === null) return;
  if (!isObj(pol)) { problems.push("requirements.gpu_policy is not a mapping"); return; }
  const bad = Object.keys(pol).filter((k) => !GPU_POLICY_FIELDS.includes(k)).sort();
  if (bad.length) problems.push(`requirements.gpu_policy.${bad[0]} is not a field dstack knows (deny_unknown_fields)`);
  for (const [key, weak, why] of WEAKENING) {
    const value = key in pol ? pol[key] : null;
    if (value !== null && typeof value !== "boolean") problems.push(`requirements.gpu_policy.${key} ${pyReprValue(value, 20)} is not true or false`);
    else if (value === weak) findings.push([`gpu_policy.${key}`, `requirements.gpu_policy.${key}: ${String(weak)}: ${why}`]);
  }
  const rego = "rego" in pol ? pol.rego : null;
  if (rego !== null && typeof rego !== "string") problems.push("requirements.gpu_policy.rego is not a string");
  else if (rego) notes.push(`requirements.gpu_policy.rego: a Rego relying-party policy (${Array.from(rego).length} characters) narrows which GPUs dstack admits`);
}

/** SHA-256 of the JCS of requirements.gpu_policy as written ({} when absent): dstack's gpu-policy-hash. */
export function gpuPolicyHash(doc) {
  const req = isObj(doc) ? doc.requirements : null;
  const pol = isObj(req) && "gpu_policy" in req ? req.gpu_policy : null;
  return sha256hex(enc.encode(canonical(pol === null ? {} : pol)));
}
