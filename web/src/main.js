// The page: take a bundle or a federated round bundle (drop, pick, or ?bundle=URL), a policy and an ops file;
// verify; show the verdict.
// Nothing leaves the browser: the only requests are same-origin fetches of the URLs named in the address.
import { ArchiveError, fromArchive, fromDirectoryEntry, fromFileList } from "./archive.js";
import { verifyBundle } from "./bundle.js";
import { notImplemented } from "./messages.js";
import { PolicyError, loadPolicy } from "./policy.js";
import { hex, isoUtc, utf8 } from "./util.js";
import { verifyRound } from "./rounds.js";
import { render, renderError } from "./view.js";

const VERSION = "0.1.0";
const state = { bundle: null, bundleName: null, policyText: null, policyName: null, policyUsed: null, ops: null, opsName: null };
const DEFAULT_POLICY = "the built-in default (Intel's root only)";
// What a URL load from file:// says instead of the browser's bare "Failed to fetch".
export const FILE_URL_HELP = "this page was opened from a file (file://), and a browser does not let such a page fetch the " +
  "?bundle= / ?policy= / ?ops= files: serve the page over http(s) (cvm-tune bundles serve, or any static server with " +
  "the page and the files on one origin), or drop the bundle folder or archive and the policy file onto the page";
const $ = (id) => document.getElementById(id);

/** The cvm-tune/verdict/v1 JSON of findings (docs/verifier.md, "--json"), plus what the page could not check. */
export function verdictJson(f, policy, now) {
  const td = f.quote && f.quote.td;
  const failed = f.checks.some((c) => c.status === "fail");
  const missing = f.checks.filter(notImplemented);
  const out = {
    schema: "cvm-tune/verdict/v1",
    verdict: failed ? "rejected" : missing.length ? "incomplete" : "accepted",
    policy: policy.name, test_root: policy.testRoot, now,
    checks: f.checks.map((c) => ({ name: c.name, status: c.status, reason: c.reason })),
    tcb_status: f.tcbStatus ?? null, advisory_ids: f.advisoryIds ?? [],
    measurements: td ? { mrtd: hex(td.mr_td), rtmr0: hex(td.rt_mr0), rtmr1: hex(td.rt_mr1), rtmr2: hex(td.rt_mr2), rtmr3: hex(td.rt_mr3), mr_config_id: hex(td.mr_config_id), report_data: hex(td.report_data) } : null,
    replayed_rtmrs: f.replayed ? f.replayed.map(hex) : null,
    compose_hash: f.boot ? f.boot.hex("compose-hash") : null,
    app_id: f.boot ? f.boot.hex("app-id") : null,
    quote_hex: f.quote ? hex(f.quote.raw) : null,
    tcb_date: f.tcbDate != null ? isoUtc(f.tcbDate) : null,
    collateral: f.collateral ? { not_before: isoUtc(f.collateral.notBefore), not_after: isoUtc(f.collateral.notAfter), tcb_evaluation_data_number: f.tcbNumber ?? null } : null,
    bundle: f.bundle ?? null,
    gpu: f.gpu ? { status: f.gpu[0], reason: f.gpu[1] } : null,
    verifier: { cvm_tune_web: VERSION, dcap_qvl: "@phala/dcap-qvl 0.3.9" },
  };
  if (missing.length) out.not_checked = missing.map((c) => c.name);
  return out;
}

async function fetchBytes(url) {
  const u = new URL(url, location.href);
  if (u.origin !== location.origin) throw new Error(`${url} is not on this page's origin: the page fetches same-origin files only`);
  const r = await fetch(u, { credentials: "same-origin", redirect: "error" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

async function run() {
  const t0 = performance.now();
  document.body.dataset.verdict = "running";
  let policy;
  try { policy = loadPolicy(state.policyText); } catch (e) {
    if (e instanceof PolicyError) return fail(`policy ${state.policyName}: ${e.message}`);
    throw e;
  }
  state.policyUsed = policyLabel(state.policyName, policy.name);
  showInputs();
  const params = new URLSearchParams(location.search);
  const now = params.has("now") ? Number(params.get("now")) : Math.floor(Date.now() / 1000);
  const round = state.bundle.files.has("round-manifest.json");
  if (!round && !state.bundle.files.has("manifest.json")) return fail(`${state.bundleName} has no manifest.json: not a cvm-tune export bundle`);
  if (round && state.ops) return fail("an ops record checks a training-API checkpoint, not a federated round bundle");
  let f;
  try { f = round ? await verifyRound(state.bundle, { policy, now }) : await verifyBundle(state.bundle, { policy, now, ops: state.ops }); } catch (e) {
    return fail(`the page could not finish verifying (no verdict): ${e && e.message}`);
  }
  const verdict = verdictJson(f, policy, now);
  const ms = performance.now() - t0;
  render(verdict, { bundle: state.bundle, bundleName: state.bundleName, policyName: state.policyUsed, opsName: state.opsName, ms });
  $("verdict-json").textContent = JSON.stringify(verdict, null, 2);
  document.body.dataset.verifyMs = ms.toFixed(1);  // verification alone
  document.body.dataset.loadedMs = performance.now().toFixed(1);  // since the page was opened: fetch, unpack, verify
  document.body.dataset.verdict = verdict.verdict;
}

function fail(message) {
  renderError(message);
  $("verdict-json").textContent = JSON.stringify({ schema: "cvm-tune/verdict/v1", verdict: "error", error: message }, null, 2);
  document.body.dataset.verdict = "error";
}

/** The policy line: the file the policy came from (none: the built-in default) and the name it gives itself. */
export function policyLabel(source, name) {
  if (!source) return `${DEFAULT_POLICY}: '${name}'`;
  return name ? `${source} ('${name}')` : source;
}

async function fromUrl(params) {
  if (location.protocol === "file:") return fail(`cannot load ${params.get("bundle")}: ${FILE_URL_HELP}`);
  try {
    const url = params.get("bundle");
    state.bundle = await fromArchive(await fetchBytes(url));
    state.bundleName = url;
    if (params.get("policy")) { state.policyText = utf8(await fetchBytes(params.get("policy"))); state.policyName = params.get("policy"); }
    if (params.get("ops")) { state.ops = await fetchBytes(params.get("ops")); state.opsName = params.get("ops"); }
  } catch (e) {
    return fail(e instanceof ArchiveError ? `${params.get("bundle")}: ${e.message}` : e.message);
  }
  showInputs();
  await run();
}

async function takeFile(file) {
  const name = file.name.toLowerCase();
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (/\.(ya?ml)$/.test(name)) { state.policyText = utf8(bytes); state.policyName = file.name; state.policyUsed = null; }
  else if (name.endsWith(".jsonl")) { state.ops = bytes; state.opsName = file.name; }
  else { state.bundle = await fromArchive(bytes); state.bundleName = file.name; }
}

async function onDrop(ev) {
  ev.preventDefault();
  $("drop").classList.remove("over");
  try {
    const items = [...ev.dataTransfer.items].map((i) => [i.webkitGetAsEntry && i.webkitGetAsEntry(), i.getAsFile()]);
    for (const [entry, file] of items) {
      if (entry && entry.isDirectory) { state.bundle = await fromDirectoryEntry(entry); state.bundleName = entry.name + "/"; }
      else if (file) await takeFile(file);
    }
  } catch (e) { return fail(e.message); }
  showInputs();
  if (state.bundle) await run();
}

function showInputs() {
  $("in-bundle").textContent = state.bundleName || "none yet";
  $("in-policy").textContent = state.policyUsed || state.policyName || DEFAULT_POLICY;
  $("in-ops").textContent = state.opsName || "none";
}

function wire() {
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", onDrop);
  for (const id of ["pick-archive", "pick-policy", "pick-ops"]) {
    $(id).addEventListener("change", async (e) => {
      try { for (const file of e.target.files) await takeFile(file); } catch (err) { return fail(err.message); }
      showInputs();
      if (state.bundle) await run();
    });
  }
  $("pick-folder").addEventListener("change", async (e) => {
    try { state.bundle = await fromFileList(e.target.files); } catch (err) { return fail(err.message); }
    state.bundleName = (e.target.files[0] && e.target.files[0].webkitRelativePath.split("/")[0] + "/") || "folder";
    showInputs();
    await run();
  });
  showInputs();
  const params = new URLSearchParams(location.search);
  if (params.get("bundle")) fromUrl(params).catch((e) => fail(String(e && e.stack || e)));
  else document.body.dataset.verdict = "waiting";
}

wire();
