// Verification policies: the same YAML file `cvm-tune verify --policy` reads (docs/verifier.md, "Policy file").
import { parse as parseYaml } from "yaml";
import { unhex } from "./util.js";

// Intel's SGX root CA (SHA-256 of the DER 44a0196b2b99f889b8e149e95b807a350e7424964399e885a7cbb8ccfab674d3).
export const INTEL_ROOT_DER = unhex("3082028f30820234a003020102021422650cd65a9d3489f383b49552bf501b392706ac300a06082a8648ce3d0403023068311a301806035504030c11496e74656c2053475820526f6f74204341311a3018060355040a0c11496e74656c20436f72706f726174696f6e3114301206035504070c0b53616e746120436c617261310b300906035504080c024341310b3009060355040613025553301e170d3138303532313130343531305a170d3439313233313233353935395a3068311a301806035504030c11496e74656c2053475820526f6f74204341311a3018060355040a0c11496e74656c20436f72706f726174696f6e3114301206035504070c0b53616e746120436c617261310b300906035504080c024341310b30090603550406130255533059301306072a8648ce3d020106082a8648ce3d030107034200040ba9c4c0c0c86193a3fe23d6b02cda10a8bbd4e88e48b4458561a36e705525f567918e2edc88e40d860bd0cc4ee26aacc988e505a953558c453f6b0904ae7394a381bb3081b8301f0603551d2304183016801422650cd65a9d3489f383b49552bf501b392706ac30520603551d1f044b30493047a045a043864168747470733a2f2f6365727469666963617465732e7472757374656473657276696365732e696e74656c2e636f6d2f496e74656c534758526f6f7443412e646572301d0603551d0e0416041422650cd65a9d3489f383b49552bf501b392706ac300e0603551d0f0101ff04040302010630120603551d130101ff040830060101ff020101300a06082a8648ce3d0403020349003046022100e5bfe50911f92f428920dc368a302ee3d12ec5867ff622ec6497f78060c13c20022100e09d25ac7a0cb3e5e8e68fec5fa3bd416c47440bd950639d450edcbea4576aa2");

export const TCB_STATUSES = ["UpToDate", "SWHardeningNeeded", "ConfigurationNeeded", "ConfigurationAndSWHardeningNeeded",
  "OutOfDate", "OutOfDateConfigurationNeeded", "TDRelaunchAdvised", "TDRelaunchAdvisedConfigurationNeeded"];
const BOOT_EVENTS = ["system-preparing", "app-id", "compose-hash", "instance-id", "boot-mr-done", "mr-kms",
  "os-image-hash", "key-provider", "storage-fs", "system-ready", "init-script-hash", "gpu-policy-hash", "gpu-attestation",
  "app-epoch"];
// app-compose findings a policy may accept by name (attestation/policy.py COMPOSE_FINDINGS).
export const COMPOSE_FINDINGS = ["init_script", "gpu_policy.attest_gpu", "gpu_policy.allow_devtools", "gpu_policy.allow_debug",
  "gpu_policy.allow_insecure_boot"];
const APP_EVENTS = ["run.start", "run.resume", "gpu.evidence", "train.batch", "train.done", "export", "checkpoint",
  "checkpoint.rejected", "run.abort", "privacy.spent", "promote"].map((t) => "cvm-tune." + t);

export const DEFAULT_POLICY = Object.freeze({
  schema_version: 1, name: "default", trusted_root: "intel", allowed_tcb_statuses: ["UpToDate"], denied_advisories: [],
  expected_mrtd: [], expected_rtmr0: [], expected_rtmr1: [], expected_rtmr2: [], compose_hashes: [], app_ids: [],
  require_rtmr3_audit: false, require_audit_anchors: false, outofdate_grace_period_s: 0, min_tcb_evaluation_data_number: null, max_epsilon: null,
  max_delta: null, allowed_compose_findings: [], expected_gpu_policy_hashes: [], allowed_boot_events: BOOT_EVENTS,
  allowed_app_events: APP_EVENTS,
});

export class PolicyError extends Error {}

const list = (re, what) => (v) => Array.isArray(v) && v.every((x) => typeof x === "string" && re.test(x)) || `must be a list of ${what}`;
const RULES = {
  schema_version: (v) => v === 1 || "must be 1",
  name: (v) => typeof v === "string" || "must be a string",
  trusted_root: (v) => v === "intel" || rootProblem(v) || true,
  allowed_tcb_statuses: (v) => (Array.isArray(v) && v.length >= 1 && v.every((s) => TCB_STATUSES.includes(s))) || "must list known TCB statuses",
  denied_advisories: list(/^/, "strings"),
  expected_mrtd: list(/^[0-9a-f]{96}$/, "96 lowercase hex characters"),
  expected_rtmr0: list(/^[0-9a-f]{96}$/, "96 lowercase hex characters"),
  expected_rtmr1: list(/^[0-9a-f]{96}$/, "96 lowercase hex characters"),
  expected_rtmr2: list(/^[0-9a-f]{96}$/, "96 lowercase hex characters"),
  compose_hashes: list(/^[0-9a-f]{64}$/, "64 lowercase hex characters"),
  app_ids: list(/^[0-9a-f]{40}$/, "40 lowercase hex characters"),
  require_rtmr3_audit: (v) => typeof v === "boolean" || "must be true or false",
  require_audit_anchors: (v) => typeof v === "boolean" || "must be true or false",
  outofdate_grace_period_s: (v) => (Number.isInteger(v) && v >= 0 && v <= 90 * 86400) || "must be 0 to 7776000",
  min_tcb_evaluation_data_number: (v) => v === null || (Number.isInteger(v) && v >= 1) || "must be null or >= 1",
  max_epsilon: (v) => v === null || (typeof v === "number" && v > 0) || "must be null or > 0",
  max_delta: (v) => v === null || (typeof v === "number" && v > 0 && v < 1) || "must be null or in (0, 1)",
  allowed_compose_findings: (v) => (Array.isArray(v) && v.every((x) => COMPOSE_FINDINGS.includes(x))) || `must list known findings (${COMPOSE_FINDINGS.join(", ")})`,
  expected_gpu_policy_hashes: list(/^[0-9a-f]{64}$/, "64 lowercase hex characters"),
  allowed_boot_events: list(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/, "event names"),
  allowed_app_events: list(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/, "event names"),
};

function rootProblem(v) {
  if (!v || typeof v !== "object" || Array.isArray(v)) return "must be 'intel' or {name, der_hex, test_only}";
  const extra = Object.keys(v).filter((k) => !["name", "der_hex", "test_only"].includes(k));
  if (extra.length) throw new PolicyError(`trusted_root.${extra[0]}: unknown field`);
  if (typeof v.name !== "string" || !v.name) throw new PolicyError("trusted_root.name: required");
  if (typeof v.der_hex !== "string" || !/^([0-9a-f]{2})+$/.test(v.der_hex)) throw new PolicyError("trusted_root.der_hex: hex required");
  if ("test_only" in v && typeof v.test_only !== "boolean") throw new PolicyError("trusted_root.test_only: true or false");
  return null;
}

/** A policy from YAML text (the default policy for null). */
export function loadPolicy(text) {
  if (text === null) return { ...DEFAULT_POLICY, rootDer: INTEL_ROOT_DER, testRoot: false };
  let data;
  try { data = parseYaml(text, { maxAliasCount: 100 }); } catch (e) { throw new PolicyError(`policy is not YAML: ${e.message.split("\n")[0]}`); }
  if (!data || typeof data !== "object" || Array.isArray(data)) throw new PolicyError("policy must be a YAML mapping");
  for (const [k, v] of Object.entries(data)) {
    if (!(k in RULES)) throw new PolicyError(`${k}: unknown field`);
    const ok = RULES[k](v);
    if (ok !== true) throw new PolicyError(`${k}: ${ok}`);
  }
  const p = { ...DEFAULT_POLICY, ...data };
  const custom = p.trusted_root !== "intel";
  return { ...p, rootDer: custom ? unhex(p.trusted_root.der_hex) : INTEL_ROOT_DER, testRoot: custom && p.trusted_root.test_only !== false };
}
