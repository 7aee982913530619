// The standard normal distribution in double precision: Φ, log Φ and Φ⁻¹, what scipy.special's ndtr, log_ndtr and
// ndtri give the Python verifier (attestation/privacy/epsilon.py). Computed here by a power series (|x| < 2) and the
// continued fraction of Mills' ratio (|x| ≥ 2), with e^(−x²/2) free of the error of rounding x²: a few ulps from
// scipy's values, never the same algorithm bit for bit.

const SQRT_2PI = Math.sqrt(2 * Math.PI);
const LN_SQRT_2PI = 0.5 * Math.log(2 * Math.PI);

/** x²/2 as hi + lo, hi exact (x split into a short high part and its exact remainder). */
function halfSquare(x) {
  const hi = Math.round(x * 256) / 256;
  const lo = x - hi;
  return [0.5 * hi * hi, lo * (hi + 0.5 * lo)];
}

/** The density φ(x) and its logarithm. */
export function logPhi(x) {
  const [a, b] = halfSquare(x);
  return -a - b - LN_SQRT_2PI;
}
const phi = (x) => { const [a, b] = halfSquare(x); return Math.exp(-a) * Math.exp(-b) / SQRT_2PI; };

/** Φ(x) for |x| < 2: 1/2 + x φ(x) Σ x^(2n) / (1·3·…·(2n+1)) (positive terms only). */
function seriesCdf(x) {
  const x2 = x * x;
  let term = 1, sum = 1;
  for (let n = 1; n < 200 && term > sum * 1e-17; n++) { term *= x2 / (2 * n + 1); sum += term; }
  return 0.5 + x * phi(x) * sum;
}

/** x + 1/(x + 2/(x + 3/(x + …))) = φ(x) / (1 − Φ(x)) for x ≥ 1, evaluated from its tail (stable; the depth is what
 * the fraction needs to converge to double precision at x). */
function millsDenominator(x) {
  let t = x;
  for (let k = Math.ceil(40 + 420 / (x * x)); k >= 1; k--) t = x + k / t;
  return t;
}

/** Φ(x), the standard normal CDF. */
export function ndtr(x) {
  if (x === Infinity) return 1;
  if (x === -Infinity) return 0;
  if (x <= -1) return phi(x) / millsDenominator(-x);
  if (x >= 2) return 1 - phi(x) / millsDenominator(x);
  return seriesCdf(x);
}

/** log Φ(x). */
export function logNdtr(x) {
  if (x === Infinity) return 0;
  if (x === -Infinity) return -Infinity;
  if (x <= -1) return logPhi(x) - Math.log(millsDenominator(-x));
  if (x >= 2) return Math.log1p(-phi(x) / millsDenominator(x));
  return Math.log(seriesCdf(x));
}

/** Φ⁻¹(p) for 0 < p ≤ 1/2 (Newton's method on log Φ, from the left: it converges monotonically). */
export function ndtri(p) {
  if (!(p > 0 && p <= 0.5)) throw new RangeError(`ndtri: ${p} is outside (0, 1/2]`);
  const target = Math.log(p);
  let x = -Math.sqrt(-2 * target);
  for (let i = 0; i < 100; i++) {
    const lc = logNdtr(x);
    const step = (lc - target) / Math.exp(logPhi(x) - lc);
    x -= step;
    if (!(Math.abs(step) > 1e-16 * Math.abs(x))) break;
  }
  return x;
}
