// op_chain.ops (verifier-spec §15): the client's JSONL record of its ops must hash to the checkpoint's op-chain head.
import { Num, canonical, concat, enc, hex, isObj, parseJsonExact, sha256, unhex } from "./util.js";

const TAG = enc.encode("cvm-tune-op-chain-v1:");
const GENESIS = "0".repeat(64);
const PREFIX = "tinker://";
const MAX_LINE = 16 * 1024 * 1024; // characters (code points) of one line
const MAX_LINE_DEPTH = 32; // an object or list and each value in it count one level (attestation/io/safe_yaml.depth)
const NODE_OPS = ["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"];
const utf8Strict = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }); // a BOM is kept: line 1 is then not JSON
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
      if (fmt === "f") { if (!Number.isFinite(Math.fround(x))) throw bad(); out.setFloat32(n * 4, x, true); } // rounds to ±inf: none
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
  const chars = typeof op.checkpoint === "string" ? [...op.checkpoint].length : 0; // code points, as Python's len
  if (!(chars > PREFIX.length && chars <= 512 && op.checkpoint.startsWith(PREFIX))) throw new OpChainError(`load: checkpoint must be the loaded state's path (${PREFIX}…, ${PREFIX.length + 1} to 512 characters)`);
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

/** Nesting of a parsed value as attestation/io/safe_yaml.depth counts it (a scalar 1, [] 1, [1] 2). */
function depth(v) {
  let deepest = 0;
  const stack = [[v, 1]];
  while (stack.length) {
    const [x, d] = stack.pop();
    deepest = Math.max(deepest, d);
    if (Array.isArray(x)) x.forEach((y) => stack.push([y, d + 1]));
    else if (isObj(x)) Object.values(x).forEach((y) => stack.push([y, d + 1]));
  }
  return deepest;
}

/** The ops of a JSONL file (verifier-spec §15): lines end at LF, CR LF or a lone CR; a line of only spaces and tabs
 * (or none) is skipped; every other line is one JSON object of at most MAX_LINE characters, nested at most
 * MAX_LINE_DEPTH levels, no member twice, no number of more than 400 characters. */
function readOps(bytes, source) {
  let text;
  try { text = utf8Strict.decode(bytes); } catch { throw new OpChainError(`cannot read ${source}: not UTF-8`); }
  const ops = [];
  text.split(/\r\n|\r|\n/).forEach((line, n) => {
    if (/^[ \t]*$/.test(line)) return;
    const what = `${source} line ${n + 1}`;
    if (line.length > MAX_LINE && [...line].length > MAX_LINE) throw new OpChainError(`${what}: longer than ${MAX_LINE} characters`);
    let parsed;
    try { parsed = parseJsonExact(line); } catch (e) { throw new OpChainError(`${what} is not valid JSON: ${e.message}`); }
    if (parsed.dupes) throw new OpChainError(`${what} is not valid JSON: a member given twice`);
    if (depth(parsed.value) > MAX_LINE_DEPTH) throw new OpChainError(`${what}: nested more than ${MAX_LINE_DEPTH} levels`);
    if (!isObj(parsed.value)) throw new OpChainError(`${what}: not a JSON object`);
    ops.push(parsed.value);
  });
  return ops;
}

const keysAre = (o, keys) => isObj(o) && Object.keys(o).length === keys.length && keys.every((k) => Object.prototype.hasOwnProperty.call(o, k));
const intIn = (v, ...vals) => (v instanceof Num ? v.isInt && vals.includes(Number(v.text))
  : Number.isInteger(v) && vals.includes(v)); // a plain number only where no exact manifest was given

/** Why `doc` (parsed with Num) is not a custom-loss document in the form the server records; null when it is. */
function documentProblem(doc) {
  if (!keysAre(doc, ["name", "inputs", "graph"]) || typeof doc.name !== "string") return "it is not exactly {name, inputs, graph} with a string name";
  if (!Array.isArray(doc.inputs) || doc.inputs.some((i) => !keysAre(i, ["name", "rank"]) || typeof i.name !== "string" || !intIn(i.rank, 0, 1, 2))) {
    return "inputs is not a list of exactly {name, rank} (rank 0, 1 or 2)";
  }
  const g = doc.graph;
  if (!keysAre(g, ["format", "nodes"]) || !intIn(g.format, 1) || !Array.isArray(g.nodes)) return "graph is not exactly {format: 1, nodes: [...]}";
  const bad = g.nodes.findIndex((node) => !keysAre(node, ["op", "name", "target", "args", "kwargs"]) || !NODE_OPS.includes(node.op)
    || typeof node.name !== "string" || typeof node.target !== "string" || !Array.isArray(node.args) || !isObj(node.kwargs));
  return bad < 0 ? null : `graph node ${bad} is not exactly {op, name, target, args (a list), kwargs (an object)}`;
}

/** A DP-SGD model's every optim_step carries dp_epsilon, the last one op_chain.dp.epsilon; a model without op_chain.dp
 * has none (attestation/outputs/op_chain.dp_problems). */
function dpProblems(ops, dp) {
  const steps = [];
  ops.forEach((op, i) => { if (isObj(op) && op.op === "optim_step") steps.push([i + 1, op]); });
  const has = (op) => op.dp_epsilon !== undefined && op.dp_epsilon !== null;
  if (!dp) {
    const at = steps.find(([, op]) => has(op));
    return at ? [`op ${at[0]}: an optim_step with dp_epsilon, but the bundle records no op_chain.dp (trained without DP-SGD)`] : [];
  }
  const missing = steps.find(([, op]) => !has(op));
  if (missing) return [`op ${missing[0]}: an optim_step without dp_epsilon, but the model was trained with DP-SGD (op_chain.dp)`];
  const eps = isObj(dp) ? dp.epsilon : undefined;
  const value = (v) => (v instanceof Num ? v.value : v);
  if (steps.length && typeof value(eps) === "number" && value(steps[steps.length - 1][1].dp_epsilon) !== value(eps)) {
    const [i, op] = steps[steps.length - 1];
    return [`op ${i}: the last optim_step's dp_epsilon ${op.dp_epsilon.text} is not op_chain.dp.epsilon ${value(eps)}`];
  }
  return [];
}

/** Each op that used a server-side custom loss names one the manifest holds, and each document there hashes to its
 * id: SHA-256 of its JSON with sorted keys, no spaces, non-ASCII escaped (verifier-spec §15). */
function customLossProblems(ops, losses) {
  const held = isObj(losses) ? losses : {};
  const problems = [];
  for (const [key, doc] of Object.entries(held)) {
    const why = documentProblem(doc);
    if (why) { problems.push(`custom loss ${key.slice(0, 16)}…: ${why}`); continue; }
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

/** op_chain.ops for the ops file `bytes` (named `source` in reasons). `m`: the manifest (plain values); its
 * non-enumerable `exact` member, when present, is the manifest as parseJsonExact gave it (numbers as Num), from which
 * the custom-loss documents are hashed (a float such as 2.0 must print as Python prints it). */
export function opChainCheck(f, m, bytes, source = "the ops file") {
  const recorded = m ? m.op_chain : null;
  const exact = m && m.exact && isObj(m.exact.op_chain) ? m.exact.op_chain : recorded;
  if (!recorded) { f.add("op_chain.ops", "fail", "the bundle records no op chain (not a training-API checkpoint)"); return; }
  let ops, got;
  try { ops = readOps(bytes, source); } catch (e) { f.add("op_chain.ops", "fail", e.message); return; }
  try { got = head(ops); } catch (e) { f.add("op_chain.ops", "fail", `${source}: ${e.message}`); return; }
  if (got !== recorded.head || ops.length !== recorded.ops) {
    f.add("op_chain.ops", "fail", `${ops.length} ops in ${source} hash to ${got.slice(0, 16)}…; the bundle records ${recorded.ops} ops with head ${recorded.head.slice(0, 16)}…`);
    return;
  }
  const problems = [...customLossProblems(ops, exact.custom_losses), ...dpProblems(ops, recorded.dp)];
  if (problems.length) { f.add("op_chain.ops", "fail", problems.slice(0, 3).join("; ")); return; }
  const n = isObj(recorded.custom_losses) ? Object.keys(recorded.custom_losses).length : 0;
  f.add("op_chain.ops", "pass", `${ops.length} ops in ${source} hash to the bundle's head ${got.slice(0, 16)}…` +
    (n ? `; ${n} custom loss(es), each hashing to its id` : ""));
}
