"""The app-compose audit: what must change before an app-compose.json can be trusted with a dataset key.

dstack treats the whole CVM as one trust domain: any container that reaches the guest agent's socket can ask for the
app's keys and for quotes (dstack issue #617, ``docs/security/cvm-boundaries.md``). So the audit reads the
docker-compose text the way Docker Compose will (anchors, aliases and ``<<`` merges resolved, short and long volume
syntax, top-level volumes that are really binds) and refuses, each with the offending line:

* a bind of the guest agent socket into any service but the trainer, or of anything that holds or contains it
  (``/``, ``/run``, ``/var/run``, ``/run/dstack``), of the Docker socket, dstack's ``/dstack`` files (app keys, env),
  Docker's storage, ``/proc``, ``/sys``, ``/dev``; relative binds (they resolve inside ``/dstack``);
* ``privileged``, host network / pid / ipc / uts / userns / cgroup namespaces (and pid/ipc shared with another
  container), added capabilities, ``devices`` and device-cgroup rules (the GPU comes only through the
  ``deploy.resources.reservations.devices`` nvidia reservation), unconfined seccomp / AppArmor / SELinux,
  ``volumes_from``, ``extends`` and ``include`` (text this audit cannot see), and ``$VAR`` interpolation outside
  ``environment`` (compose fills it from the environment, which dstack does not measure and the host can forge);
* images not pinned by digest, ``build:``, secrets in clear; ``public_logs`` / ``public_sysinfo`` not false,
  ``pre_launch_script``, swap.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from attestation import compose_yaml as Y
from attestation.compose import (DSTACK_SOCKET, PLACEHOLDER_DIGEST, SECRET_NAME, SERVICE, ComposeError, compose_document,
                                 env_entries, image_digest)

# Paths inside the CVM a container must not see (``/var/run`` is a symlink to ``/run``), with what each exposes.
PROTECTED = {
    "/run/dstack.sock": "the guest agent socket: app keys, quotes",
    "/run/tappd.sock": "the legacy guest agent socket: app keys, quotes",
    "/run/dstack": "the guest agent socket directory",
    "/run/docker.sock": "the Docker socket, which can start a container with the guest agent socket",
    "/dstack": "dstack's host-shared files: app keys, decrypted env",
    "/var/lib/docker": "every container's volumes and images",
    "/var/lib/containerd": "every container's images and filesystems",
    "/var/volatile": "dstack's encrypted data disk",
    "/proc": "the CVM's processes: /proc/1/root is the whole filesystem",
    "/sys": "the CVM's kernel interfaces: RTMR extension, configfs-tsm",
    "/dev": "the CVM's devices: /dev/tdx_guest signs quotes for any report_data",
}
SOCKET_PATH = "/run/dstack.sock"  # canonical form of DSTACK_SOCKET
HOST_MODES = ("network_mode", "pid", "ipc", "uts", "userns_mode", "cgroup")
UNCONFINED = ("seccomp=unconfined", "seccomp:unconfined", "apparmor=unconfined", "apparmor:unconfined",
              "label=disable", "label:disable", "systempaths=unconfined")


def canonical(path: str) -> str:
    """An absolute CVM path with ``..`` resolved and ``/var/run`` read as ``/run``."""
    p = posixpath.normpath("/" + path.lstrip("/"))
    p = "/" + p.lstrip("/")  # normpath keeps a leading "//"
    return "/run" + p[len("/var/run"):] if p == "/var/run" or p.startswith("/var/run/") else p


def exposes(source: str) -> list[str]:
    """What a bind of ``source`` exposes: protected paths it is, holds, or lies inside (empty: none)."""
    src = canonical(source)
    return [f"{p} [{why}]" for p, why in PROTECTED.items()
            if src == p or p.startswith(src.rstrip("/") + "/") or src.startswith(p + "/")]


def _listed(found: list[str]) -> str:
    return ", ".join(found[:2]) + (f" and {len(found) - 2} more protected paths" if len(found) > 2 else "")


_INTERPOLATION = re.compile(r"\$(\{|[A-Za-z_])")


def interpolated(value: Any) -> bool:
    """Does a compose value take text from the environment (``$VAR``, ``${VAR}``; ``$$`` is a literal ``$``)?"""
    if isinstance(value, str):
        return bool(_INTERPOLATION.search(value.replace("$$", "")))
    if isinstance(value, dict):
        return any(interpolated(k) or interpolated(v) for k, v in value.items())
    if isinstance(value, list):
        return any(interpolated(v) for v in value)
    return False


def _interpolation_problems(where: str, mapping: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for key, value in mapping.items():
        if key in skip or not interpolated(value):
            continue
        items = [value.line(i) for i, v in enumerate(value) if interpolated(v)] if isinstance(value, Y.LinedList) else []
        line = items[0] if items else mapping.line(key) if isinstance(mapping, Y.LinedDict) else 0
        out.append(f"{where} (line {line}): `{key}` is interpolated from the environment, which dstack does not "
                   "measure and the host can forge; write the value out")
    return out


def _where(name: str, line: int) -> str:
    return f"service {name} (line {line})" if line else f"service {name}"


def _named_binds(doc: dict[str, Any], problems: list[str]) -> dict[str, str]:
    """Top-level volumes that are binds in disguise (local driver ``o: bind``, ``device: PATH``): name -> path."""
    out: dict[str, str] = {}
    vols = doc.get("volumes")
    for name, spec in (vols.items() if isinstance(vols, dict) else ()):
        opts = spec.get("driver_opts") if isinstance(spec, dict) else None
        device = str(opts.get("device") or "") if isinstance(opts, dict) else ""
        if device.startswith("/"):  # a bind (o: bind) or a block device: either way a CVM path
            out[str(name)] = device
        elif device and "bind" in str(opts.get("o") or ""):
            problems.append(f"volume {name} (line {vols.line(name)}): driver_opts device {device!r} is a relative bind")
    for kind in ("configs", "secrets"):
        section = doc.get(kind)
        for name, spec in (section.items() if isinstance(section, dict) else ()):
            if isinstance(spec, dict) and isinstance(spec.get("file"), str):
                out[f"{kind}:{name}"] = spec["file"]
    return out


def _mounts(svc: dict[str, Any], binds: dict[str, str]) -> list[tuple[str, str, int]]:
    """(source, target, line) of every bind a service gets; named volumes only when they are binds."""
    out = []
    vols = svc.get("volumes") or []
    for i, v in enumerate(vols if isinstance(vols, list) else []):
        line = vols.line(i) if isinstance(vols, Y.LinedList) else 0
        if isinstance(v, str):
            parts = v.split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
        elif isinstance(v, dict):
            source, target = str(v.get("source") or ""), str(v.get("target") or "")
            if v.get("type") not in (None, "bind", "volume"):
                continue  # tmpfs, npipe, cluster, image: no host path
        else:
            continue
        if source in binds:
            source = binds[source]
        if source.startswith((".", "~", "/")):  # a host path (relative ones resolve inside /dstack)
            out.append((source, target, line))
    for kind in ("configs", "secrets"):
        for item in svc.get(kind) or []:
            name = item.get("source") if isinstance(item, dict) else item
            if f"{kind}:{name}" in binds:
                out.append((binds[f"{kind}:{name}"], f"{kind} {name}", svc.line(kind) if isinstance(svc, Y.LinedDict) else 0))
    return out


def _service_problems(name: str, svc: dict[str, Any], binds: dict[str, str], sockets: list[tuple[str, int]]) -> list[str]:
    line = svc.line if isinstance(svc, Y.LinedDict) else (lambda _k, d=0: d)
    at = lambda key: _where(name, line(key))  # noqa: E731
    out = []
    ref = svc.get("image")
    if svc.get("build") is not None:
        out.append(f"{at('build')}: `build:` is not reproducible in a CVM; use a pushed image by digest")
    if not isinstance(ref, str) or image_digest(ref) is None:
        out.append(f"{at('image')}: image {ref!r} is not pinned by digest (name@sha256:<64 hex>)")
    elif image_digest(ref) == PLACEHOLDER_DIGEST:
        out.append(f"{at('image')}: image digest is the placeholder; use the pushed image's digest")
    for var, value in env_entries(svc).items():
        if value is not None and SECRET_NAME.search(var) and not var.endswith("_SHA256"):
            out.append(f"{at('environment')}: {var} has a value in clear; pass it through from dstack's encrypted env")
        if var.endswith("_SHA256") and value == "0" * 64:
            out.append(f"{at('environment')}: {var} is the placeholder; set the real hash")
    for source, target, ln in _mounts(svc, binds):
        where = _where(name, ln)
        if source.startswith((".", "~")):
            out.append(f"{where}: bind `{source}:{target}` is relative: it resolves inside /dstack "
                       "(dstack's host-shared files with the app keys); use a named volume")
            continue
        if canonical(source) == SOCKET_PATH:
            sockets.append((name, ln))
            continue
        if found := exposes(source):
            out.append(f"{where}: bind `{source}:{target}` reaches {_listed(found)}: that container could get the "
                       "app's keys or forge its measurements")
    if svc.get("privileged") not in (None, False):
        out.append(f"{at('privileged')}: privileged: {svc['privileged']!r} gives the container every device and capability "
                   "(the guest agent, /dev/tdx_guest)")
    for key in HOST_MODES:
        value = str(svc.get(key) or "")
        if value == "host":
            out.append(f"{at(key)}: {key}: host shares the CVM's {key.split('_')[0]} namespace")
        elif key in ("pid", "ipc") and value.startswith(("service:", "container:")):
            out.append(f"{at(key)}: {key}: {value} shares another container's namespace (/proc/<pid>/root reaches its files)")
    if svc.get("cap_add"):
        out.append(f"{at('cap_add')}: cap_add {list(svc['cap_add'])} adds capabilities; remove it")
    if svc.get("devices"):
        out.append(f"{at('devices')}: devices {list(svc['devices'])}: the only device allowed is the GPU, through "
                   "deploy.resources.reservations.devices (driver: nvidia)")
    if svc.get("device_cgroup_rules"):
        out.append(f"{at('device_cgroup_rules')}: device_cgroup_rules opens device access; remove it")
    bad_opts = [o for o in svc.get("security_opt") or [] if str(o).replace(" ", "") in UNCONFINED]
    if bad_opts:
        out.append(f"{at('security_opt')}: security_opt {bad_opts} turns off confinement")
    out.extend(_interpolation_problems(f"service {name}", svc, skip=("environment",)))
    for key in ("volumes_from", "extends"):
        if svc.get(key):
            out.append(f"{at(key)}: `{key}:` pulls in configuration this audit cannot see here; write it out")
    devs: Any = svc
    for key in ("deploy", "resources", "reservations", "devices"):
        devs = devs.get(key) if isinstance(devs, dict) else None
    devs = devs or []
    for d in devs if isinstance(devs, list) else [devs]:
        if not isinstance(d, dict) or d.get("driver") != "nvidia" or "gpu" not in (d.get("capabilities") or []):
            out.append(f"{at('deploy')}: device reservation {dict(d) if isinstance(d, dict) else d!r} is not the "
                       "GPU (driver: nvidia, capabilities: [gpu])")
    return out


def compose_problems(text: str, loader: type = Y.LOADER) -> list[str]:
    """The findings for one docker-compose text (see the module docstring).

    Raises:
        ComposeError: not YAML, or no ``services`` mapping.
    """
    doc, svcs = compose_document(text, loader)
    problems: list[str] = []
    if doc.get("include"):
        problems.append(f"include (line {doc.line('include')}): other compose files are not measured; inline them")
    for section in ("volumes", "configs", "secrets", "networks"):
        if isinstance(doc.get(section), dict):
            problems.extend(_interpolation_problems(f"top-level {section}", doc[section]))
    binds = _named_binds(doc, problems)
    mounts: list[tuple[str, int]] = []
    for name, svc in svcs.items():
        problems.extend(_service_problems(str(name), svc, binds, mounts))
    holders = sorted({name for name, _ in mounts})
    if len(holders) > 1:
        where = ", ".join(_where(name, ln) for name, ln in mounts)
        problems.append(f"{DSTACK_SOCKET} is mounted into {holders} ({where}): any container with the socket gets the "
                        "app's keys")
    if SERVICE in svcs and SERVICE not in holders:
        problems.append(f"service {SERVICE} does not mount {DSTACK_SOCKET} (it needs the guest agent)")
    return problems


def audit(app_compose: dict[str, Any], loader: type = Y.LOADER) -> list[str]:
    """What must change before this app-compose can be trusted with a dataset key (empty: nothing found)."""
    if app_compose.get("runner") != "docker-compose":
        return [f"runner is {app_compose.get('runner')!r}: only docker-compose apps can be audited here"]
    problems = []
    for key, what in (("public_logs", "container logs"), ("public_sysinfo", "system information")):
        if app_compose.get(key, True) is not False:
            problems.append(f"{key} is not false: {what} would be served on the guest agent's public port"
                            + ("" if key in app_compose else " (absent; set it explicitly)"))
    if app_compose.get("pre_launch_script"):
        problems.append("pre_launch_script is set: it runs as root before the containers; read it "
                        "(Phala Cloud adds its own) and pin this compose-hash only if you accept it")
    if str(app_compose.get("swap_size") or 0) not in ("0", "0G", "0M", ""):
        problems.append("swap_size is not 0: memory could be paged out; keep it 0 (dstack best practice)")
    text = app_compose.get("docker_compose_file")
    if not isinstance(text, str):
        raise ComposeError("app-compose.json has no docker_compose_file text (runner is not docker-compose)")
    return problems + compose_problems(text, loader)
