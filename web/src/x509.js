// The few X.509 facts the verifier needs (a small DER reader, no general ASN.1): the signed part, the signature, the
// names, the validity window and the P-256 key of a certificate; the same for a CRL. Rules: docs/verifier-spec.md §11.
import { p256 } from "@noble/curves/nist.js";
import { equal, utf8 } from "./util.js";

function tlv(b, at) {
  if (at + 2 > b.length) throw new Error("DER truncated");
  const tag = b[at];
  let len = b[at + 1], hdr = 2;
  if (len & 0x80) {
    const n = len & 0x7f;
    if (n < 1 || n > 4 || at + 2 + n > b.length) throw new Error("bad DER length");
    len = 0;
    for (let i = 0; i < n; i++) len = len * 256 + b[at + 2 + i];
    hdr += n;
  }
  const end = at + hdr + len;
  if (end > b.length) throw new Error("DER truncated");
  return { tag, start: at, body: at + hdr, end };
}

function children(b, node) {
  const out = [];
  for (let at = node.body; at < node.end;) { const c = tlv(b, at); out.push(c); at = c.end; }
  if (out.length && out[out.length - 1].end !== node.end) throw new Error("bad DER");
  return out;
}

const slice = (b, n) => b.subarray(n.start, n.end);

function time(b, n) {
  const s = String.fromCharCode(...b.subarray(n.body, n.end));
  const m = n.tag === 0x17 ? /^(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})Z$/.exec(s) : /^(\d{4})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})Z$/.exec(s);
  if (!m) throw new Error("bad time");
  let y = Number(m[1]);
  if (n.tag === 0x17) y += y < 50 ? 2000 : 1900;
  return Date.UTC(y, m[2] - 1, m[3], m[4], m[5], m[6]) / 1000;
}

const ECDSA_SHA256 = "06082a8648ce3d040302";
const hexOf = (b) => Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");

function signed(b) {
  const top = tlv(b, 0);
  if (top.tag !== 0x30 || top.end !== b.length) throw new Error("not a DER SEQUENCE");
  const [tbs, alg, sig] = children(b, top);
  if (!sig || sig.tag !== 0x03) throw new Error("no signature");
  const algOid = children(b, alg)[0];
  return { tbs, tbsBytes: slice(b, tbs), alg: hexOf(slice(b, algOid)), sig: b.subarray(sig.body + 1, sig.end) };
}

/** A parsed certificate, or throws. */
export function parseCert(der) {
  const s = signed(der);
  let f = children(der, s.tbs);
  if (f[0].tag === 0xa0) f = f.slice(1);
  const [serial, , issuer, validity, subject, spki, ...rest] = f;
  const [nb, na] = children(der, validity);
  const bits = children(der, spki)[1];
  let ext = null;
  for (const r of rest) if (r.tag === 0xa3) ext = r;
  return {
    der, ...s, serial: hexOf(der.subarray(serial.body, serial.end)), issuer: slice(der, issuer), subject: slice(der, subject),
    notBefore: time(der, nb), notAfter: time(der, na), publicKey: der.subarray(bits.body + 1, bits.end), spki: slice(der, spki),
    extensions: ext ? slice(der, ext) : null,
  };
}

/** A parsed CRL, or throws. */
export function parseCrl(der) {
  const s = signed(der);
  let f = children(der, s.tbs);
  if (f[0].tag === 0x02) f = f.slice(1);
  const [, issuer, thisUpdate, maybeNext] = f;
  const next = maybeNext && (maybeNext.tag === 0x17 || maybeNext.tag === 0x18) ? time(der, maybeNext) : null;
  return { der, ...s, issuer: slice(der, issuer), thisUpdate: time(der, thisUpdate), nextUpdate: next };
}

/** ECDSA P-256 / SHA-256 signature (DER) by `publicKey` (uncompressed point) over `data`. */
export function ecdsaOk(publicKey, data, sigDer) {
  try { return p256.verify(sigDer, data, publicKey, { format: "der", lowS: false }); } catch { return false; }
}

/** `signer` (a parsed certificate) issued `obj` (a parsed certificate or CRL): names match and the signature holds. */
export function issuedBy(obj, signer) {
  return equal(obj.issuer, signer.subject) && obj.alg === ECDSA_SHA256 && ecdsaOk(signer.publicKey, obj.tbsBytes, obj.sig);
}

// ---- PEM ---------------------------------------------------------------------------------------------------------

const BLOCK = /-----BEGIN CERTIFICATE-----\r?\n?([A-Za-z0-9+/=\s]*?)-----END CERTIFICATE-----/g;

function b64decode(s) {
  const bin = atob(s.replace(/\s+/g, ""));
  return Uint8Array.from(bin, (c) => c.charCodeAt(0));
}

function b64encode(b) {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode(...b.subarray(i, i + 0x8000));
  return btoa(s);
}

export function pemOf(der) {
  const b = b64encode(der).match(/.{1,64}/g).join("\n");
  return `-----BEGIN CERTIFICATE-----\n${b}\n-----END CERTIFICATE-----\n`;
}

/** The certificates of a PEM text (every block must parse), or null. */
export function loadChain(text) {
  const certs = [];
  try {
    for (const m of text.matchAll(BLOCK)) certs.push(parseCert(b64decode(m[1])));
  } catch { return null; }
  return certs.length ? certs : null;
}

/** Why a shipped PEM chain is not canonical PEM, each certificate issued by the next, ending in `rootDer`. */
export function chainProblems(name, pemBytes, rootDer) {
  const text = utf8(pemBytes);
  const certs = text === null ? null : loadChain(text);
  if (!certs) return { problems: [`${name} is not a PEM certificate chain`], certs: [] };
  const problems = [];
  if (certs.map((c) => pemOf(c.der)).join("") !== text) {
    problems.push(`${name} is not in canonical PEM form (bytes around the certificates were changed)`);
  }
  for (let i = 0; i + 1 < certs.length; i++) {
    if (!issuedBy(certs[i], certs[i + 1])) problems.push(`${name}: certificate ${i} is not issued by certificate ${i + 1}`);
  }
  if (!equal(certs[certs.length - 1].der, rootDer)) problems.push(`${name} does not end in the trusted root certificate`);
  return { problems, certs };
}
