// round.aggregate (verifier-spec §13; attestation/rounds/verify.py _aggregate and rounds/confidential.py load_plain):
// for FedAvg and FedProx the global adapter is recomputed as Σ weight · client adapter, tensor by tensor in the
// admitted order and in the tensors' own precision (float32: what numpy computes), and compared with
// numpy.allclose(rtol 1e-5, atol 1e-7). An encrypted update or global adapter is not opened in the page (it has no
// identity): the check is then skipped, as `cvm-tune verify` skips it without --identity.
import { WEIGHTS, storedName } from "./confidential.js";
import { DtypeLookupError, loadSafetensors, precisionOf, rounder } from "./safetensors.js";
import { manifestProblem, parseChecked } from "./schema.js";

const RECOMPUTABLE = ["fedavg", "fedprox"];
const RTOL = 1e-5, ATOL = 1e-7;

/** A client bundle's manifest as the cvm-tune/manifest/v1 model reads it, or null. */
export function clientManifest(raw) {
  try { return parseChecked(raw, manifestProblem); } catch { return null; }
}

class Sealed extends Error {}

/** [client tensors in admitted order, global tensors]; throws Sealed (a file the page cannot open), DtypeLookupError,
 * or any other Error (a file missing or not parsing). */
function load(b, m) {
  const open = (path, encrypted) => {
    const data = b.files.get(path);
    if (!data) throw new Error(`${path}: no such file`);
    if (encrypted) throw new Sealed(path);
    return loadSafetensors(data);
  };
  const clients = m.admitted.map((a) => {
    const cm = clientManifest(b.files.get(`clients/${a.client}/manifest.json`));
    if (!cm) throw new Error(`clients/${a.client}/manifest.json is missing or not a valid manifest`);
    const encrypted = cm.confidentiality != null;
    return open(`clients/${a.client}/${storedName(WEIGHTS, encrypted)}`, encrypted);
  });
  const secure = m.confidentiality != null;
  return [clients, open(storedName(WEIGHTS, secure), secure)];
}

/** Σ weight · tensors over the admitted clients, each operation rounded to the operands' precision. */
export function weightedSum(m, clients) {
  let total = null;
  m.admitted.forEach((a, i) => {
    const scaled = {};
    for (const [k, t] of Object.entries(clients[i])) {
      const bits = precisionOf(t.dtype), r = rounder(bits), w = r(a.weight);
      scaled[k] = { bits, shape: t.shape, values: t.values.map((v) => r(v * w)) };
    }
    if (total === null) { total = scaled; return; }
    for (const [k, t] of Object.entries(total)) {
      const s = scaled[k];
      if (!s) throw new Error(`KeyError: '${k}'`);
      if (s.shape.length !== t.shape.length || s.shape.some((d, j) => d !== t.shape[j])) throw new Error(`shapes ${t.shape} and ${s.shape} differ for ${k}`);
      const bits = Math.max(t.bits, s.bits), r = rounder(bits);
      total[k] = { bits, shape: t.shape, values: t.values.map((v, j) => r(v + s.values[j])) };
    }
  });
  return total;
}

/** numpy.allclose(x, y, rtol, atol): |x − y| ≤ atol + rtol·|y| (the right side in y's precision), or x == y. */
function allclose(x, y) {
  const ybits = precisionOf(y.dtype), rxy = rounder(Math.max(x.bits, ybits)), ry = rounder(ybits);
  return x.values.every((v, i) => {
    const w = y.values[i];
    return (Math.abs(rxy(v - w)) <= ry(ry(ATOL) + ry(ry(RTOL) * Math.abs(w))) && Number.isFinite(w)) || v === w;
  });
}

export function aggregateCheck(f, b, m) {
  if (!RECOMPUTABLE.includes(m.strategy.name)) {
    f.add("round.aggregate", "skip", `${m.strategy.name} keeps server-side optimizer state: the aggregate is attested by the aggregator's quote, not recomputed`);
    return;
  }
  let total, result;
  try {
    const [clients, global] = load(b, m);
    total = weightedSum(m, clients);
    result = global;
  } catch (e) {
    if (e instanceof Sealed || e instanceof DtypeLookupError) {
      f.add("round.aggregate", "skip", `${e.message} does not decrypt with the identities given: the aggregate is not recomputed; it rests on the aggregator's attested code (its quote binds this round manifest)`);
    } else f.add("round.aggregate", "fail", `cannot recompute the aggregate: ${String(e.message).slice(0, 100)}`);
    return;
  }
  const names = Object.keys(total).sort(), theirs = Object.keys(result).sort();
  let bad = [...names.filter((k) => !(k in result)), ...theirs.filter((k) => !(k in total))].sort();
  if (!bad.length) {
    bad = names.filter((k) => {
      const t = total[k], g = result[k];
      return t.shape.length !== g.shape.length || t.shape.some((d, j) => d !== g.shape[j]) || !allclose(t, g);
    });
  }
  f.add("round.aggregate", bad.length ? "fail" : "pass", bad.length ? `${bad.length} tensor(s) differ from the weighted mean of the client adapters, e.g. ${bad[0]}`
    : `global adapter = weighted mean of ${m.admitted.length} client adapters (${names.length} tensors recomputed)`);
}
