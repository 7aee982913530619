// ε recomputed from [(σ, q, T)] at δ, with the bounds checked first and the comparison with the recorded figure,
// exactly as attestation/privacy/dp.py (history_problems, recompute_epsilon, epsilon_agrees) and epsilon.py
// (prv_half_width, pld_epsilon) do: `rdp` with rdp.js, `prv` with pld.js (verifier-spec §10).
import { pldEpsilon } from "./pld.js";
import { rdpEpsilon } from "./rdp.js";
import { formatG, pyFloat } from "./util.js";

const NOISE_MIN = 0.01, NOISE_MAX = 1e6, MAX_STEPS = 10_000_000, PRV_MAX_STEPS = 100_000;
const PRV_MAX_POINTS = 1 << 22; // Opacus' PRV mesh
const PLD_INTERVAL = 1e-4, PLD_MAX_POINTS = 1 << 21;
const PRV_ABS_TOL = 0.03, PRV_REL_TOL = 0.005, EPSILON_REL_TOL = 1e-6;

const rdp = (history, delta) => rdpEpsilon(history, delta) ?? Infinity; // all orders NaN: Python's inf
const repr = (x) => (typeof x === "number" && Number.isFinite(x) ? pyFloat(x) : String(x)).slice(0, 20);
const number = (v, lo, hi) => typeof v === "number" && Number.isFinite(v) && v >= lo && v <= hi;

/** Half-width L of the privacy-loss domain (Opacus' compute_safe_domain_size, from RDP bounds). */
function prvHalfWidth(history, deltaError, epsError) {
  const total = history.reduce((n, h) => n + h[2], 0);
  let half = rdp(history, deltaError / 4);
  for (const [sigma, q] of history) half = Math.max(half, rdp([[sigma, q, 1]], deltaError / (8 * total)));
  return Math.max(half, epsError) + 3;
}

/** Points of the mesh Opacus' PRV accountant discretises at its default error bounds. */
function prvMeshPoints(history, delta) {
  const deltaError = delta / 1000, epsError = 0.01;
  const total = history.reduce((n, h) => n + h[2], 0);
  return (2 * prvHalfWidth(history, deltaError, epsError)) / (epsError / Math.sqrt((total * Math.log(12 / deltaError)) / 2)) + 1;
}

/** Why the accountant must not be run on `history` at `delta` (empty: it may). */
export function historyProblems(accountant, history, delta) {
  if (accountant !== "rdp" && accountant !== "prv") return [`accountant '${String(accountant).slice(0, 20)}' is not rdp or prv`];
  const problems = number(delta, 0, 1) && delta > 0 && delta < 1 ? [] : ["delta is not a number between 0 and 1"];
  const maxSteps = accountant === "prv" ? PRV_MAX_STEPS : MAX_STEPS;
  for (const [sigma, q, steps] of history) {
    if (!number(sigma, NOISE_MIN, NOISE_MAX)) problems.push(`noise multiplier ${repr(sigma)} is outside [0.01, 1e+06]`);
    if (!(number(q, 0, 1) && q > 0)) problems.push(`sample rate ${repr(q)} is outside (0, 1]`);
    if (!(Number.isInteger(steps) && steps >= 0 && steps <= maxSteps)) problems.push(`${String(steps).slice(0, 20)} steps is outside [0, ${maxSteps}] for the ${accountant} accountant`);
  }
  if (problems.length || accountant !== "prv" || !history.some((h) => h[2])) return problems;
  const points = prvMeshPoints(history.filter((h) => h[2]), delta);
  if (!(points <= PRV_MAX_POINTS)) {
    problems.push(`the prv accountant would discretise ${formatG(points, 3)} points for these parameters (at most ${PRV_MAX_POINTS}): use the rdp accountant`);
  }
  return problems;
}

/** ε at δ of `history` [[σ, q, T]]; throws an Error saying why it cannot be recomputed. */
export function recomputeEpsilon(accountant, history, delta) {
  if (!history.length) return 0;
  const problems = historyProblems(accountant, history, delta);
  if (problems.length) throw new Error(problems.join("; "));
  let eps;
  try {
    eps = accountant === "rdp" ? rdp(history, delta) : pldHistory(history, delta);
  } catch (e) {
    throw new Error(`the ${accountant} accountant cannot compute epsilon: ${String(e.message).slice(0, 200)}`);
  }
  if (Number.isNaN(eps)) throw new Error(`the ${accountant} accountant computed no epsilon (NaN)`);
  return eps;
}

/** pld_epsilon: dp-accounting's PLD accountant at the interval that bounds its size. */
function pldHistory(history, delta) {
  history = history.filter((h) => h[2]);
  if (!history.length) return 0;
  if (history.length > 1) throw new Error("one (σ, q, T) entry only"); // a bundle records one
  const width = 2 * prvHalfWidth(history, delta / 1000, 0.01);
  const [sigma, q, steps] = history[0];
  return pldEpsilon(sigma, q, steps, delta, Math.max(PLD_INTERVAL, width / PLD_MAX_POINTS));
}

/** The recorded (Opacus) ε is the recomputed one: to float noise for rdp, within 0.03 + 0.5 % for prv. */
export function epsilonAgrees(accountant, recomputed, recorded) {
  if (accountant === "prv") return Math.abs(recomputed - recorded) <= PRV_ABS_TOL + PRV_REL_TOL * Math.max(recomputed, recorded);
  if (recomputed === recorded) return true;
  return Math.abs(recomputed - recorded) <= Math.max(EPSILON_REL_TOL * Math.max(Math.abs(recomputed), Math.abs(recorded)), 1e-9);
}

export { EPSILON_REL_TOL };
