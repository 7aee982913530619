// Rendering: the verdict at a glance, every check with its reason, and what the bundle says about its run.
import { isObj, utf8 } from "./util.js";

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) if (k != null) e.append(k);
  return e;
}

const WORDS = { accepted: "ACCEPTED", rejected: "REJECTED", incomplete: "NOT ACCEPTED: INCOMPLETE" };

function lossCurve(points) {
  if (!Array.isArray(points) || points.length < 1) return null;
  const W = 480, H = 160, P = 28;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (x) => P + ((x - x0) / (x1 - x0 || 1)) * (W - 2 * P), sy = (y) => H - P - ((y - y0) / (y1 - y0 || 1)) * (H - 2 * P);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "curve");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "training loss by step");
  const path = document.createElementNS(ns, "polyline");
  path.setAttribute("points", points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
  svg.append(path);
  for (const [x, y, text] of [[P, H - 8, `step ${x0}`], [W - P, H - 8, `step ${x1}`], [2, P - 10, `loss ${y1.toPrecision(4)}`], [2, H - P + 4, `${y0.toPrecision(4)}`]]) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x); t.setAttribute("y", y);
    if (x === W - P) t.setAttribute("text-anchor", "end");
    t.textContent = text;
    svg.append(t);
  }
  return svg;
}

/** What a round manifest says the round did (read, not checked: the checks above say whether to believe it). */
function roundSummary(r) {
  if (!isObj(r)) return el("p", {}, "The round manifest could not be read.");
  const rows = [];
  const add = (k, v) => { if (v !== undefined && v !== null && v !== "") rows.push(el("tr", {}, el("th", {}, k), el("td", {}, String(v)))); };
  const admitted = Array.isArray(r.admitted) ? r.admitted : [], rejected = Array.isArray(r.rejected) ? r.rejected : [];
  const strategy = isObj(r.strategy) ? r.strategy.name : "?";
  add("round", `${r.round} of federation ${r.federation_id}`);
  add("created", r.created_at);
  add("admitted", `${admitted.length}` + (admitted.length ? `: ${admitted.map((a) => `${a.client} (${a.trainable_tokens} tokens, weight ${Number(a.weight).toFixed(3)})`).join(", ")}` : ""));
  add("rejected", `${rejected.length}` + (rejected.length ? `: ${rejected.map((x) => `${x.client || "?"}: ${x.reason}`).join("; ")}` : ""));
  let adapter = `global adapter sha256 ${String(r.global_adapter_sha256).slice(0, 16)}…`;
  if (isObj(r.confidentiality)) adapter += `, stored as age ciphertext to ${(r.confidentiality.recipients || []).length} recipient(s) (secure aggregation)`;
  add("aggregate", `${strategy} of ${admitted.length} update(s) weighted by trainable tokens; ${adapter}`);
  if (r.previous_round_sha256) add("previous round", `round-manifest.json sha256 ${r.previous_round_sha256}`);
  add("TEE", r.tee && `${r.tee.mode}, app-id ${r.tee.app_id}`);
  return el("div", {}, el("table", { class: "kv", id: "round-summary" }, ...rows));
}

function summary(bundle) {
  if (bundle.files.has("round-manifest.json")) {
    let r = null;
    try { r = JSON.parse(utf8(bundle.files.get("round-manifest.json"))); } catch { r = null; }
    return roundSummary(r);
  }
  let m = null, report = null;
  try { m = JSON.parse(utf8(bundle.files.get("manifest.json"))); } catch { m = null; }
  try { report = JSON.parse(utf8(bundle.files.get("report/report.json"))); } catch { report = null; }
  if (!isObj(m)) return el("p", {}, "The manifest could not be read.");
  const rows = [];
  const add = (k, v) => { if (v !== undefined && v !== null && v !== "") rows.push(el("tr", {}, el("th", {}, k), el("td", {}, String(v)))); };
  const t = m.training || {}, d = m.dataset || {}, bm = m.base_model || {};
  add("run", m.run_id);
  add("created", m.created_at);
  add("base model", bm.hub_id || bm.name);
  add("dataset", d.dataset_id !== undefined ? `${d.dataset_id} v${d.dataset_version} (${d.rows} rows)` : null);
  add("objective", t.objective || "sft");
  add("steps", t.global_step);
  if (m.lineage) add("continued from", m.lineage.parent_run_id);
  if (m.evaluation) add("promotion", `${m.evaluation.promote ? "promoted" : "not promoted"} (${m.evaluation.metric} ${m.evaluation.candidate_loss} vs ${m.evaluation.parent_loss})`);
  if (m.privacy) add("differential privacy", `ε = ${m.privacy.epsilon} at δ = ${m.privacy.delta} (${m.privacy.accountant}, as recorded)`);
  if (m.op_chain) add("training API", `${m.op_chain.ops} ops, ${m.op_chain.optimizer_steps} optimizer steps, ${m.op_chain.checkpoint}`);
  if (m.op_chain && isObj(m.op_chain.dp)) add("differential privacy", `ε = ${m.op_chain.dp.epsilon} at δ = ${m.op_chain.dp.delta} (as recorded)`);
  const au = isObj(m.audit) ? m.audit : {};
  add("audit chain", au.entries === undefined ? null : `${au.entries} entries, ${au.rtmr3 === "emit_event" ? "measured into RTMR3"
    : au.anchors != null ? `${au.anchors} anchor quote(s) in audit-anchors.jsonl` : "not anchored (bound by the export's quote)"}`);
  if (m.confidentiality) add("recipients", (m.confidentiality.recipients || []).join(" "));
  if (m.federation) add("federated round", m.federation.round);
  add("TEE", m.tee && `${m.tee.mode}, app-id ${m.tee.app_id}`);
  const losses = (report && report.losses) || t.losses;
  const box = el("div", {}, el("table", { class: "kv" }, ...rows));
  const curve = lossCurve(losses);
  if (curve) box.append(el("h3", {}, "Training loss (from the bundle's run report)"), curve);
  return box;
}

export function render(v, { bundle, bundleName, policyName, opsName, ms }) {
  const out = $("result");
  out.replaceChildren();
  const failed = v.checks.filter((c) => c.status === "fail");
  const gpuUnverified = v.gpu && v.gpu.status === "not_verified";
  const head = el("section", { class: `verdict ${v.verdict}${gpuUnverified && v.verdict === "accepted" ? " gpu-unverified" : ""}`, id: "verdict" },
    el("h2", {}, `${WORDS[v.verdict]}${gpuUnverified && v.verdict === "accepted" ? " — GPU NOT VERIFIED" : ""} under policy '${v.policy}'`),
    el("p", {}, `${bundleName}${opsName ? ` with ops ${opsName}` : ""}; policy ${policyName || "built-in default"}; checked in ${(ms / 1000).toFixed(2)} s at ${new Date(v.now * 1000).toISOString()}`));
  if (gpuUnverified) head.append(el("p", { class: "warn", id: "gpu-warning" }, v.gpu.reason + "."));
  if (v.test_root) head.append(el("p", { class: "warn", id: "test-root-warning" }, "Quote signed by a TEST CA (the cvm-tune simulator): this is NOT evidence of a real TEE."));
  if (failed.length) head.append(el("p", {}, "Failed:"), el("ul", { id: "failed" }, ...failed.map((c) => el("li", {}, el("code", {}, c.name), ": ", c.reason))));
  if (v.not_checked) head.append(el("p", { class: "warn" }, `Not checked by this page: ${v.not_checked.join(", ")}. Run cvm-tune verify for a verdict.`));
  out.append(head);
  const table = el("table", { class: "checks", id: "checks" }, el("tr", {}, el("th", {}, "check"), el("th", {}, "status"), el("th", {}, "reason")));
  for (const c of v.checks) table.append(el("tr", { class: c.status, "data-check": c.name }, el("td", {}, el("code", {}, c.name)), el("td", { class: "status" }, c.status), el("td", {}, c.reason)));
  out.append(el("section", {}, el("h2", {}, "Checks"), table));
  out.append(el("section", {}, el("h2", {}, bundle.files.has("round-manifest.json") ? "What the round says" : "What the bundle says"), summary(bundle)));
}

export function renderError(message) {
  $("result").replaceChildren(el("section", { class: "verdict error", id: "verdict" }, el("h2", {}, "Cannot verify"), el("p", {}, message)));
}
