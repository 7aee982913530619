"""Operator tooling for dstack: the deployable compose + app-compose.json, and encrypted environment variables.

* :func:`render_deployment`: the repository's ``docker-compose.yaml`` with the pushed image's digest put in place
  of the placeholder, and the ``app-compose.json`` dstack will measure (``attestation.compose.app_compose``), refused when the
  audit finds anything (unpinned image, public logs, secrets in clear, socket in two containers).
* :func:`encrypt_env`: dstack's encrypted environment, made with the SDK's own ``encrypt_env_vars_sync``
  (dstack-sdk 0.5.4: X25519 + AES-256-GCM to the CVM's env public key). dstack checks names against the
  app-compose ``allowed_envs`` and its limits (``dstack-util/src/parse_env_file.rs``); so does this module, before
  anything leaves the operator's machine.

Encrypted env values are confidential but **not authentic**: the env public key is public, so the host can replace
the whole blob with values it encrypted itself (dstack ``docs/security/security-best-practices.md``). Nothing that
decides what data is trained on may rest on an env value alone: the dataset key delivered by env must carry the
data owner's signature (or match a hash pinned in the measured config), which the app checks before use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from attestation.compose import app_compose as C
from attestation.compose.audit import audit as compose_audit

from app.service.bundles import TOKEN_ENV, read_token, token_sha256
from app.errors import ConfigError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # dstack-util/src/parse_env_file.rs
MAX_ENV_VARS, MAX_NAME, MAX_VALUE, MAX_TOTAL = 1024, 255, 128 << 10, 1 << 20


@dataclass(frozen=True)
class Deployment:
    """What ``cvm-tune app-compose`` writes, and the identities dstack will measure."""

    docker_compose: str
    app_compose: bytes
    compose_hash: str
    app_id: str | None


def render_deployment(template: str, image: str, settings: C.AppComposeSettings, *, bundles_token_sha256: str | None,
                      style: C.Style = "vmm-cli") -> Deployment:
    """Put ``image`` and the bundle token's hash into the template and render app-compose.json.

    Every service that used the template's image gets ``image`` (the bundle server runs the same image).
    ``allowed_envs`` = the pass-through variables of the compose (``- NAME`` without a value) + ``settings``'.

    Raises:
        ConfigError: ``image`` is not pinned by digest, the template has no cvm-tune service, a placeholder is left,
            or the audit fails.
    """
    if C.image_digest(image) in (None, C.PLACEHOLDER_DIGEST):
        raise ConfigError(f"image {image!r} is not pinned by digest",
                          fix="pass the pushed image as REGISTRY/NAME@sha256:<64 hex> (docker buildx imagetools inspect)")
    try:
        svcs = C.services(template)
    except C.ComposeError as exc:
        raise ConfigError(exc.message) from exc
    old = svcs.get(C.SERVICE, {}).get("image")
    if not isinstance(old, str):
        raise ConfigError(f"the compose file has no `{C.SERVICE}` service with an image", fix="use the repository's docker-compose.yaml")
    text = template.replace(f"image: {old}\n", f"image: {image}\n")
    placeholder = f"{TOKEN_ENV}={'0' * 64}"
    if placeholder in text:
        if not re.fullmatch(r"[0-9a-f]{64}", bundles_token_sha256 or "") or bundles_token_sha256 == "0" * 64:
            raise ConfigError("the bundle server needs the SHA-256 of your bearer token",
                              fix="run `cvm-tune bundles token FILE` and pass the file with --bundles-token FILE")
        text = text.replace(placeholder, f"{TOKEN_ENV}={bundles_token_sha256}")
    pinned = set(re.findall(rf"{TOKEN_ENV}=([0-9a-fA-F]*)", text))
    if bundles_token_sha256 is not None and pinned and pinned != {bundles_token_sha256}:
        raise ConfigError(f"the compose pins {TOKEN_ENV}={sorted(pinned)[0][:12]}…, not the hash of your token",
                          fix="start from the repository's docker-compose.yaml (placeholder hash) or pass the token it pins")
    if not re.fullmatch(r"(0x)?([0-9a-fA-F]{2})*", settings.key_provider_id):
        raise ConfigError(f"key_provider_id {settings.key_provider_id[:20]!r} is not hex",
                          fix="pass the key provider's id in hex (KMS: its root CA public key, as the key-provider event shows)")
    svcs = C.services(text)
    passthrough = {n for svc in svcs.values() for n, v in C.env_entries(svc).items() if v is None}
    allowed = tuple(sorted(passthrough | set(settings.allowed_envs)))
    settings = C.AppComposeSettings(**{**settings.__dict__, "allowed_envs": allowed})
    raw = C.render(text, settings, style=style)
    doc = C.load(raw)
    if problems := compose_audit(doc):
        raise ConfigError("the app-compose would fail its audit: " + "; ".join(problems),
                          fix="fix docker-compose.yaml (see docs/deploy.md)")
    digest = C.compose_hash(raw)
    return Deployment(text, raw, digest, C.app_id(doc, digest))


def bundles_token_sha256(token_file: Path | None, given_sha256: str | None) -> str | None:
    """The token hash to pin: from the token file (``cvm-tune bundles token FILE``) and/or as given.

    Raises:
        ConfigError: a given hash that is not 64 lowercase hex, or not the hash of the token in ``token_file``.
    """
    if given_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", given_sha256):
        raise ConfigError("--bundles-token-sha256 must be 64 lowercase hex (the SHA-256 `cvm-tune bundles token` printed)")
    if token_file is None:
        return given_sha256
    digest = token_sha256(read_token(token_file))
    if given_sha256 is not None and given_sha256 != digest:
        raise ConfigError(f"--bundles-token-sha256 {given_sha256[:12]}… is not the SHA-256 of the token in {token_file}",
                          fix="pass only --bundles-token FILE (the hash is computed from it)")
    return digest


def describe(dep: Deployment, pinned_app_id: str | None) -> list[str]:
    """What ``cvm-tune app-compose`` prints: compose-hash, app-id (or why there is none yet), MRCONFIGID."""
    doc = C.load(dep.app_compose)
    app_id = dep.app_id or (pinned_app_id.lower().removeprefix("0x") if pinned_app_id else None)
    if app_id is not None and not re.fullmatch(r"[0-9a-f]{40}", app_id):
        raise ConfigError(f"--app-id {pinned_app_id!r} is not 20 bytes of hex", fix="pass the app id `phala deploy` printed")
    form, mr = C.expected_mr_config_id(doc, dep.compose_hash, app_id)
    lines = [f"compose-hash  {dep.compose_hash}"]
    if app_id:
        lines.append(f"app-id        {app_id}" + ("" if dep.app_id else " (pinned by your KMS deployment)"))
    else:
        lines.append("app-id        not in the file: with KMS the deployment assigns it (Phala Cloud prints it after "
                     "`phala deploy`; dstack-vmm: `vmm-cli.py deploy --app-id`)"
                     + ("; pass it with --app-id for MRCONFIGID v2" if form == "v2" else ""))
    what = C.MR_CONFIG_V3 if form == "v3" else mr or "(needs the app id)"
    lines.append(f"mr_config_id  {form} {what} ({C.MR_CONFIG_WHEN})")
    return lines


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines (``#`` comments and blank lines skipped; the value is everything after the first ``=``).

    Raises:
        ConfigError: unreadable file or a line without ``=``.
    """
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read env file {path}: {exc}") from exc
    out = {}
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise ConfigError(f"{path}:{n}: expected NAME=value")  # never echo the line: it may hold a secret
        out[name.strip()] = value
    return out


def check_env(values: dict[str, str], allowed_envs: list[str] | None) -> None:
    """dstack's limits and, given the app-compose's ``allowed_envs``, that every name will be kept.

    Raises:
        ConfigError: a name or size dstack would reject, or a name it would drop (not in allowed_envs).
    """
    if not values:
        raise ConfigError("no environment variables to encrypt")
    if len(values) > MAX_ENV_VARS:
        raise ConfigError(f"{len(values)} variables (dstack keeps at most {MAX_ENV_VARS})")
    total = 0
    for name, value in values.items():
        if not ENV_NAME.match(name) or len(name) > MAX_NAME:
            raise ConfigError(f"{name[:40]!r} is not a valid variable name for dstack")
        size = len(value.encode())
        if size > MAX_VALUE:
            raise ConfigError(f"{name}: value is {size} bytes (dstack limit {MAX_VALUE})")
        total += size
    if total > MAX_TOTAL:
        raise ConfigError(f"values total {total} bytes (dstack limit {MAX_TOTAL})")
    if allowed_envs is not None and (dropped := sorted(set(values) - set(allowed_envs))):
        raise ConfigError(f"{dropped} are not in the app-compose's allowed_envs: the CVM would drop them",
                          fix="add them as pass-through `- NAME` lines in docker-compose.yaml and regenerate app-compose.json")


def verify_public_key(public_key_hex: str, signature_hex: str, app_id: str, timestamp: int, kms_signer: str) -> None:
    """Check the KMS's signature on the env public key (dstack-sdk ``verify_env_encrypt_public_key``).

    Raises:
        ConfigError: bad signature, stale timestamp, or a signer other than ``kms_signer``.
    """
    from dstack_sdk import verify_env_encrypt_public_key

    try:
        signer = verify_env_encrypt_public_key(bytes.fromhex(public_key_hex.removeprefix("0x")),
                                               bytes.fromhex(signature_hex.removeprefix("0x")), app_id, timestamp)
    except ValueError as exc:
        raise ConfigError(f"public key or signature is not hex: {exc}") from exc
    if signer is None:
        raise ConfigError("the KMS signature on the env public key does not verify (or is older than 5 minutes)",
                          fix="fetch the key again (KMS GetAppEnvEncryptPubKey) with its signature_v1 and timestamp")
    if signer.lower().removeprefix("0x") != kms_signer.lower().removeprefix("0x"):
        raise ConfigError(f"the env public key was signed by {signer}, not by the KMS signer you pinned",
                          fix="do not encrypt secrets to this key: it does not come from your KMS")


def encrypt_env(values: dict[str, str], public_key_hex: str) -> str:
    """dstack's encrypted-env blob (hex) for ``values``, made by dstack-sdk.

    Raises:
        ConfigError: the public key is not a 32-byte X25519 key in hex.
    """
    from dstack_sdk import EnvVar, encrypt_env_vars_sync

    try:
        if len(bytes.fromhex(public_key_hex.removeprefix("0x"))) != 32:
            raise ValueError("not 32 bytes")
    except ValueError as exc:
        raise ConfigError(f"the env public key must be 32 bytes of hex (X25519): {exc}") from exc
    return encrypt_env_vars_sync([EnvVar(k, v) for k, v in values.items()], public_key_hex)
