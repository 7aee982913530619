// The manifest's shape (cvm-tune/manifest/v1, attestation/bundle/manifest.py) and the round manifest's
// (cvm-tune/round-manifest/v1, attestation/rounds/manifest.py): closed objects, required members, types and patterns. Values come from parseJsonExact (numbers as Num, so 1 and 1.0 are told apart as Python does).
import { Num, isObj, parseJsonExact, plain, utf8 } from "./util.js";

const H64 = /^[0-9a-f]{64}$/;
const RUN_ID = /^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$/;
const RECIPIENT = /^age1[02-9ac-hj-np-z]{58}$/;

// Each spec is a function (value, path) -> error text or null.
const str = (re) => (v, p) => (typeof v !== "string" ? `${p}: must be a string` : re && !re.test(v) ? `${p}: does not match ${re}` : null);
const int = (min = -Infinity, max = Infinity) => (v, p) => (!(v instanceof Num) || !Number.isInteger(v.value) || v.value < min || v.value > max ? `${p}: must be an integer in range` : null);
const num = (ok = () => true) => (v, p) => (!(v instanceof Num) || !ok(v.value) ? `${p}: must be a number in range` : null);
const bool = (v, p) => (typeof v !== "boolean" ? `${p}: must be a boolean` : null);
const lit = (...vals) => (v, p) => (!vals.includes(v) ? `${p}: must be one of ${vals.join(", ")}` : null);
const opt = (spec) => Object.assign((v, p) => (v === null ? null : spec(v, p)), { inner: spec });
const list = (spec, min = 0) => Object.assign((v, p) => {
  if (!Array.isArray(v)) return `${p}: must be a list`;
  if (v.length < min) return `${p}: needs at least ${min} item(s)`;
  for (let i = 0; i < v.length; i++) { const e = spec(v[i], `${p}.${i}`); if (e) return e; }
  return null;
}, { inner: spec });
const dict = (spec, min = 0) => (v, p) => {
  if (!isObj(v)) return `${p}: must be an object`;
  if (Object.keys(v).length < min) return `${p}: needs at least ${min} member(s)`;
  for (const [k, x] of Object.entries(v)) { const e = spec(x, `${p}.${k}`); if (e) return e; }
  return null;
};
const pair = (v, p) => (Array.isArray(v) && v.length === 2 && !int()(v[0], p) && !num()(v[1], p) ? null : `${p}: must be [step, loss]`);
const any = () => null;

/** A closed object: `req` members required, `optional` members may be absent. */
function obj(req, optional = {}) {
  const check = (v, p) => {
    if (!isObj(v)) return `${p}: must be an object`;
    for (const k of Object.keys(v)) if (!(k in req) && !(k in optional)) return `${p}.${k}: extra inputs are not permitted`;
    for (const [k, spec] of Object.entries(req)) {
      if (!(k in v)) return `${p}.${k}: field required`;
      const e = spec(v[k], `${p}.${k}`);
      if (e) return e;
    }
    for (const [k, spec] of Object.entries(optional)) if (k in v) { const e = spec(v[k], `${p}.${k}`); if (e) return e; }
    return null;
  };
  return Object.assign(check, { members: { ...req, ...optional } });
}

const batchSizes = obj({ micro: int(), accumulation: int(), eval_micro: int() });
const GPU = obj({
  present: bool, nvidia_smi: lit("ok", "missing", "error"), devices: list(obj({ index: int(), name: str(), uuid: str(), pci_bus_id: str(), driver_version: str(), vbios_version: str() })),
  cc_mode: str(), cc_environment: opt(str()), ready_state: opt(str()), nonce: str(H64), evidence_sha256: str(H64),
  nvidia_report: opt(obj({ tool: lit("nvattest"), status: lit("ok", "error", "timeout", "unparseable") }, {
    result_code: opt(int()), result_message: opt(str()), overall: opt(bool), measres: dict(str()), nonce_match: opt(bool),
    consistent: opt(bool), signed: opt(bool), versions: dict(list(str())) })),
});

const CODE = obj({ package: str(), version: str(), source_sha256: str(H64) });
const TEE = obj({ mode: lit("embedded-simulator", "dstack"), app_id: str(/^[0-9a-f]{40}$/), instance_id: str(), compose_hash: str(H64), agent_version: str(), agent_rev: str() });

// op_chain.lora and .determinism values (pydantic's strict unions): an integer written as one (1.0 is none), else `or`.
const nil = (v, p) => (v === null ? null : `${p}: must be null`);
const strictInt = (...or) => (v, p) => (v instanceof Num && v.isInt ? null
  : or.every((spec) => spec(v, p)) ? `${p}: must be an integer${or.length ? " or of another allowed kind" : ""}` : null);

// op_chain.dp: each member of its JSON kind (attestation/outputs/op_chain.py OP_CHAIN_DP_MEMBERS); its numbers are privacy.dp's.
const DP_KINDS = { noise_multiplier: "number", max_grad_norm: "number", sample_rate: "number", delta: "number", epsilon: "number",
  dataset_size: "integer", batch_size: "integer", steps: "integer", accountant: "string" };
const dpMembers = (v, p) => {
  if (!isObj(v)) return `${p}: must be an object`;
  for (const [k, x] of Object.entries(v)) {
    const kind = Object.prototype.hasOwnProperty.call(DP_KINDS, k) ? DP_KINDS[k] : null;
    if (!kind) return `${p}.${k}: is not a member of op_chain.dp (${Object.keys(DP_KINDS).join(", ")})`;
    const ok = kind === "string" ? typeof x === "string" : x instanceof Num && (kind === "number" || x.isInt);
    if (!ok) return `${p}.${k}: must be ${kind === "integer" ? "an integer" : `a ${kind}`}`;
  }
  return null;
};

const MANIFEST = obj({
  run_id: str(RUN_ID), started_at: str(), created_at: str(),
  code: CODE,
  backend: obj({ name: lit("hf", "unsloth"), device: str(), libraries: dict(str()) }, { cpu_threads: opt(int(1)) }),
  base_model: obj({ name: str(), source: str(), tree_sha256: str(H64), files: dict(str()) }, { hub_id: opt(str()), revision: opt(str()) }),
  dataset: obj({
    dataset_id: str(), dataset_version: int(), format: str(), encrypted_sha256: str(H64), encrypted_size: int(),
    plaintext_sha256: str(H64), plaintext_size: int(), rows: int(), key_source: str(),
  }, {
    owner_public_key: opt(str(H64)), owner_key_id: opt(str(H64)), commitment: opt(str(H64)), validation: opt(dict(int())),
    plaintext_format: opt(lit("jsonl", "parquet", "arrow")), rows_sha256: opt(str(H64)),
  }),
  tee: TEE,
  training: obj({
    seed: int(), global_step: int(), resumed_from_step: opt(int()), losses: list(pair), train_runtime_s: num(), tokens_seen: opt(int()), effective_batch_size: int(),
  }, {
    batch: opt(obj({
      configured: obj({ micro: int(), accumulation: int(), auto: bool }), final: batchSizes, processes: int(), effective: int(),
      adjustments: list(obj({ phase: lit("train", "eval"), reason: lit("oom", "auto"), at_step: int(), from: batchSizes, to: batchSizes })),
    })),
    eval_losses: opt(list(pair)), objective: lit("sft", "dpo"),
    dpo: opt(obj({ beta: num((x) => x > 0), loss_type: lit("sigmoid", "hinge", "ipo"), reference: lit("base model (adapter disabled)") })),
  }),
  audit: obj({ head: str(H64), start_prev: str(H64), first_seq: int(), entries: int(), rtmr3: lit("emit_event", "unsupported") },
    { anchors: opt(int(0)) }),  // lines of audit-anchors.jsonl (anchors.js); absent or null: not anchored
  files: dict(str()),
}, {
  schema: lit("cvm-tune/manifest/v1"),
  gpu: opt(GPU),
  build: opt(obj({ image: opt(str()), image_digest: opt(str(/^sha256:[0-9a-f]{64}$/)), base_image: opt(str()), lock_file: opt(str()), lock_sha256: opt(str(H64)), lock_mismatches: list(str()) })),
  lineage: opt(obj({ parent_run_id: str(RUN_ID), parent_manifest_sha256: str(H64), parent_adapter_sha256: str(H64) })),
  evaluation: opt(obj({ metric: lit("loss", "dpo_loss"), rows: int(1), candidate_loss: num(), parent_loss: num(), parent: str(), max_regression: num((x) => x >= 0), promote: bool },
    { candidate_accuracy: opt(num((x) => x >= 0 && x <= 1)), parent_accuracy: opt(num((x) => x >= 0 && x <= 1)) })),
  signing: opt(obj({
    key_path: str(), public_key_pem: str(/^-----BEGIN PUBLIC KEY-----\n[A-Za-z0-9+/=\n]+-----END PUBLIC KEY-----\n$/),
    signed: (v, p) => list(lit("adapter", "merged"), 1)(v, p) || (v[0] !== "adapter" || new Set(v).size !== v.length ? `${p}: signed must start with 'adapter' and name each directory once` : null),
  }, { scheme: lit("model-signing/ec-key") })),
  privacy: opt(obj({
    mechanism: lit("dp-sgd"), sampling: lit("poisson"), library: obj({ opacus: str(), torch: str() }), max_grad_norm: num((x) => x > 0),
    noise_multiplier: num((x) => x > 0), noise_derived: bool, sample_rate: num((x) => x > 0 && x <= 1), expected_batch_size: int(1), rows: int(2), steps: int(0),
    accountant: lit("rdp", "prv"), epsilon: num((x) => x >= 0), delta: num((x) => x > 0 && x < 1), target_epsilon: num((x) => x > 0),
  })),
  federation: opt(obj({ round: int(1), nonce: str(H64) }, { global_adapter_sha256: opt(str(H64)), proximal_mu: num((x) => x >= 0) })),
  op_chain: opt(obj({ head: str(H64), ops: int(0), optimizer_steps: int(0), checkpoint: str(), lora: dict(strictInt(bool, nil)) },
    { schema: lit("cvm-tune/op-chain/v1"), adam_params: opt(dict(num())), dp: opt(dpMembers), determinism: opt(dict(strictInt(str()))),
      custom_losses: opt(dict(dict(any))) })),
  confidentiality: opt(obj({
    recipients: (v, p) => list(str(RECIPIENT), 1)(v, p) || sortedUnique(v, p), cvm_recipient: str(RECIPIENT),
    plaintext_sha256: dict(str(H64), 1),
  }, {
    scheme: lit("age-v1/x25519"), dataset_recipients: (v, p) => list(str(RECIPIENT))(v, p) || sortedUnique(v, p), cvm_key_path: str(),
  })),
});

// cvm-tune/round-manifest/v1 (attestation/rounds/manifest.py: RoundManifest)
const ROUND_MANIFEST = obj({
  federation_id: str(RUN_ID), round: int(1), nonce: str(H64), created_at: str(), code: CODE, tee: TEE,
  strategy: obj({ name: lit("fedavg", "fedprox", "fedyogi") }, { weighted_by: lit("trainable_tokens"), params: dict(num()) }),
  min_clients: int(1), global_adapter_sha256: str(H64),
  admitted: list(obj({
    client: str(RUN_ID), run_id: str(RUN_ID), manifest_sha256: str(H64), quote_sha256: str(H64), adapter_sha256: str(H64),
    trainable_tokens: int(1), weight: num((x) => x > 0 && x <= 1),
  }, { privacy_epsilon: opt(num((x) => x >= 0)), privacy_delta: opt(num((x) => x > 0 && x < 1)) }), 1),
  rejected: list(obj({ client: str(), node_id: int(), reason: str() })),
  files: dict(str()),
}, {
  schema: lit("cvm-tune/round-manifest/v1"), global_adapter_in_sha256: opt(str(H64)), previous_round_sha256: opt(str(H64)),
  aggregator_recipient: opt(str(RECIPIENT)),
  confidentiality: opt(obj({ recipients: list(str(), 1), plaintext_sha256: str(H64) }, { scheme: lit("age-v1/x25519") })),
});

function sortedUnique(v, p) {
  const s = [...new Set(v)].sort();
  return s.length === v.length && s.every((x, i) => x === v[i]) ? null : `${p}: recipients must be sorted and unique`;
}

/** Why `value` is not a cvm-tune/manifest/v1 manifest (null: it is). */
export function manifestProblem(value) {
  return MANIFEST(value, "manifest") || confidentialityProblem(value.confidentiality);
}

/** The confidentiality block's rules across its members (attestation/outputs/confidential.py ConfidentialityInfo). */
function confidentialityProblem(c) {
  if (c == null) return null;
  const weight = (rel) => /^(adapter|merged)\/[^/]*\.safetensors$/.test(rel);
  const stray = Object.keys(c.plaintext_sha256).find((rel) => !weight(rel));
  if (stray !== undefined) return `manifest.confidentiality: plaintext_sha256 must map weight files to SHA-256 hex, not '${stray}'`;
  if (!c.recipients.includes(c.cvm_recipient)) return "manifest.confidentiality: the CVM's recipient must be among the recipients";
  return null;
}

/** The document in `raw` as plain JS once `problem` (manifestProblem, roundManifestProblem) finds nothing wrong with
 * it; throws an Error saying why not. */
export function parseChecked(raw, problem) {
  const text = raw ? utf8(raw) : null;
  if (text === null) throw new Error("not UTF-8");
  const parsed = parseJsonExact(text);
  const why = problem(parsed.value);
  if (why) throw new Error(why);
  return plain(parsed.value);
}

/** Why `value` is not a cvm-tune/round-manifest/v1 manifest (null: it is). */
export function roundManifestProblem(value) {
  const why = ROUND_MANIFEST(value, "round-manifest");
  if (why) return why;
  // the aggregator fails a round that admitted fewer bundles than min_clients (attestation/rounds/verify.py _schema)
  const n = value.admitted.length, min = value.min_clients.value;
  return n < min ? `${n} client(s) admitted, fewer than min_clients ${min}` : null;
}

/** The members of every closed object the page knows, nested ({member: {its members}} or null for a leaf): what
 * tests/test_web_units.py compares with the Python models (`spec` "round": the round manifest's), so a new member
 * cannot go unnoticed. */
export function manifestMembers(spec = MANIFEST) {
  if (spec === "round") spec = ROUND_MANIFEST;
  while (spec.inner) spec = spec.inner;
  if (!spec.members) return null;
  return Object.fromEntries(Object.entries(spec.members).map(([k, v]) => [k, manifestMembers(v)]));
}
