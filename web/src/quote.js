// DCAP quote bytes -> header, TD report and the bounds of the signature data; the TDX signature data must be exactly
// its declared structure (docs/verifier.md, check quote.parse). Signatures are checked by dcap-qvl (verify.js).
import { u16, u32 } from "./util.js";

const TDX = 0x81, SGX = 0;
const TD10_FIELDS = [
  ["tee_tcb_svn", 16], ["mr_seam", 48], ["mr_signer_seam", 48], ["seam_attributes", 8], ["td_attributes", 8],
  ["xfam", 8], ["mr_td", 48], ["mr_config_id", 48], ["mr_owner", 48], ["mr_owner_config", 48],
  ["rt_mr0", 48], ["rt_mr1", 48], ["rt_mr2", 48], ["rt_mr3", 48], ["report_data", 64],
];
export const MAX_QUOTE_BYTES = 64 * 1024;

export class QuoteParseError extends Error {}

export function parseQuote(raw) {
  const fail = (m) => { throw new QuoteParseError(m); };
  if (raw.length > MAX_QUOTE_BYTES) fail(`quote is ${raw.length} bytes; a DCAP quote is a few KB`);
  if (raw.length < 48) fail(`quote is ${raw.length} bytes, shorter than the 48-byte header`);
  const version = u16(raw, 0), keyType = u16(raw, 2), teeType = u32(raw, 4);
  let bodyOffset, bodyType, bodyLen;
  if (teeType === SGX && version === 3) [bodyOffset, bodyType, bodyLen] = [48, 0, 384];
  else if (teeType === TDX && version === 4) [bodyOffset, bodyType, bodyLen] = [48, 2, 584];
  else if (teeType === TDX && version === 5) {
    if (raw.length < 54) fail("v5 quote truncated in its body descriptor");
    bodyType = u16(raw, 48); bodyLen = u32(raw, 50);
    if (!((bodyType === 2 && bodyLen === 584) || (bodyType === 3 && bodyLen === 648))) fail(`unsupported v5 body type ${bodyType} / size ${bodyLen}`);
    bodyOffset = 54;
  } else fail(`unsupported quote: version ${version}, TEE type 0x${teeType.toString(16).padStart(8, "0")}`);
  const sigLenOff = bodyOffset + bodyLen;
  if (raw.length < sigLenOff + 4) fail(`quote truncated: ${raw.length} bytes, body needs ${sigLenOff + 4}`);
  const sigLen = u32(raw, sigLenOff);
  const signedEnd = sigLenOff + 4 + sigLen;
  if (signedEnd > raw.length) fail(`quote truncated: signature data declares ${sigLen} bytes, only ${raw.length - sigLenOff - 4} present`);
  let td = null, pckChain = null;
  if (teeType === TDX) {
    td = {};
    let pos = bodyOffset;
    for (const [name, size] of TD10_FIELDS) { td[name] = raw.subarray(pos, pos + size); pos += size; }
    if (bodyType === 3) td.mr_service_td = raw.subarray(pos + 16, pos + 64);
    pckChain = certificationData(raw, sigLenOff + 4, signedEnd);
  }
  const teeName = teeType === TDX ? "TDX" : teeType === SGX ? "SGX" : `0x${teeType.toString(16).padStart(8, "0")}`;
  return { raw, version, keyType, teeType, teeName, bodyOffset, td, signedEnd, trailing: raw.subarray(signedEnd), pckChain };
}

function certificationData(raw, start, end) {
  let pos = typedBlock(raw, start + 128, end, 6, "certification data");
  pos += 384 + 64;
  if (end < pos + 2) throw new QuoteParseError("QE report certification data truncated before the QE auth data");
  const authLen = u16(raw, pos);
  pos = typedBlock(raw, pos + 2 + authLen, end, 5, "inner certification data (PCK chain)");
  return raw.subarray(pos, end);
}

function typedBlock(raw, pos, end, want, what) {
  if (end < pos + 6) throw new QuoteParseError(`${what} header runs past the signature data`);
  const kind = u16(raw, pos), size = u32(raw, pos + 2);
  if (kind !== want) throw new QuoteParseError(`${what} type ${kind}; TDX quotes carry type ${want}`);
  if (pos + 6 + size !== end) throw new QuoteParseError(`${what} declares ${size} bytes but the signature data leaves ${end - pos - 6}`);
  return pos + 6;
}

/** Why the TD attributes are unacceptable (empty = fine). */
export function attributeProblems(td) {
  const a = td.td_attributes;
  const problems = [];
  if (a[0] & 1) problems.push("TD is in DEBUG mode (TDATTRIBUTES.TUD.DEBUG=1): its memory is readable by the host");
  if (a[0] & 0xfe) problems.push("reserved TUD attribute bits are set");
  if (!(a[3] & 0x10)) problems.push("SEPT_VE_DISABLE is 0 (the TD accepts #VE on EPT violations)");
  if (td.mr_signer_seam.some((x) => x)) problems.push("MRSIGNERSEAM is not zero (not the Intel TDX module)");
  if (td.mr_service_td && td.mr_service_td.some((x) => x)) problems.push("MRSERVICETD is not zero");
  return problems;
}
