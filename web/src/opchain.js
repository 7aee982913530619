// op_chain.ops (verifier-spec §15): the client's JSONL record of its ops must hash to the checkpoint's op-chain head.
import { Num, canonical, concat, enc, hex, isObj, parseJsonExact, sha256, unhex, utf8 } from "./util.js";

const TAG = enc.encode("cvm-tune-op-chain-v1:");
const GENESIS = "0".repeat(64);
const LOAD_KEYS = ["op", "checkpoint", "checkpoint_head", "checkpoint_ops", "weights_sha256", "optimizer", "model_head"];

class OpChainError extends Error {}

function pack(fmt, values, what) {
  if (!Array.isArray(values)) throw new OpChainError(`${what}: a list of numbers is required`);
  const size = { i: 4, q: 8, f: 4, d: 8 }[fmt];
  const out = new DataView(new ArrayBuffer(size * values.length));
  values.forEach((v, n) => {
    const bad = () => new OpChainError(`${what}: not a list of ${"iq".includes(fmt) ? "integers" : "finite numbers"} in range`);
    if (!(v instanceof Num)) throw bad();
    if ("iq".includes(fmt)) {
      if (!v.isInt) throw bad();
      const x = BigInt(v.text);
      if (fmt === "i") { if (x < -(2n ** 31n) || x >= 2n ** 31n) throw bad(); out.setInt32(n * 4, Number(x), true); }
      else { if (x < -(2n ** 63n) || x >= 2n ** 63n) throw bad(); out.setBigInt64(n * 8, x, true); }
    } else {
      const x = v.isInt ? Number(BigInt(v.text)) : v.value;
      if (!Number.isFinite(x)) throw bad();
      if (fmt === "f") { if (!Number.isFinite(Math.fround(x)) && Math.abs(x) > 3.4028235677973366e38) throw bad(); out.setFloat32(n * 4, x, true); }
      else out.setFloat64(n * 8, x, true);
    }
  });
  return hex(new Uint8Array(out.buffer));
}

const hex64 = (v, what) => {
  if (typeof v !== "string" || !/^[0-9a-f]{64}$/.test(v)) throw new OpChainError(`load: ${what} must be 64 lower-case hex digits`);
  return v;
};

function loadDoc(op) {
  const unknown = Object.keys(op).filter((k) => !LOAD_KEYS.includes(k)).sort();
  if (unknown.length) throw new OpChainError(`load: unknown field '${unknown[0]}'`);
  const n = op.checkpoint_ops;
  if (!(n instanceof Num) || !n.isInt || BigInt(n.text) < 0n || BigInt(n.text) >= 2n ** 63n) throw new OpChainError("load: checkpoint_ops must be an integer in 0..2^63-1");
  if (typeof op.checkpoint !== "string" || !op.checkpoint.length || op.checkpoint.length > 512) throw new OpChainError("load: checkpoint must be the loaded state's path (1 to 512 characters)");
  if (typeof op.optimizer !== "boolean") throw new OpChainError("load: optimizer must be true or false");
  return { op: "load", checkpoint: op.checkpoint, checkpoint_head: hex64(op.checkpoint_head, "checkpoint_head"), checkpoint_ops: n,
    weights_sha256: hex64(op.weights_sha256, "weights_sha256"), optimizer: op.optimizer, model_head: hex64(op.model_head, "model_head") };
}

function canonicalOp(op) {
  if (!isObj(op) || !["forward_backward", "optim_step", "load"].includes(op.op)) throw new OpChainError("op must be one of forward_backward, optim_step, load");
  let doc;
  if (op.op === "load") doc = loadDoc(op);
  else if (op.op === "optim_step") {
    if (!isObj(op.adam_params)) throw new OpChainError("optim_step needs adam_params (an object)");
    doc = { op: "optim_step", adam_params: Object.fromEntries(Object.entries(op.adam_params).map(([k, v]) => [k, pack("d", [v], `adam_params.${k}`)])) };
    if (op.dp_epsilon != null) doc.dp_epsilon = pack("d", [op.dp_epsilon], "dp_epsilon");
  } else {
    const cfg = op.loss_fn_config ?? null;
    if (typeof op.loss_fn !== "string" || !Array.isArray(op.data)) throw new OpChainError("forward_backward needs loss_fn (a string) and data (a list)");
    if (cfg !== null && !isObj(cfg)) throw new OpChainError("loss_fn_config must be an object");
    const data = op.data.map((d, i) => {
      const inputs = isObj(d) ? (d.loss_fn_inputs ?? {}) : null;
      if (!isObj(d) || !isObj(inputs)) throw new OpChainError(`data[${i}] must be an object with model_input and loss_fn_inputs`);
      return {
        loss_fn_inputs: Object.fromEntries(Object.entries(inputs).map(([k, v]) => [k, pack(k === "target_tokens" ? "q" : "f", v, `data[${i}].loss_fn_inputs.${k}`)])),
        model_input: pack("i", d.model_input, `data[${i}].model_input`),
      };
    });
    doc = { op: "forward_backward", loss_fn: op.loss_fn, data, loss_fn_config: cfg === null ? null
      : Object.fromEntries(Object.entries(cfg).map(([k, v]) => [k, typeof v === "string" ? v : pack("d", [v], `loss_fn_config.${k}`)])) };
  }
  return enc.encode(canonical(doc, true));
}

function head(ops) {
  let h = GENESIS;
  ops.forEach((op, i) => {
    try {
      if (isObj(op) && op.op === "load") {
        const doc = loadDoc(op);
        if (doc.checkpoint_head !== h || Number(doc.checkpoint_ops.text) !== i) {
          throw new OpChainError(`it loads a state of ${doc.checkpoint_ops.text} ops with head ${doc.checkpoint_head.slice(0, 16)}…, but the ${i} ops before it hash to ${h.slice(0, 16)}…: record the saved state's own ops before its load line`);
        }
      }
      h = hex(sha256(concat(TAG, unhex(h), sha256(canonicalOp(op)))));
    } catch (e) {
      if (e instanceof OpChainError) throw new OpChainError(`op ${i + 1}: ${e.message}`);
      throw e;
    }
  });
  return h;
}

function readOps(bytes, source) {
  const text = utf8(bytes);
  if (text === null) throw new OpChainError(`cannot read ${source}: not UTF-8`);
  const ops = [];
  text.split(/\r\n|\r|\n/).forEach((line, n) => {
    if (!line.trim()) return;
    let op;
    try { op = parseJsonExact(line.trim()).value; } catch (e) { throw new OpChainError(`${source} line ${n + 1}: not JSON (${e.message})`); }
    if (!isObj(op)) throw new OpChainError(`${source} line ${n + 1}: not a JSON object`);
    ops.push(op);
  });
  return ops;
}

/** Each op that used a server-side custom loss names one the manifest holds, and each document there hashes to its
 * id: SHA-256 of its JSON with sorted keys, no spaces, non-ASCII escaped (verifier-spec §15). */
function customLossProblems(ops, losses) {
  const held = isObj(losses) ? losses : {};
  const problems = [];
  for (const [key, doc] of Object.entries(held)) {
    let id;
    try { id = hex(sha256(enc.encode(canonical(doc, true)))); } catch {
      problems.push(`custom loss ${key.slice(0, 16)}…: its document is not canonical JSON`);
      continue;
    }
    if (id !== key) problems.push(`custom loss ${key.slice(0, 16)}…: its document hashes to ${id.slice(0, 16)}…`);
  }
  ops.forEach((op, i) => {
    if (!isObj(op) || op.loss_fn !== "custom") return;
    const lid = isObj(op.loss_fn_config) ? op.loss_fn_config.loss_id : undefined;
    if (typeof lid !== "string" || !Object.prototype.hasOwnProperty.call(held, lid)) {
      problems.push(`op ${i + 1} uses custom loss ${(typeof lid === "string" ? lid : "None").slice(0, 16)}…, which the manifest does not hold`);
    }
  });
  return problems;
}

/** op_chain.ops for the ops file `bytes` (named `source` in reasons). */
export function opChainCheck(f, m, bytes, source = "the ops file") {
  const recorded = m ? m.op_chain : null;
  if (!recorded) { f.add("op_chain.ops", "fail", "the bundle records no op chain (not a training-API checkpoint)"); return; }
  let ops, got;
  try { ops = readOps(bytes, source); } catch (e) { f.add("op_chain.ops", "fail", e.message); return; }
  try { got = head(ops); } catch (e) { f.add("op_chain.ops", "fail", `${source}: ${e.message}`); return; }
  if (got !== recorded.head || ops.length !== recorded.ops) {
    f.add("op_chain.ops", "fail", `${ops.length} ops in ${source} hash to ${got.slice(0, 16)}…; the bundle records ${recorded.ops} ops with head ${recorded.head.slice(0, 16)}…`);
    return;
  }
  const problems = customLossProblems(ops, recorded.custom_losses);
  if (problems.length) { f.add("op_chain.ops", "fail", problems.slice(0, 3).join("; ")); return; }
  const n = isObj(recorded.custom_losses) ? Object.keys(recorded.custom_losses).length : 0;
  f.add("op_chain.ops", "pass", `${ops.length} ops in ${source} hash to the bundle's head ${got.slice(0, 16)}…` +
    (n ? `; ${n} custom loss(es), each hashing to its id` : ""));
}
