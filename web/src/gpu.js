// gpu.evidence (verifier-spec §12): gpu-evidence.json re-summarised must be the manifest's `gpu`, committed by the
// last gpu.evidence audit entry, its nonce that entry's prev. An NVIDIA (nvattest) report and dstack's boot-time GPU
// attestation event are not read by this page: such bundles get a check that says so.
import { NOT_IMPLEMENTED_GPU } from "./messages.js";
import { isObj, jsonEqual, sha256hex, utf8 } from "./util.js";

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

const lines = (t) => String(t).split(/\r\n|\r|\n/);

function fields(text) {
  const out = {};
  for (const line of lines(text)) {
    const at = line.indexOf(":");
    if (at < 0) continue;
    const label = line.slice(0, at).trim();
    if (label && !label.startsWith("=")) out[label.split(/\s+/).join(" ").toLowerCase()] = line.slice(at + 1).trim();
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
      if (!line.trim()) continue;
      const p = line.split(",").map((x) => x.trim());
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
    else return { unsupported: true };
  }
  return { present: devices.length > 0, nvidia_smi: smi, devices, cc_mode: mode, cc_environment: env, ready_state: ready,
    nvidia_report: report, nonce: doc.nonce, evidence_sha256: sha256hex(data) };
}

const REPORT_DEFAULTS = { result_code: null, result_message: null, overall: null, measres: {}, nonce_match: null, consistent: null, signed: null, versions: {} };

function problems(info) {
  if (!info.present) return [info.nvidia_smi !== "ok" ? `no NVIDIA GPU visible (nvidia-smi ${info.nvidia_smi === "missing" ? "not installed" : "failed"})` : "nvidia-smi lists no GPU"];
  const out = [];
  if (info.cc_mode !== "on") out.push(`GPU confidential-compute mode is ${info.cc_mode}, not on`);
  if (![null, "ready"].includes(info.ready_state)) out.push(`GPU ready state is '${info.ready_state}'`);
  if (info.nvidia_report) out.push(`NVIDIA attestation ${info.nvidia_report.status}`);
  return out;
}

function describe(info) {
  if (!info.present) return `no GPU (nvidia-smi ${info.nvidia_smi})`;
  const names = [...new Set(info.devices.map((d) => d.name))].sort();
  const d0 = info.devices[0];
  let t = `${info.devices.length} x ${names.join(", ")} (driver ${d0.driver_version}, VBIOS ${d0.vbios_version}); CC mode ${info.cc_mode}`
    + (info.ready_state ? `, ${info.ready_state}` : "") + (info.cc_environment ? `, ${info.cc_environment}` : "");
  if (!info.nvidia_report) t += "; no NVIDIA attestation report (nvattest not installed): the CC mode is nvidia-smi's word only (reported by the driver inside the CVM, unsigned)";
  else t += `; NVIDIA attestation ${info.nvidia_report.status}`;
  return t;
}

function check(data, recorded, entries) {
  if (data === null) return ["fail", "gpu-evidence.json missing or unreadable"];
  let info;
  try { info = summarize(data); } catch (e) {
    if (e instanceof GpuEvidenceError) return ["fail", e.message];
    throw e;
  }
  if (info.unsupported) return ["skip", NOT_IMPLEMENTED_GPU];
  const rec = { ...recorded, nvidia_report: recorded.nvidia_report && { ...REPORT_DEFAULTS, ...recorded.nvidia_report } };
  const mine = { ...info, nvidia_report: info.nvidia_report && { ...REPORT_DEFAULTS, ...info.nvidia_report } };
  if (!jsonEqual(mine, rec)) return ["fail", "the manifest's gpu summary is not what gpu-evidence.json says"];
  const ev = entries.filter((e) => e.type === "gpu.evidence");
  if (!ev.length) return ["fail", "no gpu.evidence audit entry"];
  const last = ev[ev.length - 1];
  if (last.data.evidence_sha256 !== info.evidence_sha256) return ["fail", "the last gpu.evidence audit entry commits to another gpu-evidence.json"];
  if (last.prev !== info.nonce) return ["fail", "the evidence nonce is not the audit chain head it was collected at (not fresh for this run)"];
  const issues = problems(info);
  return ["pass", describe(info) + (issues.length ? `; NOT attested confidential GPUs: ${issues.join("; ")}` : "")];
}

export function gpuStep(f, data, m, events, entries) {
  const dstack = (events || []).some((e) => e.imr === 3 && e.type === 0x08000001 && e.event === "gpu-attestation");
  if (dstack) { f.add("gpu.evidence", "skip", NOT_IMPLEMENTED_GPU); return; }
  if (m.gpu == null) { f.add("gpu.evidence", "skip", "the manifest records no GPU evidence (bundle from before cvm-tune collected it)"); return; }
  f.add("gpu.evidence", ...check(data, m.gpu, Array.isArray(entries) ? entries : []));
}
