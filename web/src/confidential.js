// confidential.outputs (verifier-spec §14, C1): what anyone can check without an identity. Every weight file is an
// age v1 file named <name>.age with one X25519 stanza per listed recipient, none left in plaintext, the dataset's
// recipients listed. Also the names (attestation/outputs/confidential.py): a confidential bundle holds each weight
// file only as <name>.age, a plaintext bundle never under such a name.
import { enc } from "./util.js";

const MAGIC = enc.encode("age-encryption.org/v1\n");
const LIMIT = 1 << 16;
const AGE = ".age";
export const WEIGHTS = "adapter/adapter_model.safetensors";

const isWeight = (rel) => { const p = rel.split("/"); return p.length === 2 && ["adapter", "merged"].includes(p[0]) && p[1].endsWith(".safetensors"); };
const ageName = (rel) => rel + AGE;
/** The weight file an age-ciphertext name stands for, or null. */
const plaintextName = (rel) => (rel.endsWith(AGE) && isWeight(rel.slice(0, -AGE.length)) ? rel.slice(0, -AGE.length) : null);
/** Where a bundle holds file `rel`: its .age name when it is a weight file of a confidential bundle. */
export const storedName = (rel, encrypted) => (encrypted && isWeight(rel) ? ageName(rel) : rel);

/** Weight files listed under the wrong name for the bundle's kind (cvm-tune's messages). */
export function namingProblems(files, encrypted) {
  const names = [...files].sort();
  if (encrypted) {
    return names.filter(isWeight).map((rel) => `${rel} is listed under its plaintext name, but the weights are encrypted (confidentiality): a confidential bundle holds that file as age ciphertext named ${ageName(rel)}`);
  }
  return names.filter((rel) => plaintextName(rel) !== null).map((rel) => `${rel} is an age ciphertext name, but the manifest has no confidentiality`);
}

/** X25519 stanzas in an age v1 header (grease ignored); null when not a well-formed age v1 header. */
export function x25519Stanzas(data) {
  if (!data || data.length < MAGIC.length || MAGIC.some((c, i) => data[i] !== c)) return null;
  const head = data.subarray(0, LIMIT);
  const text = String.fromCharCode(...head);
  const end = text.indexOf("\n--- ");
  if (end < 0 || text.indexOf("\n", end + 1) < 0) return null;
  let count = 0;
  for (const line of text.slice(MAGIC.length, end).split("\n")) {
    if (!line.startsWith("-> ")) continue;
    const kind = line.split(" ")[1] ?? "";
    if (kind === "X25519") count++;
    else if (!kind.endsWith("-grease")) return null;
  }
  return count;
}

/** [status, reason] of confidential.outputs (no --dataset in the page). */
export function confidentialOutputs(b, m) {
  const info = m.confidentiality;
  const problems = namingProblems(Object.keys(m.files), true);
  const sealed = new Set(Object.keys(m.files).map(plaintextName).filter((r) => r !== null));
  const list = (rels) => `[${rels.slice(0, 3).map((r) => `'${r}'`).join(", ")}]`;
  const clear = [...new Set([...sealed, WEIGHTS])].filter((r) => !(r in info.plaintext_sha256)).sort();
  if (clear.length) problems.push(`weight file(s) not encrypted: ${list(clear)}`);
  const odd = Object.keys(info.plaintext_sha256).filter((r) => !sealed.has(r)).sort();
  if (odd.length) problems.push(`plaintext hashes for files the manifest does not list: ${list(odd.map(ageName))}`);
  for (const age of Object.keys(info.plaintext_sha256).filter((r) => sealed.has(r)).map(ageName).sort()) {
    const n = x25519Stanzas(b.files.get(age));
    if (n === null) problems.push(`${age} is not an age v1 file to X25519 recipients`);
    else if (n !== info.recipients.length) problems.push(`${age} has ${n} X25519 stanzas, not one per listed recipient (${info.recipients.length})`);
  }
  const dsr = info.dataset_recipients || [];
  const missing = dsr.filter((r) => !info.recipients.includes(r)).sort();
  if (missing.length) problems.push(`dataset recipient(s) missing: [${missing.slice(0, 3).map((r) => `'${r}'`).join(", ")}]`);
  if (problems.length) return ["fail", problems.slice(0, 4).join("; ")];
  const extra = info.recipients.length - dsr.length - 1;
  return ["pass", `${Object.keys(info.plaintext_sha256).length} weight file(s) are age ciphertext to ${info.recipients.length} recipient(s): ${dsr.length} named by the dataset's owner, ${extra} added by the operator's configuration, the CVM's key`];
}
