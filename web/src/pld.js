// ε of DP-SGD under the `prv` accountant, as the Python verifier recomputes it (attestation/privacy/epsilon.py,
// pld_epsilon): dp-accounting 0.6's PLDAccountant (add/remove one row, pessimistic connect-the-dots) composing
// SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T), get_epsilon(δ). Ported step by step from
// dp_accounting.pld (privacy_loss_mechanism.GaussianPrivacyLoss, privacy_loss_distribution.from_gaussian_mechanism,
// pld_pmf's sparse and dense PMFs, common.self_convolve); what differs is float rounding only: Φ (normal.js), the FFT
// (fft.js) and composing with the identity PLD, a convolution with [1] that dp-accounting does by FFT and this port
// leaves out (it changes nothing but the last bits).
import { selfConvolve } from "./fft.js";
import { logNdtr, ndtr, ndtri } from "./normal.js";

const SPARSE_MAX = 1000; // pld_pmf._MAX_PMF_SPARSE_SIZE
const TAIL = 1e-15; // the tail mass every composition may truncate
const isclose = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b));

function logAdd(a, b) { const mn = Math.min(a, b), mx = Math.max(a, b); return mx + Math.log1p(Math.exp(mn - mx)); }
function logSub(a, b) {
  if (b >= a) throw new RangeError(`a must be greater than b. Got a=${a} and b=${b}.`);
  return a + Math.log1p(-Math.exp(b - a));
}

/** log(a e^b + c) (common.log_a_times_exp_b_plus_c). */
function logAExpBPlusC(a, b, c) {
  if (a === 0) return Math.log(c);
  if (a < 0) {
    if (c <= 0) throw new RangeError(`a exp(b) + c must be positive: ${a}, ${b}, ${c}.`);
    return logSub(Math.log(c), Math.log(-a) + b);
  }
  if (b === 0) return Math.log(a + c);
  const d = b + Math.log(a);
  if (c === 0) return d;
  return c < 0 ? logSub(d, Math.log(-c)) : logAdd(d, Math.log(c));
}

const logAddExp = (x, y) => (x === y ? x + Math.LN2 : x > y ? x + Math.log1p(Math.exp(y - x)) : y + Math.log1p(Math.exp(x - y)));

/** GaussianPrivacyLoss(σ, sensitivity 1, sampling q, ADD or REMOVE): privacy loss, its inverse, and δ(ε). */
function gaussianLoss(sigma, q, add) {
  const s2 = sigma ** 2;
  const removeLoss = (x) => { const l = (-0.5 - x) / s2; return q === 1 ? l : logAExpBPlusC(q, l, 1 - q); };
  const loss = (x) => (add ? -removeLoss(-x) : removeLoss(x));
  const inverseRemove = (l) => -0.5 - (l * s2) / 1;
  function inverse(l) {
    if (add) {
      if (q === 1) return 1 + inverseRemove(l);
      if (isclose(l, -Math.log(1 - q))) return 1 + inverseRemove(Infinity);
      if (l > -Math.log(1 - q)) throw new RangeError(`privacy_loss (${l}) is larger than -log(1 - sampling_prob)`);
      return 1 + inverseRemove(-logAExpBPlusC(1 / q, -l, 1 - 1 / q));
    }
    if (q === 1) return inverseRemove(l);
    if (isclose(l, Math.log(1 - q))) return inverseRemove(-Infinity);
    if (l <= Math.log(1 - q)) throw new RangeError(`privacy_loss (${l}) is smaller than log(1 - sampling_prob)`);
    return inverseRemove(logAExpBPlusC(1 / q, l, 1 - 1 / q));
  }
  const upperCdf = (x) => (add ? ndtr(x / sigma) : q === 1 ? ndtr((x + 1) / sigma) : (1 - q) * ndtr(x / sigma) + q * ndtr((x + 1) / sigma));
  const lowerLogCdf = (x) => (!add ? logNdtr(x / sigma)
    : q === 1 ? logNdtr((x - 1) / sigma) : logAddExp(Math.log1p(-q) + logNdtr(x / sigma), Math.log(q) + logNdtr((x - 1) / sigma)));
  function delta(eps) {
    let d;
    if (q !== 1 && add && !(eps < -Math.log1p(-q))) d = 0;
    else if (q !== 1 && !add && !(eps > Math.log1p(-q))) d = -Math.expm1(eps);
    else { const x = inverse(eps); d = upperCdf(x) - Math.exp(eps + lowerLogCdf(x)); }
    return Math.min(Math.max(d, 0), 1);
  }
  // privacy_loss_tail: the noise truncated at half of e^-50 on each side, shifted by the sensitivity
  const lowerX0 = sigma * ndtri(0.5 * Math.exp(-50));
  const [lowerX, upperX] = add ? [lowerX0, -lowerX0 + 1] : [lowerX0 - 1, -lowerX0];
  return { delta, epsUpper: loss(lowerX), epsLower: loss(upperX) };
}

/** A PMF on the grid k·interval: {lower, probs (dense from lower) or keys (sparse, ascending), inf: mass at +∞}. */
const pmf = (lower, probs, inf, keys = null) => ({ lower, probs, inf, keys, size: probs.length });
const create = (lower, probs, inf) => (probs.length <= SPARSE_MAX ? pmf(lower, probs, inf, probs.map((_, i) => lower + i)) : pmf(lower, Float64Array.from(probs), inf));

/** create_pmf_pessimistic_connect_dots_fixed_gap over the grid from rounded ε lower to upper. */
function connectDots(interval, lower, upper, deltas) {
  if (lower === upper) return create(lower, [1 - deltas[0]], deltas[0]);
  const n = deltas.length;
  for (let i = 1; i < n; i++) if (deltas[i] - deltas[i - 1] > 1e-12) throw new RangeError("deltas are not in non-increasing order");
  for (let i = 1; i < n; i++) deltas[i] = Math.min(deltas[i], deltas[i - 1]);
  const diff = (i) => deltas[i + 1] - deltas[i];
  const probs = new Array(n);
  probs[0] = 1 - deltas[0] + diff(0) / Math.expm1(interval);
  for (let i = 1; i < n - 1; i++) probs[i] = (diff(i) - diff(i - 1) * Math.exp(interval)) / Math.expm1(interval);
  probs[n - 1] = diff(n - 2) / Math.expm1(-interval);
  return create(lower, probs.map((p) => Math.max(0, p)), deltas[n - 1]);
}

/** from_gaussian_mechanism(σ, interval, sampling q)'s PMF for one adjacency (connect-the-dots). */
function gaussianPmf(sigma, q, add, interval) {
  const g = gaussianLoss(sigma, q, add);
  const hi = Math.ceil(g.epsUpper / interval), lo = Math.floor(g.epsLower / interval);
  if (!(hi - lo < 1e8)) throw new RangeError(`the privacy loss spans ${hi - lo} points`);
  const deltas = Array.from({ length: hi - lo + 1 }, (_, i) => g.delta((lo + i) * interval));
  return connectDots(interval, lo, hi, deltas);
}

/** _truncate_tails (pessimistic): [offset, kept, mass moved to +∞]; the left tail goes to the first kept point. */
function truncateTails(probs, tail) {
  if (tail === 0) return [0, probs, 0];
  const prefix = (at) => { let s = 0; for (let i = 0; i < probs.length; i++) { s += probs[at(i)]; if (s > tail / 2) return i; } return probs.length; };
  const left = prefix((i) => i);
  const right = Math.max(probs.length - prefix((i) => probs.length - 1 - i), left + 1);
  let leftMass = 0, rightMass = 0;
  for (let i = 0; i < left; i++) leftMass += probs[i];
  for (let i = right; i < probs.length; i++) rightMass += probs[i];
  const kept = probs.slice(left, right);
  kept[0] += leftMass;
  return [left, kept, rightMass];
}

function toDense(p) {
  if (!p.keys) return p;
  const lower = p.keys[0], probs = new Float64Array(p.keys[p.keys.length - 1] - lower + 1);
  p.keys.forEach((k, i) => { probs[k - lower] = p.probs[i]; });
  return pmf(lower, probs, p.inf);
}

/** SparsePLDPmf.compose: the quadratic convolution of two sparse PMFs, then truncation. */
function composeSparse(a, b, tail) {
  const conv = new Map();
  a.keys.forEach((k1, i) => b.keys.forEach((k2, j) => conv.set(k1 + k2, (conv.get(k1 + k2) ?? 0) + a.probs[i] * b.probs[j])));
  const keys = [...conv.keys()].sort((x, y) => x - y);
  const [offset, probs, right] = truncateTails(keys.map((k) => conv.get(k)), tail);
  return pmf(0, probs, a.inf + b.inf - a.inf * b.inf + right, keys.slice(offset, offset + probs.length));
}

/** PLDPmf.self_compose(n, 1e-15), sparse or dense as dp-accounting chooses. */
function selfCompose(p, n) {
  if (p.keys) {
    if (n === 1) return p;
    if (p.size ** n <= SPARSE_MAX) {
      let out = p;
      for (let i = 2; i <= n; i++) out = composeSparse(out, p, i === n ? TAIL : 0);
      return out;
    }
    p = toDense(p);
  }
  const [offset, probs] = selfConvolve(p.probs, n, TAIL);
  return pmf(p.lower * n + offset, probs, TAIL - Math.expm1(n * Math.log1p(-p.inf)));
}

/** Composed with the identity PLD ({0: 1}): only the truncation of the tails remains. */
function afterIdentity(p) {
  if (p.keys && p.size <= SPARSE_MAX) return composeSparse(pmf(0, [1], 0, [0]), p, TAIL);
  const d = toDense(p);
  const [offset, probs, right] = truncateTails(d.probs, TAIL);
  return pmf(d.lower + offset, probs, d.inf + right);
}

/** PLDPmf.get_epsilon_for_delta (losses from the top down; a dense grid steps down by repeated subtraction). */
function epsilonFor(p, delta, interval) {
  if (p.inf > delta) return Infinity;
  let upper = p.inf, lower = 0, loss = p.keys ? null : (p.lower + p.size - 1) * interval;
  for (let i = p.size - 1; i >= 0; i--) {
    const l = p.keys ? p.keys[i] * interval : loss;
    if (upper > delta && lower > 0 && Math.log((upper - delta) / lower) >= l) break;
    upper += p.probs[i];
    lower += Math.exp(-l) * p.probs[i];
    if (upper >= delta && lower === 0) return Math.max(0, l);
    if (!p.keys) loss += -interval;
  }
  return upper <= lower + delta ? 0 : Math.log((upper - delta) / lower);
}

/** ε at δ of T steps of the Poisson-subsampled Gaussian (σ, q) under PLDAccountant(interval). */
export function pldEpsilon(sigma, q, steps, delta, interval) {
  if (!steps) return 0;
  const adjacencies = q === 1 ? [false] : [false, true];
  return Math.max(...adjacencies.map((add) => epsilonFor(afterIdentity(selfCompose(gaussianPmf(sigma, q, add, interval), steps)), delta, interval)));
}
