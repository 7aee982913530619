// gpu.evidence (verifier-spec §12): gpu-evidence.json re-summarised must be the manifest's `gpu`, committed by the
// last gpu.evidence audit entry, its nonce that entry's prev; an NVIDIA (nvattest) report must be self-consistent and
// carry that nonce; dstack's boot-time GPU attestation event, when the OS made one, must say CC on, DevTools off.
import { enc, isObj, jsonEqual, sha256hex, utf8 } from "./util.js";

class GpuEvidenceError extends Error {}

function load(data) {
  let doc;
  try { doc = JSON.parse(utf8(data)); } catch { throw new GpuEvidenceError("gpu-evidence.json is not JSON"); }
  const keys = isObj(doc) ? Object.keys(doc).sort().join(",") : "";
  if (!isObj(doc) || doc.schema !== "cvm-tune/gpu-evidence/v1" || keys !== "commands,nonce,schema") {
    throw new GpuEvidenceError("gpu-evidence.json is not a cvm-tune/gpu-evidence/v1 document");
  }
  if (typeof doc.nonce !== "string" || !/^[0-9a-f]{64}$/.test(doc.nonce)) throw new GpuEvidenceError("gpu-evidence.json has a malformed nonce");
  const want = "argv,name,returncode,status,stderr,stdout";
  if (!Array.isArray(doc.commands) || !doc.commands.every((c) => isObj(c) && Object.keys(c).sort().join(",") === want)) {
    throw new GpuEvidenceError("gpu-evidence.json has malformed command entries");
  }
  const names = doc.commands.map((c) => c.name);
  if (new Set(names).size !== names.length) throw new GpuEvidenceError("gpu-evidence.json lists a command twice");
  return doc;
}

// Python's str.splitlines() line boundaries and str.isspace() characters (verifier-spec §12), which JavaScript's
// split(/\n/), trim() and \s do not match (\x1c-\x1f, \x85; \ufeff).
const lines = (t) => String(t).split(/\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]/);
const WS = "\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
const EDGES = new RegExp(`^[${WS}]+|[${WS}]+$`, "g"), RUNS = new RegExp(`[${WS}]+`);
const strip = (s) => s.replace(EDGES, "");
const words = (s) => s.split(RUNS).filter(Boolean);

function fields(text) {
  const out = {};
  for (const line of lines(text)) {
    const at = line.indexOf(":");
    if (at < 0) continue;
    const label = strip(line.slice(0, at));
    if (label && !label.startsWith("=")) out[words(label).join(" ").toLowerCase()] = strip(line.slice(at + 1));
  }
  return out;
}

function summarize(data) {
  const doc = load(data);
  const by = Object.fromEntries(doc.commands.map((c) => [c.name, c]));
  const query = by["query-gpu"];
  let smi = "error", devices = [];
  if (!query || query.status === "missing") smi = "missing";
  else if (query.status === "ok") {
    smi = "ok";
    for (const line of lines(query.stdout)) {
      if (!strip(line)) continue;
      const p = line.split(",").map(strip);
      if (p.length !== 6 || !/^\d+$/.test(p[0])) throw new GpuEvidenceError(`unexpected nvidia-smi --query-gpu line with ${p.length} fields`);
      devices.push({ index: Number(p[0]), name: p[1], uuid: p[2], pci_bus_id: p[3], driver_version: p[4], vbios_version: p[5] });
    }
  }
  const fl = {};
  for (const [n, c] of Object.entries(by)) if (n.startsWith("cc-") && ["ok", "error"].includes(c.status)) fl[n] = fields(c.stdout);
  let mode = "n/a", env = null, ready = null;
  if (devices.length) {
    const q = fl["cc-query"] || {};
    const state = ((fl["cc-status"] || {})["cc status"] || q["cc state"] || "").toUpperCase();
    const devtools = ((fl["cc-devtools"] || {})["devtools mode"] || q["devtools mode"] || "").toUpperCase();
    env = (fl["cc-environment"] || {})["cc environment"] || null;
    ready = q["cc gpus ready state"] ? q["cc gpus ready state"].toLowerCase() : null;
    if ((q["multi-gpu mode"] || "").toLowerCase().includes("protected pcie")) mode = "ppcie";
    else if (state === "ON") mode = devtools === "ON" ? "devtools" : "on";
    else if (state === "OFF") mode = "off";
    else mode = "unknown";
  }
  const att = by.nvattest;
  let report = null;
  if (att && att.status !== "missing") {
    if (att.status === "timeout") report = { tool: "nvattest", status: "timeout" };
    else {
      report = parseNvattest(att.stdout, doc.nonce);
      if (att.status === "error" && report.status === "unparseable") report = { tool: "nvattest", status: "error" };
    }
  }
  return { present: devices.length > 0, nvidia_smi: smi, devices, cc_mode: mode, cc_environment: env, ready_state: ready,
    nvidia_report: report, nonce: doc.nonce, evidence_sha256: sha256hex(data) };
}

function jwt(token) {
  const parts = String(token).split(".");
  if (parts.length !== 3) throw new GpuEvidenceError("EAT token is not a JWT");
  const [header, claims] = parts.slice(0, 2).map((p) => {
    const b = atob(p.replace(/-/g, "+").replace(/_/g, "/") + "=".repeat((4 - (p.length % 4)) % 4));
    return JSON.parse(utf8(Uint8Array.from(b, (c) => c.charCodeAt(0))));
  });
  if (!isObj(header) || !isObj(claims)) throw new GpuEvidenceError("EAT token parts are not JSON objects");
  return [header, claims];
}

/** nvattest's --format json output, summarised (attestation/tdx/gpu.py parse_nvattest). */
function parseNvattest(text, nonce) {
  let doc, overallToken, gpuTokens, listed, header, overall, gpus;
  try {
    doc = JSON.parse(text);
    overallToken = doc.detached_eat[0][1];
    gpuTokens = doc.detached_eat[1];
    listed = "claims" in doc ? doc.claims : [];
    if (!isObj(gpuTokens) || typeof overallToken !== "string" || !Array.isArray(listed)) throw new TypeError("detached_eat layout");
    [header, overall] = jwt(overallToken);
    gpus = Object.fromEntries(Object.keys(gpuTokens).sort().map((n) => [n, jwt(gpuTokens[n])]));
  } catch {
    return { tool: "nvattest", status: "unparseable" };
  }
  const submods = overall.submods || {};
  const names = Object.keys(gpuTokens);
  const digestsOk = isObj(submods) && Object.keys(submods).length === names.length && names.every((n) =>
    jsonEqual(submods[n], ["DIGEST", ["SHA256", sha256hex(enc.encode(gpuTokens[n]))]]));
  const tokens = Object.values(gpus).map(([, g]) => g);
  const claimsOk = listed.length === tokens.length && listed.every((c) => isObj(c) && tokens.some((g) =>
    Object.entries(c).every(([k, v]) => jsonEqual(g[k] ?? null, v))));
  const nonces = [overall.eat_nonce, ...Object.values(gpus).map(([, g]) => g.eat_nonce)];
  const pyStr = (v) => (v === undefined || v === null ? "None" : typeof v === "boolean" ? (v ? "True" : "False") : String(v));
  const att = overall["x-nvidia-overall-att-result"];
  return {
    tool: "nvattest", status: "ok",
    result_code: Number.isInteger(doc.result_code) && typeof doc.result_code !== "boolean" ? doc.result_code : null,
    result_message: typeof doc.result_message === "string" ? doc.result_message : null,
    overall: typeof att === "boolean" ? att : null,
    measres: Object.fromEntries(Object.entries(gpus).map(([n, [, g]]) => [n, pyStr(g.measres)])),
    nonce_match: nonces.every((n) => n === nonce),
    consistent: digestsOk && claimsOk,
    signed: !(header.alg === "none" && Object.values(gpus).every(([h]) => h.alg === "none")),
    versions: Object.fromEntries(Object.entries(gpus).map(([n, [, g]]) => [n, [pyStr(g["x-nvidia-gpu-driver-version"]), pyStr(g["x-nvidia-gpu-vbios-version"])]])),
  };
}

const REPORT_DEFAULTS = { result_code: null, result_message: null, overall: null, measres: {}, nonce_match: null, consistent: null, signed: null, versions: {} };

function problems(info) {
  if (!info.present) return [info.nvidia_smi !== "ok" ? `no NVIDIA GPU visible (nvidia-smi ${info.nvidia_smi === "missing" ? "not installed" : "failed"})` : "nvidia-smi lists no GPU"];
  const out = [];
  if (info.cc_mode !== "on") out.push(`GPU confidential-compute mode is ${info.cc_mode}, not on`);
  if (![null, "ready"].includes(info.ready_state)) out.push(`GPU ready state is '${info.ready_state}'`);
  const r = info.nvidia_report;
  if (r && r.status !== "ok") out.push(`NVIDIA attestation ${r.status}`);
  else if (r) {
    if (!(r.result_code === 0 && r.overall === true && Object.values(r.measres).every((v) => v === "success"))) out.push("NVIDIA attestation did not succeed");
    if (!r.nonce_match) out.push("NVIDIA attestation report carries another nonce (not fresh for this run)");
    if (!r.consistent) out.push("NVIDIA attestation report is internally inconsistent");
    const key = (a) => a.join("\u0000");
    const smi = info.devices.map((d) => [d.driver_version, d.vbios_version.toLowerCase()]).map(key).sort();
    const rep = Object.values(r.versions).map((v) => [v[0], v[1].toLowerCase()]).map(key).sort();
    if (!jsonEqual(smi, rep)) out.push("NVIDIA report's driver/VBIOS versions differ from nvidia-smi's");
  }
  return out;
}

function describe(info) {
  if (!info.present) return `no GPU (nvidia-smi ${info.nvidia_smi})`;
  const names = [...new Set(info.devices.map((d) => d.name))].sort();
  const d0 = info.devices[0];
  let t = `${info.devices.length} x ${names.join(", ")} (driver ${d0.driver_version}, VBIOS ${d0.vbios_version}); CC mode ${info.cc_mode}`
    + (info.ready_state ? `, ${info.ready_state}` : "") + (info.cc_environment ? `, ${info.cc_environment}` : "");
  const r = info.nvidia_report;
  if (!r) t += "; no NVIDIA attestation report (nvattest not installed): the CC mode is nvidia-smi's word only (reported by the driver inside the CVM, unsigned)";
  else if (r.status !== "ok") t += `; NVIDIA attestation ${r.status}`;
  else {
    t += `; NVIDIA local verifier: overall ${r.overall === null ? "None" : r.overall ? "True" : "False"}, measres ${[...new Set(Object.values(r.measres))].sort().join(",")}`
      + (r.signed ? "" : " (unsigned local-mode EAT: self-reported, not checkable offline)");
  }
  return t;
}

function check(data, recorded, entries) {
  if (data === null) return ["fail", "gpu-evidence.json missing or unreadable"];
  let info;
  try { info = summarize(data); } catch (e) {
    if (e instanceof GpuEvidenceError) return ["fail", e.message];
    throw e;
  }
  const rec = { ...recorded, nvidia_report: recorded.nvidia_report && { ...REPORT_DEFAULTS, ...recorded.nvidia_report } };
  const mine = { ...info, nvidia_report: info.nvidia_report && { ...REPORT_DEFAULTS, ...info.nvidia_report } };
  if (!jsonEqual(mine, rec)) return ["fail", "the manifest's gpu summary is not what gpu-evidence.json says"];
  const ev = entries.filter((e) => e.type === "gpu.evidence");
  if (!ev.length) return ["fail", "no gpu.evidence audit entry"];
  const last = ev[ev.length - 1];
  if (last.data.evidence_sha256 !== info.evidence_sha256) return ["fail", "the last gpu.evidence audit entry commits to another gpu-evidence.json"];
  if (last.prev !== info.nonce) return ["fail", "the evidence nonce is not the audit chain head it was collected at (not fresh for this run)"];
  const r = info.nvidia_report;
  if (r && r.status === "ok" && !(r.consistent && r.nonce_match)) return ["fail", `the NVIDIA attestation report ${r.consistent ? "carries another nonce" : "is inconsistent"}`];
  const issues = problems(info);
  return ["pass", describe(info) + (issues.length ? `; NOT attested confidential GPUs: ${issues.join("; ")}` : "")];
}

/** [ok, what dstack measured] for the gpu-attestation boot event; null when there is none (attestation/tdx/gpu_dstack.py). */
function bootGpuAttestation(events) {
  const found = [];
  let ready = false;
  for (const ev of (events || []).filter((e) => e.imr === 3 && e.type === 0x08000001)) {
    if (ev.event === "system-ready") ready = true;
    else if (ev.event === "gpu-attestation") found.push([ev, ready]);
  }
  if (!found.length) return null;
  if (found.length > 1 || found[0][1]) return [false, `dstack GPU attestation event ${found.length > 1 ? "repeated" : "after system-ready"}: not dstack's`];
  let doc;
  try {
    doc = JSON.parse(utf8(found[0][0].payload));
    for (const k of ["devices", "cc_mode", "devtools", "evidence_sha256"]) if (!(k in doc)) throw new Error(`'${k}'`);
  } catch (e) { return [false, `dstack GPU attestation event is not the expected summary: ${e.message}`]; }
  const { devices, cc_mode: cc, devtools, evidence_sha256: digest } = doc;
  if (!(doc.provider === "nvidia" && Number.isInteger(devices) && typeof devices !== "boolean" && devices >= 1 && typeof digest === "string" && /^[0-9a-f]{64}$/.test(digest))) {
    return [false, "dstack GPU attestation event is not the expected summary"];
  }
  return [cc === "on" && devtools === false, `dstack measured a boot-time NVIDIA attestation: ${devices} GPU(s), CC ${cc}, DevTools ${devtools ? "on" : "off"}, nvattest output sha256 ${digest.slice(0, 16)}… (read from RTMR3; the report itself is not in the bundle)`];
}

export function gpuStep(f, data, m, events, entries) {
  const dstack = bootGpuAttestation(events);
  if (m.gpu == null) {
    if (dstack === null) f.add("gpu.evidence", "skip", "the manifest records no GPU evidence (bundle from before cvm-tune collected it)");
    else f.add("gpu.evidence", dstack[0] ? "pass" : "fail", dstack[1]);
    return;
  }
  let [status, detail] = check(data, m.gpu, Array.isArray(entries) ? entries : []);
  if (dstack !== null) [status, detail] = [dstack[0] ? status : "fail", `${detail}; ${dstack[1]}`];
  f.add("gpu.evidence", status, detail);
}

export { bootGpuAttestation, check as gpuCheck, summarize };

// ---- dstack 0.6 (attestation/tdx/gpu_dstack.py): gpu.policy, gpu.boot_evidence, the verdict's GPU status ----
const EMPTY_POLICY_HASH = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";

export function gpuPolicyStep(measuredHex, allowed) {
  const shown = measuredHex || "(absent: dstack 0.5.x measures none)";
  if (!allowed.length) return ["skip", `policy lists no gpu-policy-hash values (measured ${shown})`];
  const ok = measuredHex !== null && allowed.includes(measuredHex);
  return [ok ? "pass" : "fail", `gpu-policy-hash ${shown} ${ok ? "is" : "is not"} allowed` + (measuredHex === EMPTY_POLICY_HASH ? " (the empty GPU policy {})" : "")];
}

function attestationEvent(events) {
  const found = [];
  let ready = false;
  for (const ev of (events || []).filter((e) => e.imr === 3 && e.type === 0x08000001)) {
    if (ev.event === "system-ready") ready = true;
    else if (ev.event === "gpu-attestation") found.push([ev, ready]);
  }
  if (found.length !== 1 || found[0][1]) return null;
  try {
    const doc = JSON.parse(utf8(found[0][0].payload) ?? "");
    return doc && typeof doc === "object" && !Array.isArray(doc) ? doc : null;
  } catch { return null; }
}

export function bootEvidenceStep(events, data) {
  if (data === null || data === undefined) return ["skip", "no gpu-boot-evidence.json: dstack's boot-time GPU evidence is not in the bundle"];
  const doc = attestationEvent(events);
  const want = doc ? doc.evidence_sha256 : undefined;
  if (typeof want !== "string") return ["fail", "gpu-boot-evidence.json is in the bundle but RTMR3 has no single gpu-attestation event before system-ready to bind it"];
  const got = sha256hex(data);
  if (got !== want) return ["fail", `gpu-boot-evidence.json sha256 ${got.slice(0, 16)}… is not the measured evidence_sha256 ${want.slice(0, 16)}…`];
  const devices = doc.devices === undefined ? "None" : typeof doc.devices === "boolean" ? (doc.devices ? "True" : "False") : String(doc.devices);
  return ["pass", `gpu-boot-evidence.json is the nvattest output dstack's boot gate measured (${devices} GPU(s)): authenticated by RTMR3, a statement about the boot, not bound to this run's report_data`];
}

/** [status, reason] for the verdict's gpu member (gpu_status in Python). */
export function gpuStatus(events, gpuRecorded, checks) {
  const dstack = bootGpuAttestation(events);
  const status = Object.fromEntries(checks.map((c) => [c.name, c.status]));
  const failed = ["gpu.evidence", "gpu.boot_evidence", "gpu.policy"].filter((n) => status[n] === "fail");
  if (dstack !== null && dstack[0] && !failed.length) {
    return ["verified", "dstack's boot gate attested the GPU(s) with NVIDIA's verifier inside the TD and measured the result into RTMR3 (gpu-attestation)" +
      (status["gpu.boot_evidence"] === "pass" ? "; its boot-time evidence is in the bundle and matches" : "")];
  }
  if (dstack === null && !gpuRecorded) return ["none", "no GPU recorded"];
  if (failed.length) return ["not_verified", `GPU not verified: ${failed.join(", ")} failed`];
  if (dstack !== null) return ["not_verified", `GPU not verified: ${dstack[1]}`];
  return ["not_verified", "GPU not verified: RTMR3 has no dstack gpu-attestation event (dstack 0.5.x, or requirements.gpu_policy.attest_gpu false): the GPU facts are the CVM's own report, which nothing cryptographic checked"];
}
