// ε of DP-SGD from (σ, q, T) at δ, rdp accountant: the Rényi DP of the Poisson-subsampled Gaussian (Mironov, Talwar
// and Zhang 2019, §3.3) at Opacus' orders, converted with Balle et al. 2020 (verifier-spec §10; what
// attestation/privacy/epsilon.py computes with scipy, here with plain doubles).
import { logNdtr } from "./normal.js";

const ORDERS = [...Array.from({ length: 99 }, (_, x) => 1 + (x + 1) / 10), ...Array.from({ length: 52 }, (_, i) => 12 + i)];

function logAdd(x, y) {
  const a = Math.min(x, y), b = Math.max(x, y);
  return a === -Infinity ? b : Math.log1p(Math.exp(a - b)) + b;
}

function logSub(x, y) {
  if (x < y) return NaN;
  if (y === -Infinity) return x;
  if (x === y) return -Infinity;
  const d = Math.expm1(x - y);
  return Number.isFinite(d) ? Math.log(d) + y : x;
}

const logErfc = (x) => Math.LN2 + logNdtr(-x * Math.SQRT2);

/** Binomial coefficient for real n and integer k >= 0. */
function binom(n, k) {
  let v = 1;
  for (let i = 1; i <= k; i++) v *= (n - i + 1) / i;
  return v;
}

function logAInt(q, sigma, alpha) {
  let logA = -Infinity;
  for (let i = 0; i <= alpha; i++) {
    const coef = Math.log(binom(alpha, Math.min(i, alpha - i))) + i * Math.log(q) + (alpha - i) * Math.log(1 - q);
    logA = logAdd(logA, coef + (i * i - i) / (2 * sigma ** 2));
  }
  return logA;
}

function logAFrac(q, sigma, alpha) {
  let a0 = -Infinity, a1 = -Infinity;
  const z0 = sigma ** 2 * Math.log(1 / q - 1) + 0.5;
  for (let i = 0, coef = 1; i < 100000; coef *= (alpha - i) / (i + 1), i++) {
    const lc = Math.log(Math.abs(coef)), j = alpha - i;
    const t0 = lc + i * Math.log(q) + j * Math.log(1 - q);
    const t1 = lc + j * Math.log(q) + i * Math.log(1 - q);
    const s0 = t0 + (i * i - i) / (2 * sigma ** 2) + Math.log(0.5) + logErfc((i - z0) / (Math.SQRT2 * sigma));
    const s1 = t1 + (j * j - j) / (2 * sigma ** 2) + Math.log(0.5) + logErfc((z0 - j) / (Math.SQRT2 * sigma));
    if (coef > 0) { a0 = logAdd(a0, s0); a1 = logAdd(a1, s1); } else { a0 = logSub(a0, s0); a1 = logSub(a1, s1); }
    if (Math.max(s0, s1) < -30) return logAdd(a0, a1);
  }
  return NaN;
}

function rdp(q, sigma, alpha) {
  if (q === 1) return alpha / (2 * sigma ** 2);
  return (Number.isInteger(alpha) ? logAInt(q, sigma, alpha) : logAFrac(q, sigma, alpha)) / (alpha - 1);
}

/** ε at δ of history [[σ, q, T], …]; null when it cannot be computed here. */
export function rdpEpsilon(history, delta) {
  const total = ORDERS.map(() => 0);
  for (const [sigma, q, steps] of history) {
    if (steps) ORDERS.forEach((a, i) => { total[i] += steps * rdp(q, sigma, a); });
  }
  const eps = ORDERS.map((a, i) => total[i] - (Math.log(delta) + Math.log(a)) / (a - 1) + Math.log((a - 1) / a)).filter((e) => !Number.isNaN(e));
  return eps.length ? Math.min(...eps) : null;
}
