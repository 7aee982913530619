// confidential.outputs (verifier-spec §14, C1): what anyone can check without an identity. Every weight file is an
// age v1 file with one X25519 stanza per listed recipient, none left in plaintext, the dataset's recipients listed.
import { enc } from "./util.js";

const MAGIC = enc.encode("age-encryption.org/v1\n");
const LIMIT = 1 << 16;

const isWeight = (rel) => { const p = rel.split("/"); return p.length === 2 && ["adapter", "merged"].includes(p[0]) && p[1].endsWith(".safetensors"); };

/** X25519 stanzas in an age v1 header (grease ignored); null when not a well-formed age v1 header. */
function x25519Stanzas(data) {
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
  const problems = [];
  const weights = new Set([...Object.keys(m.files).filter(isWeight), "adapter/adapter_model.safetensors"]);
  const clear = [...weights].filter((r) => !(r in info.plaintext_sha256)).sort();
  if (clear.length) problems.push(`weight file(s) not encrypted: [${clear.slice(0, 3).map((r) => `'${r}'`).join(", ")}]`);
  const odd = Object.keys(info.plaintext_sha256).filter((r) => !(r in m.files)).sort();
  if (odd.length) problems.push(`plaintext hashes for files the manifest does not list: [${odd.slice(0, 3).map((r) => `'${r}'`).join(", ")}]`);
  for (const rel of Object.keys(info.plaintext_sha256).filter((r) => r in m.files).sort()) {
    const n = x25519Stanzas(b.files.get(rel));
    if (n === null) problems.push(`${rel} is not an age v1 file to X25519 recipients`);
    else if (n !== info.recipients.length) problems.push(`${rel} has ${n} X25519 stanzas, not one per listed recipient (${info.recipients.length})`);
  }
  const dsr = info.dataset_recipients || [];
  const missing = dsr.filter((r) => !info.recipients.includes(r)).sort();
  if (missing.length) problems.push(`dataset recipient(s) missing: [${missing.slice(0, 3).map((r) => `'${r}'`).join(", ")}]`);
  if (problems.length) return ["fail", problems.slice(0, 4).join("; ")];
  const extra = info.recipients.length - dsr.length - 1;
  return ["pass", `${Object.keys(info.plaintext_sha256).length} weight file(s) are age ciphertext to ${info.recipients.length} recipient(s): ${dsr.length} named by the dataset's owner, ${extra} added by the operator's configuration, the CVM's key`];
}
