"""dstack's app-compose.json: compose-hash, app-id, the exact file dstack's tools write, and what it will run.

Rules, from dstack's source (github.com/Dstack-TEE/dstack at tag v0.5.11):

* **compose-hash** = SHA-256 of the raw bytes of ``app-compose.json`` as the CVM reads them, never re-serialised
  (``dstack-util/src/system_setup.rs``, ``measure_app_info``: ``sha256_file(app_compose_file)``; issue #550). It is
  emitted to RTMR3 as the ``compose-hash`` boot event and set in MRCONFIGID (v1 = ``01 || compose_hash || 15 zero
  bytes``, ``dstack-types/src/mr_config.rs``).
* **app-id** (same function): the deployer's app id when one was given (Phala's on-chain KMS: the DstackApp contract
  address; ``vmm-cli.py deploy --app-id``), else ``compose_hash[:20]``; and when ``kms_enabled`` is false the emitted
  ``app-id`` event is always ``compose_hash[:20]``. So only a KMS deployment with a pinned app id cannot be derived
  from the file: :func:`app_id` returns None for ``kms_enabled`` true unless the caller says no id was pinned.
* **The file dstack's own tool writes** (``vmm/src/vmm-cli.py``, ``create_app_compose``): the fields below in that
  order, ``json.dumps(..., indent=4, ensure_ascii=False)``, UTF-8, no trailing newline. The SDK's
  ``get_compose_hash`` (``sdk/python/src/dstack_sdk/get_compose_hash.py``) hashes the *normalized* form instead
  (sorted keys, ``separators=(",", ":")``, ``ensure_ascii=False``; ``docs/normalized-app-compose.md``), which is
  what Phala Cloud shows; both are supported here, and either way the CVM hashes the bytes it was given.

Verified against real captures in ``tests/data/attestation/`` (a dstack 0.5.8 CVM's event log and Info).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from attestation.errors import AttestationError

SERVICE = "cvm-tune"  # the compose service that runs cvm-tune (its image is recorded in every manifest)
DSTACK_SOCKET = "/var/run/dstack.sock"
DIGEST_REF = re.compile(r"^(?P<name>[^@\s]+)@(?P<digest>sha256:[0-9a-f]{64})$")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
MAX_APP_COMPOSE = 1 << 20
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|WEBHOOK|PRIVATE", re.I)
Style = Literal["vmm-cli", "normalized"]


class ComposeError(AttestationError):
    """app-compose.json or its docker-compose text cannot be read."""

    default_fix = "pass the app-compose.json the CVM measured (Info's tcb_info.app_compose, or the file you deployed)"


def compose_hash(raw: bytes) -> str:
    """dstack's compose-hash: SHA-256 of the exact file bytes (hex)."""
    return hashlib.sha256(raw).hexdigest()


def mr_config_id_v1(compose_hash_hex: str) -> str:
    """MRCONFIGID V1, hex (all versions: ``attestation.mrconfig``)."""
    return "01" + compose_hash_hex + "00" * 15


def app_id(app_compose: dict[str, Any], compose_hash_hex: str, *, pinned_app_id: str | None = None) -> str | None:
    """The app-id the CVM will measure; None when a KMS deployment's id is assigned outside the file."""
    if not app_compose.get("kms_enabled", False):
        return compose_hash_hex[:40]
    return pinned_app_id.lower().removeprefix("0x") if pinned_app_id else None


def load(raw: bytes) -> dict[str, Any]:
    """Parse app-compose.json (a JSON object).

    Raises:
        ComposeError: not UTF-8 JSON, not an object, or too large.
    """
    if len(raw) > MAX_APP_COMPOSE:
        raise ComposeError(f"app-compose.json is {len(raw)} bytes (limit {MAX_APP_COMPOSE})")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ComposeError(f"app-compose.json is not UTF-8 JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ComposeError("app-compose.json must be a JSON object")
    return data


@dataclass(frozen=True)
class AppComposeSettings:
    """The fields ``vmm-cli.py compose`` sets, with cvm-tune's defaults (logs private, KMS keys)."""

    name: str = "cvm-tune"
    kms_enabled: bool = True
    gateway_enabled: bool = True
    local_key_provider_enabled: bool = False
    key_provider_id: str = ""
    public_logs: bool = False
    public_sysinfo: bool = False
    allowed_envs: tuple[str, ...] = ()
    no_instance_id: bool = False
    secure_time: bool = True
    key_provider: str | None = None
    pre_launch_script: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def render(docker_compose_text: str, s: AppComposeSettings, *, style: Style = "vmm-cli") -> bytes:
    """The app-compose.json bytes for a docker-compose file, as dstack's tools write them."""
    doc: dict[str, Any] = {
        "manifest_version": 2, "name": s.name, "runner": "docker-compose", "docker_compose_file": docker_compose_text,
        "kms_enabled": s.kms_enabled, "gateway_enabled": s.gateway_enabled,
        "local_key_provider_enabled": s.local_key_provider_enabled, "key_provider_id": s.key_provider_id,
        "public_logs": s.public_logs, "public_sysinfo": s.public_sysinfo, "allowed_envs": list(s.allowed_envs),
        "no_instance_id": s.no_instance_id, "secure_time": s.secure_time,
    }
    if s.key_provider:
        doc["key_provider"] = s.key_provider
    if s.pre_launch_script:
        doc["pre_launch_script"] = s.pre_launch_script
    doc.update(s.extra)
    if style == "normalized":
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return json.dumps(doc, indent=4, ensure_ascii=False).encode()


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built in; same results as SafeLoader


@dataclass(frozen=True)
class ParsedCompose:
    """A docker-compose text: its values (safe-loaded) and the line of every mapping key / list item (1-based)."""

    doc: dict[str, Any]
    lines: dict[tuple[Any, ...], int]
    text_lines: tuple[str, ...]
    duplicates: tuple[str, ...] = ()

    def at(self, *path: Any) -> str:
        """`` (line N: `text`)`` for the nearest node of ``path`` that has a line (merge keys and aliases have none)."""
        while path and path not in self.lines:
            path = path[:-1]
        n = self.lines.get(path)
        return f" (line {n}: `{self.text_lines[n - 1].strip()}`)" if n else ""


def _node_lines(node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int], dups: list[tuple[str, int]]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                if (*path, key.value) in out:  # PyYAML keeps the last, Docker Compose refuses: never guess
                    dups.append((key.value, key.start_mark.line + 1))
                out.setdefault((*path, key.value), key.start_mark.line + 1)
                _node_lines(value, (*path, key.value), out, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.setdefault((*path, i), item.start_mark.line + 1)
            _node_lines(item, (*path, i), out, dups)


def parse_compose(docker_compose_text: str) -> ParsedCompose:
    """Parse a docker-compose text with PyYAML (safe loader) and keep each key's line.

    Raises:
        ComposeError: not YAML or no services mapping.
    """
    try:
        doc = yaml.load(docker_compose_text, Loader=LOADER)  # noqa: S506 - LOADER is a safe loader
        root = yaml.compose(docker_compose_text, Loader=LOADER)
    except yaml.YAMLError as exc:
        raise ComposeError(f"docker_compose_file is not valid YAML: {str(exc).splitlines()[0]}") from exc
    svcs = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(svcs, dict) or not all(isinstance(v, dict) for v in svcs.values()):
        raise ComposeError("docker_compose_file has no `services` mapping")
    lines: dict[tuple[Any, ...], int] = {}
    dups: list[tuple[str, int]] = []
    if root is not None:
        _node_lines(root, (), lines, dups)
    text_lines = tuple(docker_compose_text.splitlines())
    return ParsedCompose(doc, lines, text_lines, tuple(f"duplicate key `{k}` (line {n}: `{text_lines[n - 1].strip()}`)"
                                                         for k, n in dups))


def services(docker_compose_text: str) -> dict[str, dict[str, Any]]:
    """The ``services`` mapping of a docker-compose text.

    Raises:
        ComposeError: not YAML or no services mapping.
    """
    return parse_compose(docker_compose_text).doc["services"]


def images(app_compose: dict[str, Any]) -> dict[str, str | None]:
    """service -> image reference, from the docker-compose text inside app-compose.json."""
    text = app_compose.get("docker_compose_file")
    if not isinstance(text, str):
        raise ComposeError("app-compose.json has no docker_compose_file text (runner is not docker-compose)")
    return {name: (svc.get("image") if isinstance(svc.get("image"), str) else None) for name, svc in services(text).items()}


def image_digest(ref: str | None) -> str | None:
    """``sha256:<hex>`` when ``ref`` is pinned by digest, else None."""
    m = DIGEST_REF.match(ref or "")
    return m.group("digest") if m else None


def env_entries(svc: dict[str, Any]) -> dict[str, str | None]:
    """A service's ``environment`` as name -> value (None: passed through from the CVM's environment)."""
    env = svc.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): (None if v is None else str(v)) for k, v in env.items()}
    out: dict[str, str | None] = {}
    for item in env:
        name, sep, value = str(item).partition("=")
        out[name] = value if sep else None
    return out


# Host paths through which a container reaches the guest agent (its sockets, the legacy tappd API) or everything (the
# Docker socket: it can start a container with any mount). /var/run is a symlink to /run in the CVM.
AGENT_PATHS = ("/run/dstack.sock", "/run/tappd.sock", "/run/dstack", "/run/docker.sock")
SOCKET_SOURCES = ("/run/dstack.sock", "/run/dstack/dstack.sock")  # the socket itself, under the SDK's search paths
HOST_NAMESPACES = ("network_mode", "net", "pid", "ipc", "userns_mode")
INTERPOLATED = re.compile(r"\$(\{|[A-Za-z_])")
GUARDED_KEYS = ("image", "privileged", "network_mode", "net", "pid", "ipc", "userns_mode", "cap_add", "devices",
                "volumes", "volumes_from", "security_opt", "device_cgroup_rules", "deploy", "gpus")


def host_path(source: str) -> str:
    """A bind source normalized the way the kernel resolves it (``..``, ``//``, trailing ``/``, /var/run -> /run)."""
    p = posixpath.normpath(source)
    p = "/" + p.lstrip("/") if p.startswith("/") else p
    return "/run" + p[len("/var/run"):] if p == "/var/run" or p.startswith("/var/run/") else p


def _binds(svc: dict[str, Any]) -> list[tuple[int, str | None, str]]:
    """(index, host source or None for a named volume, raw entry) of a service's ``volumes`` (short and long syntax)."""
    out: list[tuple[int, str | None, str]] = []
    for i, v in enumerate(svc.get("volumes") or []):
        if isinstance(v, dict):
            src, kind = str(v.get("source") or ""), v.get("type", "volume")
            out.append((i, src if kind == "bind" or src.startswith(("/", ".", "~")) else None, f"{kind} {src}"))
        else:
            src = str(v).split(":")[0]
            out.append((i, src if src.startswith(("/", ".", "~", "$")) or "/" in src else None, str(v)))
    return out


def _reaches_agent(path: str) -> bool:
    return path in ("/", "/run", "/var") or any(a == path or a.startswith(path + "/") or path.startswith(a + "/") for a in AGENT_PATHS)


def _gpu_reservation_only(devices: Any) -> bool:
    return isinstance(devices, list) and all(
        isinstance(d, dict) and d.get("driver", "nvidia") == "nvidia" and list(d.get("capabilities") or []) == ["gpu"]
        and set(d) <= {"driver", "count", "device_ids", "capabilities", "options"} for d in devices)


def _json_line(raw: bytes | None, key: str) -> str:
    """`` (app-compose.json line N: `"key": value`)`` for a top-level field of the raw file, when given."""
    text = raw.decode("utf-8", "replace") if raw is not None else ""
    m = re.search(rf'"{re.escape(key)}"\s*:\s*("(?:[^"\\]|\\.){{0,60}}"?|[^,}}\n]*)', text)
    if not m:
        return ""
    return f" (app-compose.json line {text.count(chr(10), 0, m.start()) + 1}: `{m.group(0)}`)"


def _interpolations(value: Any) -> bool:
    if isinstance(value, str):
        return bool(INTERPOLATED.search(value.replace("$$", "")))
    if isinstance(value, dict):
        return any(_interpolations(k) or _interpolations(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_interpolations(v) for v in value)
    return False


def _service_problems(p: ParsedCompose, name: str, svc: dict[str, Any], socket_holder: str | None) -> list[str]:
    at = lambda *k: p.at("services", name, *k)  # noqa: E731
    out: list[str] = []
    ref = svc.get("image")
    if svc.get("build") is not None:
        out.append(f"service {name}: `build:` is not reproducible in a CVM; use a pushed image by digest{at('build')}")
    if not isinstance(ref, str) or image_digest(ref) is None:
        out.append(f"service {name}: image {ref!r} is not pinned by digest (name@sha256:<64 hex>){at('image')}")
    elif image_digest(ref) == PLACEHOLDER_DIGEST:
        out.append(f"service {name}: image digest is the placeholder; use the pushed image's digest{at('image')}")
    for key in GUARDED_KEYS:
        value = svc.get(key)
        if _interpolations(value):
            item = next((i for i, v in enumerate(value) if _interpolations(v)), None) if isinstance(value, list) else None
            out.append(f"service {name}: `{key}` interpolates a variable from the environment, which the host can "
                       f"forge (dstack's encrypted env is not authenticated); write the value itself"
                       f"{at(key) if item is None else at(key, item)}")
    if svc.get("privileged") not in (None, False):
        out.append(f"service {name}: privileged containers reach every device and the guest agent{at('privileged')}")
    for key in HOST_NAMESPACES:
        value = str(svc.get(key) or "")
        if value == "host" or (key in ("pid", "ipc") and value.startswith(("service:", "container:"))):
            out.append(f"service {name}: `{key}: {value}` shares a namespace with the CVM or another container{at(key)}")
    if svc.get("cap_add"):
        out.append(f"service {name}: cap_add {svc['cap_add']} adds capabilities; remove it{at('cap_add')}")
    for key in ("devices", "device_cgroup_rules"):
        if svc.get(key):
            out.append(f"service {name}: `{key}` maps host devices; only the GPU reservation is allowed{at(key)}")
    reservations = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    if "devices" in reservations and not _gpu_reservation_only(reservations["devices"]):
        out.append(f"service {name}: device reservation other than `driver: nvidia, capabilities: [gpu]`"
                   f"{at('deploy', 'resources', 'reservations', 'devices')}")
    for opt in svc.get("security_opt") or []:
        if re.search(r"unconfined|label[:=]disable|systempaths", str(opt)):
            out.append(f"service {name}: security_opt {opt!r} turns off a confinement{at('security_opt')}")
    if svc.get("volumes_from"):
        out.append(f"service {name}: volumes_from inherits another container's mounts (the guest-agent socket with "
                   f"them); mount named volumes instead{at('volumes_from')}")
    if svc.get("extends"):
        out.append(f"service {name}: `extends` merges settings this audit does not see; inline them{at('extends')}")
    for i, src, entry in _binds(svc):
        if src is None:
            continue
        path = host_path(src)
        if name == socket_holder and path in SOCKET_SOURCES:
            continue
        if _reaches_agent(path):
            out.append(f"service {name} can reach the guest agent (and so the app's keys) through the bind of {src!r}"
                       f"{at('volumes', i)}")
        else:
            out.append(f"service {name}: binds host path {src!r}; only named volumes are allowed (host paths hold "
                       f"other containers' data and the CVM's files){at('volumes', i)}")
    return out


def audit(app_compose: dict[str, Any], raw: bytes | None = None) -> list[str]:
    """What must change before this app-compose can be trusted with a dataset key (empty: nothing found).

    Each finding names the offending line: of ``docker_compose_file`` for service settings, of ``raw`` (the
    app-compose.json bytes, when given) for the file's own fields. Rules: only the trainer may reach the guest agent
    (its socket, by any path or any parent directory, the legacy tappd socket, the Docker socket); no privileged
    container, host namespace, added capability, device mapping other than the GPU reservation, inherited mounts or
    host bind; every image pinned by digest; no variable interpolation in those settings; logs and sysinfo private.
    """
    problems = []
    if app_compose.get("runner") != "docker-compose":
        return [f"runner is {app_compose.get('runner')!r}: only docker-compose apps can be audited here"]
    for key, what in (("public_logs", "container logs"), ("public_sysinfo", "system information")):
        if app_compose.get(key, True) is not False:
            problems.append(f"{key} is not false: {what} would be served on the guest agent's public port{_json_line(raw, key)}")
    if app_compose.get("pre_launch_script"):
        problems.append("pre_launch_script is set: it runs as root before the containers; read it "
                        "(Phala Cloud adds its own) and pin this compose-hash only if you accept it"
                        + _json_line(raw, "pre_launch_script"))
    if int(app_compose.get("swap_size") or 0) > 0:
        problems.append("swap_size > 0: keep it 0 (dstack best practice)" + _json_line(raw, "swap_size"))
    p = parse_compose(app_compose["docker_compose_file"])
    svcs = p.doc["services"]
    sockets = [n for n, svc in svcs.items() if any(s is not None and host_path(s) in SOCKET_SOURCES for _, s, _ in _binds(svc))]
    holder = SERVICE if SERVICE in svcs else (sockets[0] if len(sockets) == 1 else None)
    problems += [f"docker_compose_file has a {d}: PyYAML keeps the last value, Docker Compose refuses the file"
                 for d in p.duplicates]
    for key in ("include",):
        if p.doc.get(key):
            problems.append(f"`{key}` pulls in compose files outside the measured text{p.at(key)}")
    for section in ("secrets", "configs"):
        for n, item in (p.doc.get(section) or {}).items():
            if isinstance(item, dict) and item.get("file"):
                problems.append(f"{section} {n}: `file: {item['file']}` binds a host file; only named volumes are allowed"
                                f"{p.at(section, n)}")
    for n, vol in (p.doc.get("volumes") or {}).items():
        opts = (vol or {}).get("driver_opts") or {} if isinstance(vol, dict) else {}
        if opts.get("device") or "bind" in str(opts.get("o", "")):
            problems.append(f"volume {n}: driver_opts make it a bind of host path {opts.get('device')!r}{p.at('volumes', n)}")
    for name, svc in svcs.items():
        problems += _service_problems(p, name, svc, holder)
        for var, value in env_entries(svc).items():
            if value is not None and SECRET_NAME.search(var) and not var.endswith("_SHA256"):
                problems.append(f"service {name}: {var} has a value in clear; pass it through from dstack's encrypted env"
                                f"{p.at('services', name, 'environment')}")
            if var.endswith("_SHA256") and value == "0" * 64:
                problems.append(f"service {name}: {var} is the placeholder; set the real hash{p.at('services', name, 'environment')}")
    if len(sockets) > 1:
        problems.append(f"{DSTACK_SOCKET} is mounted into {sockets}: any container with the socket gets the app's keys")
    if SERVICE in svcs and SERVICE not in sockets:
        problems.append(f"service {SERVICE} does not mount {DSTACK_SOCKET} (it needs the guest agent)")
    return problems
