// privacy.dp and privacy.policy (verifier-spec §10, attestation/privacy/dp.py): the DP block's parameters against
// the bundle's config, rows, steps and sample rate, every number bounded, then ε recomputed (epsilon.js: the rdp
// accountant's formulas, or the prv accountant's PLD) and compared with the recorded figure.
import { EPSILON_REL_TOL, epsilonAgrees, historyProblems, recomputeEpsilon } from "./epsilon.js";
import { formatG as g, jsonEqual, pyFloat, utf8 } from "./util.js";

const MAX_ROWS = 1e12, MAX_BATCH = 2 ** 32;
// What the page's prv figure is (docs/verifier.md, "Verify in a browser"): close to cvm-tune's, not bit for bit.
const PRV_NOTE = "; ε by the page's port of dp-accounting's PLD accountant: its normal CDF and FFT round differently from scipy's, so it agrees with cvm-tune verify's figure to about 1e-6 (relative), not bit for bit";
const isclose = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b));
const number = (v, lo, hi) => typeof v === "number" && Number.isFinite(v) && v >= lo && v <= hi;
const py = (v) => (v === undefined || v === null ? "None" : typeof v === "number" && !Number.isInteger(v) ? pyFloat(v) : typeof v === "string" ? `'${v}'` : JSON.stringify(v));

function configProblems(dp, config) {
  let p, batch;
  try {
    const training = JSON.parse(utf8(config)).training;
    p = training.privacy;
    batch = Math.trunc(Number(training.per_device_batch_size)) * Math.trunc(Number(training.gradient_accumulation_steps));
    if (!p || typeof p !== "object" || Array.isArray(p) || !Number.isFinite(batch)) throw new Error();
  } catch { return ["the bundle config has no readable training.privacy section"]; }
  const want = { mode: "dp-sgd", max_grad_norm: dp.max_grad_norm, accountant: dp.accountant, target_epsilon: dp.target_epsilon };
  if (!dp.noise_derived) want.noise_multiplier = dp.noise_multiplier;
  if (p.target_delta != null) want.target_delta = dp.delta;
  const out = Object.entries(want).filter(([k, v]) => !jsonEqual(p[k] ?? null, v)).map(([k, v]) => `${k} ${py(p[k])} in the bundle config, ${py(v)} in the manifest`);
  if (batch !== dp.expected_batch_size) out.push(`expected batch ${dp.expected_batch_size} is not the config's ${batch}`);
  return out;
}

/** The block's numbers out of range (checked before any arithmetic). */
function boundProblems(dp) {
  const problems = [];
  if (!number(dp.rows, 2, MAX_ROWS)) problems.push(`privacy rows ${String(dp.rows).slice(0, 20)} is outside [2, 1e+12]`);
  if (!number(dp.expected_batch_size, 1, MAX_BATCH)) problems.push(`expected batch ${String(dp.expected_batch_size).slice(0, 20)} is outside [1, ${MAX_BATCH}]`);
  for (const name of ["max_grad_norm", "epsilon", "target_epsilon"]) if (!Number.isFinite(dp[name])) problems.push(`${name} is not a finite number`);
  return [...problems, ...historyProblems(dp.accountant, [[dp.noise_multiplier, dp.sample_rate, dp.steps]], dp.delta)];
}

/** [problems, ε recomputed (Infinity when it cannot be)] of a run's privacy block. */
function runProblems(dp, m, config) {
  const bounds = boundProblems(dp);
  if (bounds.length) return [bounds, Infinity];
  const problems = configProblems(dp, config);
  if (dp.rows !== m.dataset.rows) problems.push(`privacy rows ${dp.rows} != dataset rows ${m.dataset.rows}`);
  if (dp.steps !== m.training.global_step) problems.push(`privacy steps ${dp.steps} != global_step ${m.training.global_step}`);
  if (!isclose(dp.sample_rate, dp.expected_batch_size / dp.rows)) problems.push(`sample rate ${g(dp.sample_rate)} != expected batch ${dp.expected_batch_size} / ${dp.rows} rows`);
  if (!(dp.delta < 1 / dp.rows)) problems.push(`delta ${g(dp.delta, 3)} is not below 1/N = 1/${dp.rows}`);
  let eps;
  try { eps = recomputeEpsilon(dp.accountant, [[dp.noise_multiplier, dp.sample_rate, dp.steps]], dp.delta); } catch (e) {
    problems.push(`epsilon cannot be recomputed from the block: ${e.message}`);
    return [problems, Infinity];
  }
  if (!epsilonAgrees(dp.accountant, eps, dp.epsilon)) problems.push(`recorded epsilon ${g(dp.epsilon)} is not what the ${dp.accountant} accountant gives for these parameters (${g(eps)})`);
  if (dp.epsilon > dp.target_epsilon * (1 + EPSILON_REL_TOL)) problems.push(`epsilon ${g(dp.epsilon, 4)} exceeds the run's target ${g(dp.target_epsilon)}`);
  return [problems, eps];
}

/** [problems, ε, δ, shown] of a training-API checkpoint's op_chain.dp. */
function apiProblems(chain) {
  const dp = chain.dp, sigma = dp.noise_multiplier, clip = dp.max_grad_norm, rec = dp.epsilon, q = dp.sample_rate, delta = dp.delta;
  const n = dp.dataset_size, b = dp.batch_size, steps = dp.steps, accountant = String(dp.accountant);
  if (![n, b, steps].every(Number.isInteger) || [sigma, clip, rec, q, delta].some((x) => typeof x !== "number")) {
    return [["op_chain.dp is incomplete or malformed"], Infinity, 0];
  }
  const problems = [];
  if (!(number(n, 2, MAX_ROWS) && number(b, 1, Math.min(n, MAX_BATCH)))) problems.push(`dataset_size ${n} / batch_size ${b} out of range`);
  else if (!isclose(q, b / n)) problems.push(`sample rate ${g(q)} != batch_size ${b} / dataset_size ${n}`);
  if (steps !== chain.optimizer_steps) problems.push(`DP steps ${steps} != the model's optimizer steps ${chain.optimizer_steps}`);
  if (!(Number.isFinite(clip) && clip > 0 && Number.isFinite(rec))) problems.push("max_grad_norm and epsilon must be finite (max_grad_norm > 0)");
  let eps = Infinity;
  if (!problems.length) {
    try {
      eps = recomputeEpsilon(accountant, steps ? [[sigma, q, steps]] : [], delta); // no step: none spent
      if (!epsilonAgrees(accountant, eps, rec)) problems.push(`recorded epsilon ${g(rec)} is not what the ${accountant} accountant gives for these parameters (${g(eps)})`);
    } catch (e) { problems.push(`epsilon cannot be recomputed from op_chain.dp: ${e.message}`); }
  }
  return [problems, eps, delta, () => `(ε, δ) = (${g(eps, 4)}, ${g(delta, 3)}) as served: DP-SGD per datum, sample rate `
    + `q=${g(q, 4)} (batch ${b} of ${n}, the client's Poisson sampling), clipping C=${g(clip)}, noise σ=${g(sigma, 4)}, `
    + `${steps} steps, ${accountant} accountant, recorded ε ${g(rec, 4)}`];
}

export function privacyStep(f, m, policy, config) {
  const bounded = policy.max_epsilon !== null || policy.max_delta !== null;
  const dp = m.privacy;
  let problems, eps, delta, shown, block;
  if (!dp && m.op_chain && m.op_chain.dp) {
    [problems, eps, delta, shown] = apiProblems(m.op_chain);
    block = "op_chain.dp";
  } else if (!dp) {
    f.add("privacy.dp", "skip", "trained without differential privacy (training.privacy off)");
    if (bounded) f.add("privacy.policy", "fail", `the policy requires differential privacy (max_epsilon ${policy.max_epsilon}, max_delta ${policy.max_delta}); this run trained without DP-SGD`);
    return;
  } else {
    [problems, eps] = runProblems(dp, m, config);
    [delta, block] = [dp.delta, "privacy block"];
    shown = () => `(ε, δ) = (${g(eps, 4)}, ${g(delta, 3)}) as run: DP-SGD, Poisson sampling q=${g(dp.sample_rate, 4)} of `
      + `N=${dp.rows} rows, clipping C=${g(dp.max_grad_norm)}, noise σ=${g(dp.noise_multiplier, 4)}, ${dp.steps} steps, `
      + `${dp.accountant} accountant, opacus ${dp.library.opacus} recorded ε ${g(dp.epsilon, 4)}`;
  }
  if (!Number.isFinite(eps)) { // out of range or not recomputable: nothing else is worth showing
    f.add("privacy.dp", "fail", problems.join("; "));
    if (bounded) f.add("privacy.policy", "fail", `epsilon cannot be recomputed from the bundle's ${block}`);
    return;
  }
  const accountant = dp ? dp.accountant : String(m.op_chain.dp.accountant);
  f.add("privacy.dp", problems.length ? "fail" : "pass", [...problems, shown()].join("; ") + (accountant === "prv" ? PRV_NOTE : ""));
  if (!bounded) return;
  const over = [];
  if (policy.max_epsilon !== null && eps > policy.max_epsilon) over.push(`epsilon ${g(eps, 4)} is above the policy's max_epsilon ${g(policy.max_epsilon)}`);
  if (policy.max_delta !== null && delta > policy.max_delta) over.push(`delta ${g(delta, 3)} is above the policy's max_delta ${g(policy.max_delta)}`);
  f.add("privacy.policy", over.length ? "fail" : "pass", over.join("; ") || `(ε, δ) = (${g(eps, 4)}, ${g(delta, 3)}) within the policy's max_epsilon ${policy.max_epsilon}, max_delta ${policy.max_delta}`);
}
