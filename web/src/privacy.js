// privacy.dp and privacy.policy (verifier-spec §10). The block's parameters are checked against the bundle's config,
// rows, steps and sample rate; ε is recomputed for the rdp accountant (rdp.js). The prv accountant (dp-accounting's
// PLD) is not in this page: such a bundle gets a check that says so, never a pass.
import { NOT_IMPLEMENTED } from "./messages.js";
import { rdpEpsilon } from "./rdp.js";
import { jsonEqual, utf8 } from "./util.js";

const REL = 1e-6;
const close = (a, b, rel = 1e-9, abs = 0) => Math.abs(a - b) <= Math.max(rel * Math.max(Math.abs(a), Math.abs(b)), abs);
const g = (x) => String(Number(x.toPrecision(6)));

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
  const out = Object.entries(want).filter(([k, v]) => !jsonEqual(p[k] ?? null, v)).map(([k, v]) => `${k} ${JSON.stringify(p[k] ?? null)} in the bundle config, ${JSON.stringify(v)} in the manifest`);
  if (batch !== dp.expected_batch_size) out.push(`expected batch ${dp.expected_batch_size} is not the config's ${batch}`);
  return out;
}

/** [(σ, q, T), δ, recorded ε, problems, how shown] of the DP block a bundle carries, or null without DP. */
function block(m, config) {
  const dp = m.privacy;
  if (dp) {
    const problems = [];
    if (!(dp.rows >= 2 && dp.rows <= 1e12)) problems.push(`privacy rows ${dp.rows} is outside [2, 1e+12]`);
    if (!(dp.noise_multiplier >= 0.01 && dp.noise_multiplier <= 1e6 && dp.steps <= 1e7)) problems.push("noise multiplier or steps out of range");
    if (problems.length) return { problems, bounded: true };
    problems.push(...configProblems(dp, config));
    if (dp.rows !== m.dataset.rows) problems.push(`privacy rows ${dp.rows} != dataset rows ${m.dataset.rows}`);
    if (dp.steps !== m.training.global_step) problems.push(`privacy steps ${dp.steps} != global_step ${m.training.global_step}`);
    if (!close(dp.sample_rate, dp.expected_batch_size / dp.rows)) problems.push(`sample rate ${g(dp.sample_rate)} != expected batch ${dp.expected_batch_size} / ${dp.rows} rows`);
    if (!(dp.delta < 1 / dp.rows)) problems.push(`delta ${dp.delta} is not below 1/N = 1/${dp.rows}`);
    if (dp.epsilon > dp.target_epsilon * (1 + REL)) problems.push(`epsilon ${dp.epsilon} exceeds the run's target ${dp.target_epsilon}`);
    return { sigma: dp.noise_multiplier, q: dp.sample_rate, steps: dp.steps, delta: dp.delta, eps: dp.epsilon, accountant: dp.accountant, problems };
  }
  const dp2 = m.op_chain && m.op_chain.dp;
  if (!dp2) return null;
  const n = dp2.dataset_size, b = dp2.batch_size, steps = dp2.steps;
  if (![n, b, steps].every(Number.isInteger) || [dp2.noise_multiplier, dp2.max_grad_norm, dp2.epsilon, dp2.sample_rate, dp2.delta].some((x) => typeof x !== "number")) {
    return { problems: ["op_chain.dp is incomplete or malformed"], bounded: true };
  }
  const problems = [];
  if (!(n >= 2 && n <= 1e12 && b >= 1 && b <= Math.min(n, 2 ** 32))) problems.push(`dataset_size ${n} / batch_size ${b} out of range`);
  else if (!close(dp2.sample_rate, b / n)) problems.push(`sample rate ${g(dp2.sample_rate)} != batch_size ${b} / dataset_size ${n}`);
  if (steps !== m.op_chain.optimizer_steps) problems.push(`DP steps ${steps} != the model's optimizer steps ${m.op_chain.optimizer_steps}`);
  if (!(dp2.max_grad_norm > 0)) problems.push("max_grad_norm and epsilon must be finite (max_grad_norm > 0)");
  return { sigma: dp2.noise_multiplier, q: dp2.sample_rate, steps, delta: dp2.delta, eps: dp2.epsilon, accountant: String(dp2.accountant), problems, bounded: problems.length > 0 };
}

export function privacyStep(f, m, policy, config) {
  const bounded = policy.max_epsilon !== null || policy.max_delta !== null;
  const d = block(m, config);
  if (!d) {
    f.add("privacy.dp", "skip", "trained without differential privacy (training.privacy off)");
    if (bounded) f.add("privacy.policy", "fail", `the policy requires differential privacy (max_epsilon ${policy.max_epsilon}, max_delta ${policy.max_delta}); this run trained without DP-SGD`);
    return;
  }
  if (d.bounded) {
    f.add("privacy.dp", "fail", d.problems.join("; "));
    if (bounded) f.add("privacy.policy", "fail", "epsilon cannot be recomputed from the bundle's privacy block");
    return;
  }
  let eps = null;
  if (d.accountant === "rdp") eps = rdpEpsilon([[d.sigma, d.q, d.steps]], d.delta);
  if (eps === null) {
    const why = `${NOT_IMPLEMENTED}: ε is not recomputed for the ${d.accountant} accountant (dp-accounting's PLD); \`cvm-tune verify\` recomputes it`;
    f.add("privacy.dp", d.problems.length ? "fail" : "skip", [...d.problems, why].join("; "));
    if (bounded) f.add("privacy.policy", "skip", why);
    return;
  }
  if (!close(eps, d.eps, REL, 1e-9)) d.problems.push(`recorded epsilon ${g(d.eps)} is not what the rdp accountant gives for these parameters (${g(eps)})`);
  const shown = `(ε, δ) = (${eps.toPrecision(4)}, ${d.delta.toPrecision(3)}) recomputed (rdp accountant): q=${d.q.toPrecision(4)}, σ=${d.sigma.toPrecision(4)}, ${d.steps} steps, recorded ε ${d.eps.toPrecision(4)}`;
  f.add("privacy.dp", d.problems.length ? "fail" : "pass", [...d.problems, shown].join("; "));
  if (!bounded) return;
  const over = [];
  if (policy.max_epsilon !== null && eps > policy.max_epsilon) over.push(`epsilon ${eps.toPrecision(4)} is above the policy's max_epsilon ${policy.max_epsilon}`);
  if (policy.max_delta !== null && d.delta > policy.max_delta) over.push(`delta ${d.delta.toPrecision(3)} is above the policy's max_delta ${policy.max_delta}`);
  f.add("privacy.policy", over.length ? "fail" : "pass", over.join("; ") || `(ε, δ) = (${eps.toPrecision(4)}, ${d.delta.toPrecision(3)}) within the policy's max_epsilon ${policy.max_epsilon}, max_delta ${policy.max_delta}`);
}
