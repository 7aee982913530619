// safetensors files as the Python verifier loads them (safetensors.numpy.load: the Rust parser's rules, then numpy
// arrays), and the float arithmetic of round.aggregate: numpy's dtypes, a Python float scaling an array in the
// array's own precision (NEP 50), float32 and float16 rounding after every operation.
import { utf8 } from "./util.js";

// Bits per element of every dtype the parser accepts; NUMPY: the ones safetensors.numpy can make an array of.
const BITS = { BOOL: 8, F4: 4, F6_E2M3: 6, F6_E3M2: 6, U8: 8, I8: 8, F8_E5M2: 8, F8_E4M3: 8, F8_E8M0: 8, I16: 16, U16: 16,
  F16: 16, BF16: 16, I32: 32, U32: 32, F32: 32, C64: 64, F64: 64, I64: 64, U64: 64 };
const NUMPY = ["F64", "F32", "F16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL", "C64"];
const MAX_HEADER = 100_000_000;

export class SafetensorsError extends Error {}
/** A dtype numpy has no array for (safetensors.numpy raises KeyError, a LookupError, naming it). */
export class DtypeLookupError extends Error {}

const usize = (v) => Number.isSafeInteger(v) && v >= 0;

/** {name: {dtype, shape, values: Float64Array}}; throws SafetensorsError (the file does not parse) or
 * DtypeLookupError (it parses, but holds a dtype numpy cannot load). */
export function loadSafetensors(data) {
  const fail = (m) => { throw new SafetensorsError(m); };
  if (data.length < 8) fail("HeaderTooSmall");
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const n = Number(view.getBigUint64(0, true));
  if (n > MAX_HEADER) fail("HeaderTooLarge");
  if (n + 8 > data.length) fail("InvalidHeaderLength");
  const text = utf8(data.subarray(8, 8 + n));
  if (text === null) fail("InvalidHeader");
  if (!text.startsWith("{")) fail("InvalidHeaderStart");
  let header;
  try { header = JSON.parse(text); } catch (e) { fail(`InvalidHeaderDeserialization: ${e.message}`); }
  const tensors = [];
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") {
      if (info !== null && (typeof info !== "object" || Array.isArray(info) || Object.values(info).some((v) => typeof v !== "string"))) fail("InvalidHeaderDeserialization: __metadata__");
      continue;
    }
    const ok = info && typeof info === "object" && info.dtype in BITS && Array.isArray(info.shape) && info.shape.every(usize)
      && Array.isArray(info.data_offsets) && info.data_offsets.length === 2 && info.data_offsets.every(usize);
    if (!ok) fail(`InvalidHeaderDeserialization: ${name}`);
    tensors.push({ name, ...info });
  }
  tensors.sort((a, b) => a.data_offsets[0] - b.data_offsets[0] || a.data_offsets[1] - b.data_offsets[1]);
  let start = 0;
  for (const t of tensors) {
    const [s, e] = t.data_offsets;
    if (s !== start || e < s) fail(`InvalidOffset(${t.name})`);
    start = e;
    const bits = t.shape.reduce((a, b) => a * b, 1) * BITS[t.dtype];
    if (!Number.isSafeInteger(bits)) fail("ValidationOverflow");
    if (bits % 8) fail("MisalignedSlice");
    if (e - s !== bits / 8) fail(`TensorInvalidInfo(${t.name})`);
  }
  if (start + 8 + n !== data.length) fail("MetadataIncompleteBuffer");
  const out = {};
  for (const t of tensors) {
    if (!NUMPY.includes(t.dtype)) throw new DtypeLookupError(t.dtype);
    out[t.name] = { dtype: t.dtype, shape: t.shape, values: decode(t.dtype, data.subarray(8 + n + t.data_offsets[0], 8 + n + t.data_offsets[1])) };
  }
  return out;
}

function decode(dtype, bytes) {
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const size = { F64: 8, F32: 4, F16: 2, I64: 8, U64: 8, I32: 4, U32: 4, I16: 2, U16: 2, I8: 1, U8: 1, BOOL: 1, C64: 8 }[dtype];
  const read = {
    F64: (i) => v.getFloat64(i, true), F32: (i) => v.getFloat32(i, true), F16: (i) => half(v.getUint16(i, true)),
    I64: (i) => Number(v.getBigInt64(i, true)), U64: (i) => Number(v.getBigUint64(i, true)), I32: (i) => v.getInt32(i, true),
    U32: (i) => v.getUint32(i, true), I16: (i) => v.getInt16(i, true), U16: (i) => v.getUint16(i, true), I8: (i) => v.getInt8(i),
    U8: (i) => v.getUint8(i), BOOL: (i) => (v.getUint8(i) ? 1 : 0), C64: () => NaN,
  }[dtype];
  return Float64Array.from({ length: bytes.length / size }, (_, i) => read(i * size));
}

function half(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

/** Round to the nearest float16 (ties to even). */
function toHalf(x) {
  const a = Math.abs(x);
  if (!Number.isFinite(x) || a === 0) return x;
  if (a >= 65520) return Math.sign(x) * Infinity;
  let e = Math.max(Math.floor(Math.log2(a)), -14);
  if (e > -14 && 2 ** e > a) e--;
  else if (2 ** (e + 1) <= a) e++;
  const ulp = 2 ** (Math.max(e, -14) - 10), m = a / ulp;
  let r = Math.round(m);
  if (r - m === 0.5 && r % 2) r--;
  return Math.sign(x) * r * ulp;
}

// The precision of an array's arithmetic: float16, float32, or float64 (every other dtype, once scaled by a float).
const RANK = { F16: 16, F32: 32 };
export const precisionOf = (dtype) => RANK[dtype] ?? 64;
export const rounder = (bits) => (bits === 16 ? toHalf : bits === 32 ? Math.fround : (x) => x);
