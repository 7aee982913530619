// ε of DP-SGD from (σ, q, T) at δ, rdp accountant: the Rényi DP of the Poisson-subsampled Gaussian (Mironov, Talwar
// and Zhang 2019, §3.3) at Opacus' orders, converted with Balle et al. 2020 (verifier-spec §10; what
// attestation/privacy/epsilon.py computes with scipy, here with plain doubles).

const ORDERS = [...Array.from({ length: 99 }, (_, x) => 1 + (x + 1) / 10), ...Array.from({ length: 52 }, (_, i) => 12 + i)];
const LN2PI_2 = 0.5 * Math.log(2 * Math.PI);

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

/** log Φ(t), Φ the standard normal CDF. */
function logNdtr(t) {
  if (t > 3) return Math.log1p(-Math.exp(logNdtr(-t)));
  if (t > -3) {
    // erf(x) = 2/√π e^{-x²} Σ 2^n x^{2n+1} / (1·3·…·(2n+1)): positive terms only
    const x = Math.abs(t) / Math.SQRT2;
    let term = x, sum = x;
    for (let n = 1; n < 500 && term > sum * 1e-17; n++) { term *= (2 * x * x) / (2 * n + 1); sum += term; }
    const erf = (2 / Math.sqrt(Math.PI)) * Math.exp(-x * x) * sum;
    return Math.log(0.5 * (1 + (t < 0 ? -erf : erf)));
  }
  // Mills ratio R(x) = Φ(-x)/φ(x) = 1/(x + 1/(x + 2/(x + 3/(x + …)))), by the modified Lentz method
  const x = -t, tiny = 1e-300;
  let f = x, c = x, d = 0;
  for (let k = 1; k < 5000; k++) {
    d = x + k * d; d = 1 / (Math.abs(d) < tiny ? tiny : d);
    c = x + k / c; if (Math.abs(c) < tiny) c = tiny;
    const delta = c * d;
    f *= delta;
    if (Math.abs(delta - 1) < 1e-16) break;
  }
  return -0.5 * x * x - LN2PI_2 - Math.log(f);
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
