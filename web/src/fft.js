// The self-convolution of a probability vector that dp-accounting's PLD accountant composes with
// (dp_accounting.pld.common.self_convolve): Chernoff bounds on where the n-fold sum's mass lies, then the input's
// spectrum raised to the n-th power and transformed back. The transform is a radix-2 FFT of the next power of two
// (scipy pads to its next fast length, an 11-smooth number, and transforms with pocketfft): the window is the same;
// the mass outside it (at most 1e-15) wraps around elsewhere, and the rounding differs (see pld.js).

const twiddleCache = new Map();

function twiddles(n) {
  if (!twiddleCache.has(n)) {
    const cos = new Float64Array(n / 2), sin = new Float64Array(n / 2);
    for (let k = 0; k < n / 2; k++) { cos[k] = Math.cos((2 * Math.PI * k) / n); sin[k] = Math.sin((2 * Math.PI * k) / n); }
    twiddleCache.clear();
    twiddleCache.set(n, [cos, sin]);
  }
  return twiddleCache.get(n);
}

/** In-place complex DFT of (re, im), length a power of two; `inverse`: the inverse transform, scaled by 1/n. */
export function fft(re, im, inverse = false) {
  const n = re.length;
  for (let i = 1, j = 0; i < n; i++) {
    let bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) { const r = re[i], m = im[i]; re[i] = re[j]; im[i] = im[j]; re[j] = r; im[j] = m; }
  }
  const [cos, sin] = twiddles(n);
  const sign = inverse ? 1 : -1;
  for (let len = 2; len <= n; len <<= 1) {
    const half = len >> 1, step = n / len;
    for (let i = 0; i < n; i += len) {
      for (let k = 0; k < half; k++) {
        const wr = cos[k * step], wi = sign * sin[k * step], a = i + k, b = a + half;
        const xr = re[b] * wr - im[b] * wi, xi = re[b] * wi + im[b] * wr;
        re[b] = re[a] - xr; im[b] = im[a] - xi; re[a] += xr; im[a] += xi;
      }
    }
  }
  if (inverse) for (let i = 0; i < n; i++) { re[i] /= n; im[i] /= n; }
}

/** (re, im)^n as numpy computes a complex power: repeated squaring below 100, else exp(n log z). */
function complexPower(re, im, n) {
  if (n < 100) {
    let ar = 1, ai = 0, pr = re, pi = im;
    for (let m = n; ; ) {
      if (m & 1) [ar, ai] = [ar * pr - ai * pi, ar * pi + ai * pr];
      m >>= 1;
      if (!m) break;
      [pr, pi] = [pr * pr - pi * pi, 2 * pr * pi];
    }
    return [ar, ai];
  }
  const r = Math.exp(n * Math.log(Math.hypot(re, im))), t = n * Math.atan2(im, re);
  return [r * Math.cos(t), r * Math.sin(t)];
}

/** log Σ_i b_i e^(i·order) over b_i ≠ 0 (scipy.special.logsumexp with weights, the largest terms summed apart). */
function logMgf(b, order) {
  let max = -Infinity;
  for (let i = 0; i < b.length; i++) if (b[i] !== 0 && i * order > max) max = i * order;
  let m = 0, s = 0;
  for (let i = 0; i < b.length; i++) {
    if (b[i] === 0) continue;
    if (i * order === max) m += b[i]; else s += b[i] * Math.exp(i * order - max);
  }
  return Math.log1p(s / m) + Math.log(m) + max;
}

/** [lower, upper]: the indices of the n-fold self-convolution outside which at most `tail` of the mass lies
 * (common.compute_self_convolve_bounds: Chernoff bounds at orders ±1..20 / len). */
function selfConvolveBounds(probs, n, tail) {
  const len = probs.length;
  let lower = 0, upper = (len - 1) * n;
  if (tail === 0) return [lower, upper];
  for (let k = -20; k <= 20; k++) {
    if (k === 0) continue;
    const order = k / len;
    const bound = (n * logMgf(probs, order) + Math.log(2 / tail)) / order;
    if (!Number.isFinite(bound)) continue;
    if (order > 0) upper = Math.min(upper, Math.ceil(bound));
    else lower = Math.max(lower, Math.floor(bound));
  }
  return [lower, upper];
}

/** [offset, out]: out[i] ≈ the n-fold self-convolution of `probs` at index offset + i, within the bounds. */
export function selfConvolve(probs, n, tail) {
  const [lower, upper] = selfConvolveBounds(probs, n, tail);
  const outLen = upper - lower + 1;
  let size = 1;
  while (size < Math.max(outLen, probs.length)) size *= 2;
  const re = new Float64Array(size), im = new Float64Array(size);
  re.set(probs);
  fft(re, im);
  for (let i = 0; i < size; i++) { const z = complexPower(re[i], im[i], n); re[i] = z[0]; im[i] = z[1]; }
  fft(re, im, true);
  const out = new Float64Array(outLen);
  for (let i = 0; i < outLen; i++) out[i] = re[(((i + lower) % size) + size) % size];
  return [lower, out];
}
