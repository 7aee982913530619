// compose-hash and MRCONFIGID (verifier-spec §3), and the cvm-tune service's image in app-compose.json.
import { parse as parseYaml } from "yaml";
import { concat, hex, keccak256, unhex, utf8 } from "./util.js";

const KIND_BYTE = { none: 0, local: 1, kms: 2, tpm: 3 };
const EVENT_KIND = { none: "none", "local-sgx": "local", local: "local", kms: "kms", tpm: "tpm" };

/** [ok, what was checked]: does MRCONFIGID bind this compose-hash (from measured values only)? */
export function checkMrConfigId(configId, composeHashHex, appIdHex, keyProviderEvent) {
  if (configId.every((x) => x === 0)) return [true, "MRCONFIGID is zero: the VMM did not bind the compose-hash (use_mrconfigid off); RTMR3 alone binds it"];
  const version = configId[0];
  if (version === 1) {
    const ok = hex(configId) === "01" + composeHashHex + "00".repeat(15);
    return [ok, `MRCONFIGID v1 ${ok ? "carries" : "does not carry"} the compose-hash`];
  }
  if (version !== 2) return [false, `MRCONFIGID version ${version} is not one dstack 0.5.x sets (1 or 2): cannot be checked`];
  let kind, want = null;
  try {
    const kp = JSON.parse(utf8(keyProviderEvent || new Uint8Array()) ?? "");
    kind = EVENT_KIND[kp.name];
    if (!kind) throw new Error(`unknown key provider ${kp.name}`);
    const id = unhex(String(kp.id || "").replace(/^0x/, ""));
    if (appIdHex) {
      const parts = [unhex(composeHashHex), unhex(appIdHex.replace(/^0x/, "")), new Uint8Array([KIND_BYTE[kind]]), id];
      if (parts.some((p) => !p)) throw new Error("compose-hash, app id and key_provider_id must be hex");
      want = "02" + hex(keccak256(concat(...parts))) + "00".repeat(15);
    }
  } catch (e) {
    return [false, `MRCONFIGID v2 needs the measured app-id and key-provider events: ${e.message}`];
  }
  const ok = want === hex(configId);
  return [ok, `MRCONFIGID v2 ${ok ? "matches" : "does not match"} keccak(compose-hash, app-id, ${kind} key provider id)`];
}

/** The image of service `name` in app-compose.json's docker-compose text; undefined when it cannot be read. */
export function serviceImage(appComposeBytes, name) {
  try {
    const doc = JSON.parse(utf8(appComposeBytes));
    if (typeof doc.docker_compose_file !== "string") return undefined;
    const svc = (parseYaml(doc.docker_compose_file).services || {})[name];
    return svc && typeof svc.image === "string" ? svc.image : null;
  } catch { return undefined; }
}
