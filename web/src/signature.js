// model.signature (verifier-spec §9): each signed directory's OpenSSF model signature (a Sigstore bundle whose DSSE
// envelope carries an in-toto statement of every file's SHA-256), ECDSA P-256 / SHA-256 checked with WebCrypto under
// the manifest's key, over exactly the files of the directory: what `model_signing verify key` does.
import { NOT_IMPLEMENTED } from "./messages.js";
import { concat, enc, hex, isObj, sha256, sha256hex, unhex, utf8 } from "./util.js";

const PREDICATE = "https://model_signing/signature/v1.0";
const PAYLOAD_TYPE = "application/vnd.in-toto+json";

const b64 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));

/** DER ECDSA signature -> the 64-byte r || s WebCrypto takes (null when it is not one). */
function derToRaw(der) {
  if (der.length < 8 || der[0] !== 0x30 || der[1] !== der.length - 2) return null;
  const out = new Uint8Array(64);
  let at = 2;
  for (let i = 0; i < 2; i++) {
    if (der[at] !== 0x02) return null;
    const len = der[at + 1];
    let v = der.subarray(at + 2, at + 2 + len);
    while (v.length > 32 && v[0] === 0) v = v.subarray(1);
    if (v.length > 32) return null;
    out.set(v, 32 * i + 32 - v.length);
    at += 2 + len;
  }
  return at === der.length ? out : null;
}

const BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json";

async function verifyDir(b, dir, pem) {
  const sigBytes = b.files.get(`${dir}/model.sig`);
  if (!sigBytes) return "missing";
  let bundle, payload, statement;
  try {
    bundle = JSON.parse(utf8(sigBytes));
    if (bundle.mediaType !== BUNDLE_MEDIA_TYPE) {  // model_signing's key verifier accepts this media type only
      return `Invalid sigstore bundle, got media type ${bundle.mediaType} but expected ${BUNDLE_MEDIA_TYPE}`;
    }
    const env = bundle.dsseEnvelope;
    payload = b64(env.payload);
    const hint = bundle.verificationMaterial && bundle.verificationMaterial.publicKey && bundle.verificationMaterial.publicKey.hint;
    if (hint && hint !== sha256hex(enc.encode(pem))) return "Key mismatch: The public key hash in the signature's verification material does not match the provided public key.";
    const raw = derToRaw(b64(env.signatures[0].sig));
    const spki = b64(pem.replace(/-----(BEGIN|END) PUBLIC KEY-----|\n/g, ""));
    const key = await crypto.subtle.importKey("spki", spki, { name: "ECDSA", namedCurve: "P-256" }, false, ["verify"]);
    const pae = concat(enc.encode(`DSSEv1 ${PAYLOAD_TYPE.length} ${PAYLOAD_TYPE} ${payload.length} `), payload);
    if (!raw || !(await crypto.subtle.verify({ name: "ECDSA", hash: "SHA-256" }, key, raw, pae))) return "InvalidSignature";
    statement = JSON.parse(utf8(payload));
  } catch (e) {
    return `not a model signature bundle: ${e.message}`;
  }
  if (statement.predicateType !== PREDICATE) return `${NOT_IMPLEMENTED}: predicate type ${statement.predicateType}`;
  const ser = statement.predicate && statement.predicate.serialization;
  if (!isObj(ser) || ser.method !== "files" || ser.hash_type !== "sha256") return `${NOT_IMPLEMENTED}: serialization ${JSON.stringify(ser)}`;
  if (!Array.isArray(statement.subject) || statement.subject.length !== 1) return "Expected only one subject";
  const signedFiles = new Map();
  const parts = [];
  for (const r of statement.predicate.resources || []) {
    const d = unhex(r.digest);
    if (r.algorithm !== "sha256" || !d) return "a resource is not a SHA-256 digest";
    parts.push(d);
    signedFiles.set(r.name, r.digest);
  }
  if (hex(sha256(concat(...parts))) !== statement.subject[0].digest.sha256) return "Manifest is inconsistent: the root digest does not cover the resources";
  const ignored = new Set(["model.sig", ...(ser.ignore_paths || [])]);
  const actual = new Map();
  for (const [path, bytes] of b.files) {
    if (!path.startsWith(dir + "/")) continue;
    const rel = path.slice(dir.length + 1);
    if (![...ignored].some((i) => rel === i || rel.startsWith(i + "/"))) actual.set(rel, sha256hex(bytes));
  }
  if (b.odd.some((p) => p.startsWith(dir + "/"))) return "the directory holds a symlink";
  const same = actual.size === signedFiles.size && [...actual].every(([k, v]) => signedFiles.get(k) === v);
  if (!same) {
    const changed = [...new Set([...actual.keys(), ...signedFiles.keys()])].filter((k) => actual.get(k) !== signedFiles.get(k)).sort();
    return `Signature mismatch: ${changed.slice(0, 3).join(", ")} ${changed.length > 1 ? "differ" : "differs"} from the signed manifest`;
  }
  return null;
}

export async function modelSignature(f, b, m) {
  const s = m.signing;
  if (!s) { f.add("model.signature", "skip", "the bundle predates model signatures (manifest has no signing)"); return; }
  const exported = new Set(Object.keys(m.files).filter((p) => p.startsWith("merged/")).map((p) => p.split("/")[0]));
  const problems = [...exported].filter((d) => !s.signed.includes(d)).sort().map((d) => `${d}/ is exported but not signed`);
  const legacy = s.key_path === "cvm-tune/model-signing/v1";
  const runPath = `cvm-tune/model-signing/v1/runs/${m.run_id}`;
  if (!legacy && s.key_path !== runPath) problems.push(`signing.key_path '${s.key_path}' is not this run's ('${runPath}')`);
  const unsupported = [];
  for (const d of s.signed) {
    const why = await verifyDir(b, d, s.public_key_pem);
    if (why && why.startsWith(NOT_IMPLEMENTED)) unsupported.push(`${d}/model.sig: ${why.slice(NOT_IMPLEMENTED.length + 2)}`);
    else if (why) problems.push(`${d}/model.sig: ${why}`);
  }
  if (!problems.length && unsupported.length) { f.add("model.signature", "skip", `${NOT_IMPLEMENTED}: ${unsupported.join("; ")}`); return; }
  const scope = legacy ? "the deployment's key (shared by its runs: made before per-run keys)" : "this run's key";
  f.add("model.signature", problems.length ? "fail" : "pass", problems.join("; ") || `${s.signed.map((d) => d + "/").join(", ")} signed by ${scope} (P-256, in the manifest)`);
}


