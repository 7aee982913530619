// Collateral: parse, validity window and chain rules (verifier-spec §11), then the DCAP signature and TCB checks by
// @phala/dcap-qvl (the JavaScript port of dcap-qvl) under the policy's root.
import { QuoteVerifier, utils as qvlUtils } from "@phala/dcap-qvl";
import { Buffer } from "buffer";
import { parseQuote } from "./quote.js";
import { equal, isObj, unhex, utf8 } from "./util.js";
import { chainProblems, issuedBy, loadChain, parseCrl } from "./x509.js";

const PEM_FIELDS = ["pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain", "pck_certificate_chain"];
const STRINGS = ["pck_crl_issuer_chain", "tcb_info_issuer_chain", "tcb_info", "qe_identity"];
const HEXES = ["root_ca_crl", "pck_crl", "tcb_info_signature", "qe_identity_signature"];

export class CollateralError extends Error {}

const ts = (iso) => {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) throw new Error(`bad date ${iso}`);
  return Math.floor(t / 1000);
};

/** { text, obj, notBefore, notAfter, tcbNumber } or throws CollateralError. */
export function parseCollateral(bytes) {
  if (bytes.length > 1 << 20) throw new CollateralError(`collateral is ${bytes.length} bytes; expected a few tens of KB`);
  const text = utf8(bytes);
  if (text === null) throw new CollateralError("collateral is not UTF-8 JSON");
  let obj;
  try {
    obj = JSON.parse(text);
    if (!isObj(obj)) throw new Error("not a JSON object");
    for (const k of [...STRINGS, ...HEXES]) if (typeof obj[k] !== "string") throw new Error(`missing field \`${k}\``);
    for (const k of HEXES) if (!unhex(obj[k])) throw new Error(`${k} is not hex`);
  } catch (e) {
    throw new CollateralError(`collateral is not dcap-qvl QuoteCollateralV3 JSON: ${e.message}`);
  }
  const starts = [], ends = [];
  let tcbNumber = null;
  try {
    for (const k of ["tcb_info", "qe_identity"]) {
      const inner = JSON.parse(obj[k]);
      starts.push(ts(inner.issueDate));
      ends.push(ts(inner.nextUpdate));
      if (k === "tcb_info") tcbNumber = inner.tcbEvaluationDataNumber ?? null;
    }
    for (const k of ["root_ca_crl", "pck_crl"]) {
      const crl = parseCrl(unhex(obj[k]));
      starts.push(crl.thisUpdate);
      if (crl.nextUpdate !== null) ends.push(crl.nextUpdate);
    }
    for (const k of PEM_FIELDS) {
      if (!obj[k]) continue;
      for (const c of loadChain(obj[k]) || []) { starts.push(c.notBefore); ends.push(c.notAfter); }
    }
  } catch (e) {
    throw new CollateralError(`collateral field unreadable: ${e.message}`);
  }
  return { text, obj, notBefore: Math.max(...starts), notAfter: Math.min(...ends), tcbNumber };
}

export function quoteChainProblems(chain, rootDer) {
  const nul = chain.indexOf(0);
  if (!chain.length || nul !== chain.length - 1) return ["the quote's PCK chain must end in exactly one NUL byte"];
  return chainProblems("the quote's PCK chain", chain.subarray(0, -1), rootDer).problems;
}

export function collateralChainProblems(coll, rootDer, quoteChain) {
  const problems = [], issuers = {};
  const enc = new TextEncoder();
  for (const k of PEM_FIELDS) {
    let pem = coll.obj[k];
    if ((pem === undefined || pem === null) && k === "pck_certificate_chain") continue;
    let b = typeof pem === "string" ? enc.encode(pem) : new Uint8Array();
    if (k === "pck_certificate_chain" && b.length && b[b.length - 1] === 0) b = b.subarray(0, -1);
    const r = chainProblems(`collateral ${k}`, b, rootDer);
    problems.push(...r.problems);
    issuers[k] = r.certs;
  }
  const pckIssuers = issuers.pck_crl_issuer_chain;
  for (const [k, signer] of [["pck_crl", pckIssuers[0]], ["root_ca_crl", pckIssuers[pckIssuers.length - 1]]]) {
    let ok = false;
    try { ok = !!signer && issuedBy(parseCrl(unhex(coll.obj[k])), signer); } catch { ok = false; }
    if (!ok) problems.push(`collateral ${k} is not signed by its issuer in pck_crl_issuer_chain`);
  }
  const pck = issuers.pck_certificate_chain;
  if (pck && quoteChain) {
    let end = quoteChain.length;
    while (end && quoteChain[end - 1] === 0) end--;
    const own = loadChain(utf8(quoteChain.subarray(0, end)) ?? "") || [];
    if (pck.length !== own.length || pck.some((c, i) => !equal(c.der, own[i].der))) {
      problems.push("collateral pck_certificate_chain is not the quote's own PCK chain");
    }
  }
  return problems;
}

/** dcap-qvl (JavaScript): { ok, status, advisoryIds, error, tcbDate, tcbNumber }. */
export function dcapVerify(raw, coll, rootDer, now) {
  try {
    const rep = new QuoteVerifier(Buffer.from(rootDer)).verify(Buffer.from(raw), coll.obj, now);
    return { ok: true, status: rep.status, advisoryIds: [...rep.advisory_ids], error: null, ...tcbFacts(coll, raw) };
  } catch (e) {
    let msg = e.message, c = e.cause;
    while (c) { msg += ` | ${c.message}`; c = c.cause; }
    return { ok: false, status: null, advisoryIds: [], error: msg };
  }
}

/** The matched platform TCB level's date and the collateral's evaluation number (what dcap-qvl's claims report). */
function tcbFacts(coll, raw) {
  const tcb = JSON.parse(coll.obj.tcb_info), qe = JSON.parse(coll.obj.qe_identity);
  const numbers = [tcb.tcbEvaluationDataNumber, qe.tcbEvaluationDataNumber].filter((n) => Number.isInteger(n));
  let tcbDate = null;
  try {
    const q = parseQuote(raw);
    const chain = loadChain(utf8(q.pckChain.subarray(0, -1)) ?? "");
    const pemChain = coll.obj.pck_certificate_chain ? loadChain(coll.obj.pck_certificate_chain) : chain;
    const ext = qvlUtils.getIntelExtension(Buffer.from(pemChain[0].der));
    const cpuSvn = qvlUtils.getCpuSvn(ext), pceSvn = qvlUtils.getPceSvn(ext);
    for (const level of tcb.tcbLevels) {
      if (pceSvn < level.tcb.pcesvn) continue;
      const sgx = level.tcb.sgxtcbcomponents.map((c) => c.svn);
      if (sgx.some((s, i) => cpuSvn[i] < s)) continue;
      const tdx = (level.tcb.tdxtcbcomponents || []).map((c) => c.svn);
      if (tdx.some((s, i) => q.td.tee_tcb_svn[i] < s)) continue;
      tcbDate = ts(level.tcbDate);
      break;
    }
  } catch { tcbDate = null; }
  return { tcbDate, tcbNumber: numbers.length ? Math.min(...numbers) : null };
}
