// Bytes, hashes and the exact JSON forms the verifier spec uses (docs/verifier-spec.md, "Notation").
import { sha256 as _sha256, sha384 as _sha384, sha512 as _sha512 } from "@noble/hashes/sha2.js";
import { keccak_256 } from "@noble/hashes/sha3.js";

export const enc = new TextEncoder();
const dec = new TextDecoder("utf-8", { fatal: true });

export const sha256 = (b) => _sha256(b);
export const sha384 = (b) => _sha384(b);
export const sha512 = (b) => _sha512(b);
export const keccak256 = (b) => keccak_256(b);

export function hex(b) {
  let s = "";
  for (let i = 0; i < b.length; i++) s += (b[i] < 16 ? "0" : "") + b[i].toString(16);
  return s;
}

/** Bytes of a hex string, or null when it is not (even-length) hex. */
export function unhex(s) {
  if (typeof s !== "string" || s.length % 2 || !/^[0-9a-fA-F]*$/.test(s)) return null;
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.substr(2 * i, 2), 16);
  return out;
}

export const sha256hex = (b) => hex(sha256(b));

export function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) { out.set(p, at); at += p.length; }
  return out;
}

export function equal(a, b) {
  if (!a || !b || a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** UTF-8 text of bytes, or null when they are not UTF-8. */
export function utf8(b) {
  try { return dec.decode(b); } catch { return null; }
}

export const u16 = (b, at) => b[at] | (b[at + 1] << 8);
export const u32 = (b, at) => (b[at] | (b[at + 1] << 8) | (b[at + 2] << 16)) + b[at + 3] * 0x1000000;

export function isoUtc(secs) {
  return new Date(secs * 1000).toISOString().replace(/\.\d{3}Z$/, "Z");
}

// ---- JSON that keeps how each number was written -------------------------------------------------------------------
// Python's json module tells 1 (int) from 1.0 (float) and prints floats with repr(); JSON.parse cannot. Canonical JSON
// (sorted keys, "," and ":" separators) is rebuilt here exactly as Python writes it, so hashes over it agree.

export class Num {
  constructor(text) { this.text = text; this.value = Number(text); this.isInt = !/[.eE]/.test(text); }
}

/** Parse JSON text; numbers become Num, objects plain objects (a duplicate key sets `dupes`). Throws on bad JSON. */
export function parseJsonExact(text) {
  let i = 0;
  const state = { dupes: false };
  const ws = () => { while (i < text.length && " \t\n\r".includes(text[i])) i++; };
  const fail = (what) => { throw new SyntaxError(`${what} at character ${i}`); };
  function value(depth) {
    if (depth > 200) fail("nested too deeply");
    ws();
    const c = text[i];
    if (c === "{") {
      i++; const obj = {}; ws();
      if (text[i] === "}") { i++; return obj; }
      for (;;) {
        ws(); if (text[i] !== '"') fail("expected a key");
        const k = string();
        ws(); if (text[i] !== ":") fail("expected ':'"); i++;
        if (Object.prototype.hasOwnProperty.call(obj, k)) state.dupes = true;
        Object.defineProperty(obj, k, { value: value(depth + 1), enumerable: true, writable: true, configurable: true });
        ws();
        if (text[i] === ",") { i++; continue; }
        if (text[i] === "}") { i++; return obj; }
        fail("expected ',' or '}'");
      }
    }
    if (c === "[") {
      i++; const arr = []; ws();
      if (text[i] === "]") { i++; return arr; }
      for (;;) {
        arr.push(value(depth + 1)); ws();
        if (text[i] === ",") { i++; continue; }
        if (text[i] === "]") { i++; return arr; }
        fail("expected ',' or ']'");
      }
    }
    if (c === '"') return string();
    if (text.startsWith("true", i)) { i += 4; return true; }
    if (text.startsWith("false", i)) { i += 5; return false; }
    if (text.startsWith("null", i)) { i += 4; return null; }
    const m = /^-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?/.exec(text.slice(i, i + 400));
    if (!m) fail("unexpected character");
    i += m[0].length;
    return new Num(m[0]);
  }
  function string() {
    const m = /^"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/.exec(text.slice(i));
    if (!m) fail("bad string");
    i += m[0].length;
    return JSON.parse(m[0]);
  }
  const v = value(0);
  ws();
  if (i !== text.length) fail("extra data");
  return { value: v, dupes: state.dupes };
}

/** A value parsed by parseJsonExact as plain JS (numbers as numbers). */
export function plain(v) {
  if (v instanceof Num) return v.value;
  if (Array.isArray(v)) return v.map(plain);
  if (v && typeof v === "object") {
    const o = {};
    for (const k of Object.keys(v)) Object.defineProperty(o, k, { value: plain(v[k]), enumerable: true, writable: true, configurable: true });
    return o;
  }
  return v;
}

/** Python's repr() of a float. */
export function pyFloat(x) {
  if (!Number.isFinite(x)) throw new RangeError("NaN or Infinity has no JSON form");
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const [mant, e] = x.toExponential().split("e");
  const exp = Number(e);
  const digits = mant.replace("-", "").replace(".", "");
  const sign = x < 0 ? "-" : "";
  if (exp < -4 || exp >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${m}e${exp < 0 ? "-" : "+"}${String(Math.abs(exp)).padStart(2, "0")}`;
  }
  if (exp < 0) return `${sign}0.${"0".repeat(-exp - 1)}${digits}`;
  const int = digits.slice(0, exp + 1).padEnd(exp + 1, "0");
  const frac = digits.slice(exp + 1);
  return `${sign}${int}.${frac || "0"}`;
}

function pyString(s, asciiOnly) {
  let out = JSON.stringify(s);
  if (asciiOnly) out = out.replace(/[\u007f-\uffff]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
  return out;
}

/** Python json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=asciiOnly). Plain JS numbers: integers
 * print as ints, others with repr(); Num keeps the int/float kind it was written with. */
export function canonical(v, asciiOnly = false) {
  if (v === null) return "null";
  if (v === true) return "true";
  if (v === false) return "false";
  if (v instanceof Num) return v.isInt ? BigInt(v.text).toString() : pyFloat(v.value);
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : pyFloat(v);
  if (typeof v === "string") return pyString(v, asciiOnly);
  if (Array.isArray(v)) return "[" + v.map((x) => canonical(x, asciiOnly)).join(",") + "]";
  const keys = Object.keys(v).sort(pyKeyOrder);
  return "{" + keys.map((k) => pyString(k, asciiOnly) + ":" + canonical(v[k], asciiOnly)).join(",") + "}";
}

/** Python sorts str keys by code point; JS sorts by UTF-16 unit (they differ only beyond U+FFFF). */
function pyKeyOrder(a, b) {
  const x = Array.from(a), y = Array.from(b);
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i].codePointAt(0) - y[i].codePointAt(0);
    if (d) return d;
  }
  return x.length - y.length;
}

/** Deep equality of plain JSON values (Num compared by value). */
export function jsonEqual(a, b) {
  if (a instanceof Num) a = a.value;
  if (b instanceof Num) b = b.value;
  if (a === b) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  const ka = Object.keys(a), kb = Object.keys(b);
  if (ka.length !== kb.length) return false;
  return ka.every((k) => Object.prototype.hasOwnProperty.call(b, k) && jsonEqual(a[k], b[k]));
}

export const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v) && !(v instanceof Num);

/** SHA-256 (hex) of the canonical JSON of a {path: sha256} map (verifier-spec §5, §7a). */
export const filesDigestOf = (files) => sha256hex(enc.encode(canonical(files)));

/** Python's format(x, f".{p}g"). */
export function formatG(x, p = 6) {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "nan" : x > 0 ? "inf" : "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0" : "0";
  const [mant, e] = x.toExponential(p - 1).split("e");
  const exp = Number(e);
  const strip = (s) => (s.includes(".") ? s.replace(/0+$/, "").replace(/\.$/, "") : s);
  if (exp >= -4 && exp < p) return strip(x.toFixed(Math.max(0, p - 1 - exp)));
  return `${strip(mant)}e${exp < 0 ? "-" : "+"}${String(Math.abs(exp)).padStart(2, "0")}`;
}
