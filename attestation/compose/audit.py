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
  ``pre_launch_script``, swap; dstack 0.6's ``init_script`` and a ``requirements.gpu_policy`` that weakens the GPU
  gate, and 0.6 fields of the wrong type (``attestation.compose.dstack06``);
* anything it does not understand: it works from allow-lists (the tables below), so ``env_file``, configs and
  secrets from ``environment:``, external networks (``{name: host, external: true}``), other drivers, a seccomp
  profile file or an SELinux type, and fields a later Compose adds are findings, never skipped. Explicit YAML tags
  (``!!binary``: bytes to PyYAML, a string to Compose) are refused when the text is parsed (``compose_yaml``).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from attestation.compose import located_yaml as Y
from attestation.compose.dstack06 import audit06
from attestation.compose.app_compose import (DSTACK_SOCKET, PLACEHOLDER_DIGEST, SECRET_NAME, SERVICE, ComposeError, compose_document,
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
SECURITY_OPTS = ("no-new-privileges", "no-new-privileges:true", "no-new-privileges=true")  # the only ones allowed

# Allow-lists: a field outside them is a finding (the audit refuses what it cannot judge). Keys starting with
# ``x-`` are Compose extension fields (Compose ignores them; anchors usually live there).
SERVICE_FIELDS = frozenset((  # judged below, then fields with no way out of the container
    "image environment volumes security_opt deploy networks configs secrets privileged " + " ".join(HOST_MODES) +
    " command entrypoint init restart stop_grace_period stop_signal healthcheck working_dir user read_only stdin_open"
    " tty tmpfs shm_size ulimits mem_limit mem_reservation memswap_limit mem_swappiness cpus cpu_shares cpuset cpu_count"
    " cpu_percent cpu_period cpu_quota pids_limit oom_score_adj oom_kill_disable cap_drop ports expose hostname"
    " domainname container_name labels annotations depends_on profiles platform pull_policy scale extra_hosts dns"
    " dns_search dns_opt mac_address").split())
REFUSED_FIELDS = {  # known fields with their own finding
    "build": "`build:` is not reproducible in a CVM; use a pushed image by digest",
    "volumes_from": "`volumes_from:` pulls in configuration this audit cannot see here; write it out",
    "extends": "`extends:` pulls in configuration this audit cannot see here; write it out",
    "env_file": "`env_file:` reads a file of the CVM's (dstack's host-shared files are under /dstack) that the "
                "compose-hash does not cover; write the values under environment or pass them through dstack's "
                "encrypted env",
    "device_cgroup_rules": "device_cgroup_rules opens device access; remove it",
}
DEPLOY_FIELDS = {"deploy": frozenset("resources restart_policy labels replicas mode".split()),
                 "deploy.resources": frozenset(("limits", "reservations")),
                 "deploy.resources.limits": frozenset(("cpus", "memory", "pids")),
                 "deploy.resources.reservations": frozenset(("cpus", "memory", "devices"))}
GPU_DEVICE_FIELDS = frozenset(("driver", "count", "device_ids", "capabilities"))
VOLUME_ITEM = {"": frozenset("type source target read_only consistency bind volume tmpfs".split()),
               "bind": frozenset(("propagation", "create_host_path", "selinux")),
               "volume": frozenset(("nocopy", "subpath")), "tmpfs": frozenset(("size", "mode"))}
VOLUME_TYPES = ("bind", "volume", "tmpfs")
VOLUME_MODES = frozenset("ro rw z Z nocopy consistent cached delegated shared rshared slave rslave private rprivate".split())
REFERENCE_ITEM = frozenset(("source", "target", "uid", "gid", "mode"))  # a service's configs / secrets entry
NETWORK_ATTACH = frozenset("aliases ipv4_address ipv6_address link_local_ips priority gw_priority mac_address".split())
TOP_FIELDS = frozenset(("services", "volumes", "networks", "configs", "secrets", "name", "version"))
SECTION_FIELDS = {"volumes": frozenset(("driver", "driver_opts", "labels", "name")),  # one top-level entry's fields
                  "networks": frozenset(("driver", "internal", "attachable", "labels", "enable_ipv6")),
                  "configs": frozenset(("file", "content")), "secrets": frozenset(("file",))}
SECTION_REFUSED = {
    "external": "`external:` refers to something created outside this file (an external network named host is "
                "the CVM's own network)",
    "environment": "`environment:` fills it from the environment of `docker compose`, which dstack does not measure "
                   "and the host can forge",
    "name": "`name:` refers to an object outside this file (a network named host is the CVM's own network)",
}
SECTION_DRIVERS = {"volumes": (None, "local"), "networks": (None, "bridge")}


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


def _get(node: Any, path: str) -> Any:
    """``node[a][b]...`` for ``path`` "a.b...", None where a level is missing or not a mapping."""
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _line(mapping: Any, key: Any, default: int = 0) -> int:
    return mapping.line(key, default) if isinstance(mapping, (Y.LinedDict, Y.LinedList)) else default


def _fields(where: str, mapping: Any, allowed: frozenset[str], line: int = 0,
            refused: dict[str, str] | None = None) -> list[str]:
    """Findings for a mapping's keys outside ``allowed`` (``x-`` extension keys pass; ``refused``: own messages)."""
    if mapping is None:
        return []
    if not isinstance(mapping, dict):
        return [f"{where} (line {line}): {type(mapping).__name__} {mapping!r:.60} is not a mapping this audit can read"]
    out = []
    for key in mapping:
        if isinstance(key, str) and (key in allowed or key.startswith("x-")):
            continue
        why = (refused or {}).get(key) if isinstance(key, str) else None
        out.append(f"{where} (line {_line(mapping, key, line)}): "
                   + (why or f"`{key}:` is not a field this audit understands; remove it (what the audit cannot "
                              "judge is refused)"))
    return out


def _section_problems(doc: dict[str, Any]) -> list[str]:
    """Top-level fields, and the fields of each top-level volume / network / config / secret."""
    out = _fields("top level", doc, TOP_FIELDS, refused={"include": "`include:` other compose files are not measured; "
                                                             "inline them"})
    if interpolated(doc.get("name")):
        out.append(f"top level (line {doc.line('name')}): `name` is interpolated from the environment; write it out")
    for section, allowed in SECTION_FIELDS.items():
        entries = doc.get(section)
        if entries is not None and not isinstance(entries, dict):
            out.append(f"top-level {section} (line {_line(doc, section)}): not a mapping this audit can read")
        if not isinstance(entries, dict):
            continue
        out += _interpolation_problems(f"top-level {section}", entries)
        for name, spec in entries.items():
            where, line = f"{section[:-1]} {name}", _line(entries, name)
            out += _fields(where, spec, allowed, line, SECTION_REFUSED)
            driver = spec.get("driver") if isinstance(spec, dict) else None
            if section in SECTION_DRIVERS and driver not in SECTION_DRIVERS[section]:
                out.append(f"{where} (line {_line(spec, 'driver', line)}): driver {driver!r} is not "
                           f"{SECTION_DRIVERS[section][1]}, the only one this audit can judge")
    return out


def _named_binds(doc: dict[str, Any], problems: list[str]) -> dict[str, str]:
    """Top-level volumes that are binds in disguise (local driver ``o: bind``, ``device: PATH``): name -> path; and
    the files of top-level configs and secrets (a path that is not absolute is relative: it resolves inside /dstack)."""
    out: dict[str, str] = {}
    vols = doc.get("volumes")
    for name, spec in (vols.items() if isinstance(vols, dict) else ()):
        opts = spec.get("driver_opts") if isinstance(spec, dict) else None
        if opts is None:
            continue
        where = f"volume {name} (line {_line(vols, name)})"
        if not isinstance(opts, dict) or set(opts) - {"type", "o", "device"}:
            problems.append(f"{where}: driver_opts other than type, o and device are not understood by this audit")
            continue
        device, kind = opts.get("device"), opts.get("type")
        if isinstance(device, str) and device.startswith("/"):  # a bind (o: bind) or a block device: a CVM path
            out[str(name)] = device
        elif isinstance(device, str) and device and "bind" in str(opts.get("o") or ""):
            problems.append(f"{where}: driver_opts device {device!r} is a relative bind")
        elif kind != "tmpfs":
            problems.append(f"{where}: driver_opts type {kind!r} device {device!r} is neither tmpfs nor a CVM path this "
                            "audit can check (nfs, cifs and the like mount storage from outside the CVM)")
    for kind in ("configs", "secrets"):
        section = doc.get(kind)
        for name, spec in (section.items() if isinstance(section, dict) else ()):
            path = spec.get("file") if isinstance(spec, dict) else None
            if path is not None and not isinstance(path, str):
                problems.append(f"{kind[:-1]} {name} (line {_line(section, name)}): file {path!r} is not a path")
            elif path is not None:
                out[f"{kind}:{name}"] = path if path.startswith(("/", ".", "~")) else "./" + path
    return out


def _volume(v: Any, name: str, line: int) -> tuple[str, str, list[str]]:
    """(source, target, problems) of one ``volumes`` entry; source "" for anonymous volumes and tmpfs."""
    where = _where(name, line)
    if isinstance(v, str):
        parts = v.split(":")
        if len(parts) > 3 or (len(parts) == 3 and set(parts[2].split(",")) - VOLUME_MODES):
            return "", "", [f"{where}: volume {v!r} is not a form this audit can read (source:target[:ro|rw|...])"]
        return (parts[0], parts[1], []) if len(parts) > 1 else ("", parts[0], [])
    if not isinstance(v, dict):
        return "", "", [f"{where}: volume {v!r:.60} is not a string or a mapping"]
    bad = [p for sub, allowed in VOLUME_ITEM.items()
           for p in _fields(f"service {name} volume {sub}".rstrip(), v.get(sub) if sub else v, allowed, line)]
    kind, source, target = v.get("type", "volume" if v.get("source") else None), v.get("source") or "", v.get("target")
    if kind not in (*VOLUME_TYPES, None) or not isinstance(source, str) or not isinstance(target, str):
        bad.append(f"{where}: volume type {kind!r}, source {source!r:.60}, target {target!r:.60} is not a bind, "
                   "volume or tmpfs this audit can read")
    if kind == "bind" and isinstance(source, str) and source and not source.startswith(("/", ".", "~")):
        source = "./" + source  # a bind's source is always a path, relative to the project directory (/dstack)
    return ("" if bad or kind == "tmpfs" else source), target, bad


def _mounts(svc: dict[str, Any], binds: dict[str, str], name: str,
            problems: list[str]) -> list[tuple[str, str, int]]:
    """(source, target, line) of every bind a service gets; named volumes only when they are binds."""
    out = []
    vols = svc.get("volumes") or []
    if not isinstance(vols, list):
        problems.append(f"{_where(name, _line(svc, 'volumes'))}: volumes is not a list")
        vols = []
    for i, v in enumerate(vols):
        source, target, bad = _volume(v, name, _line(vols, i))
        problems.extend(bad)
        if source in binds:
            source = binds[source]
        if source.startswith((".", "~", "/")):  # a host path (relative ones resolve inside /dstack)
            out.append((source, target, _line(vols, i)))
    for kind in ("configs", "secrets"):
        items = svc.get(kind) or []
        for i, item in enumerate(items if isinstance(items, list) else [items]):
            where = _where(name, _line(items, i, _line(svc, kind)))
            if isinstance(item, dict):
                problems.extend(_fields(f"service {name} {kind}", item, REFERENCE_ITEM, _line(items, i)))
            ref = item.get("source") if isinstance(item, dict) else item
            if not isinstance(ref, str):
                problems.append(f"{where}: {kind} entry {item!r:.60} does not name a top-level {kind[:-1]}")
            elif f"{kind}:{ref}" in binds:
                out.append((binds[f"{kind}:{ref}"], f"{kind} {ref}", _line(svc, kind)))
    return out


def _deploy_problems(name: str, svc: dict[str, Any]) -> list[str]:
    """``deploy``: only resources, restart policy, labels, replicas, mode; the one device is the nvidia GPU."""
    out = [p for path, allowed in DEPLOY_FIELDS.items()
           for p in _fields(f"service {name} {path}", _get(svc, path), allowed, _line(svc, "deploy"))]
    devs = _get(svc, "deploy.resources.reservations.devices") or []
    for d in devs if isinstance(devs, list) else [devs]:
        if not isinstance(d, dict) or d.get("driver") != "nvidia" or not isinstance(d.get("capabilities"), list) \
                or "gpu" not in d["capabilities"]:
            out.append(f"{_where(name, _line(svc, 'deploy'))}: device reservation {dict(d) if isinstance(d, dict) else d!r} "
                       "is not the GPU (driver: nvidia, capabilities: [gpu])")
        else:
            out += _fields(f"service {name} deploy device", d, GPU_DEVICE_FIELDS, _line(svc, "deploy"))
    return out


def _network_problems(name: str, svc: dict[str, Any], networks: Any) -> list[str]:
    """The networks a service joins must be defined at the top level (whose fields ``_section_problems`` judged)."""
    nets = svc.get("networks")
    if nets is None:
        return []
    where = _where(name, _line(svc, "networks"))
    if isinstance(nets, dict):
        out = [p for net, spec in nets.items() for p in _fields(f"service {name} network {net}", spec, NETWORK_ATTACH,
                                                                  _line(nets, net))]
        names = list(nets)
    elif isinstance(nets, list):
        out, names = [], nets
    else:
        return [f"{where}: networks is not a list or a mapping"]
    defined = set(networks) if isinstance(networks, dict) else set()
    out += [f"{where}: network {n!r} is not defined in the top-level networks" for n in names
            if n != "default" and (not isinstance(n, str) or n not in defined)]
    return out


def _service_problems(name: str, svc: dict[str, Any], binds: dict[str, str], sockets: list[tuple[str, int]],
                      doc: dict[str, Any]) -> list[str]:
    at = lambda key: _where(name, _line(svc, key))  # noqa: E731
    out = _fields(f"service {name}", svc, SERVICE_FIELDS | {"devices", "cap_add"}, refused=REFUSED_FIELDS)
    ref = svc.get("image")
    if not isinstance(ref, str) or image_digest(ref) is None:
        out.append(f"{at('image')}: image {ref!r} is not pinned by digest (name@sha256:<64 hex>)")
    elif image_digest(ref) == PLACEHOLDER_DIGEST:
        out.append(f"{at('image')}: image digest is the placeholder; use the pushed image's digest")
    if not isinstance(svc.get("environment") or {}, (dict, list)):
        out.append(f"{at('environment')}: environment is not a list or a mapping")
    else:
        for var, value in env_entries(svc).items():
            if value is not None and SECRET_NAME.search(var) and not var.endswith("_SHA256"):
                out.append(f"{at('environment')}: {var} has a value in clear; pass it through from dstack's encrypted env")
            if var.endswith("_SHA256") and value == "0" * 64:
                out.append(f"{at('environment')}: {var} is the placeholder; set the real hash")
    for source, target, ln in _mounts(svc, binds, name, out):
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
        value = svc.get(key)
        if value is not None and not isinstance(value, str):
            out.append(f"{at(key)}: {key}: {value!r:.60} is not a string this audit can read")
        elif value == "host":
            out.append(f"{at(key)}: {key}: host shares the CVM's {key.split('_')[0]} namespace")
        elif key in ("pid", "ipc") and value and value.startswith(("service:", "container:")):
            out.append(f"{at(key)}: {key}: {value} shares another container's namespace (/proc/<pid>/root reaches its files)")
    if svc.get("cap_add"):
        out.append(f"{at('cap_add')}: cap_add {svc['cap_add']!r:.80} adds capabilities; remove it")
    if svc.get("devices"):
        out.append(f"{at('devices')}: devices {svc['devices']!r:.80}: the only device allowed is the GPU, through "
                   "deploy.resources.reservations.devices (driver: nvidia)")
    opts = svc.get("security_opt") or []
    opts = opts if isinstance(opts, list) else [opts]
    if off := [o for o in opts if str(o).replace(" ", "") in UNCONFINED]:
        out.append(f"{at('security_opt')}: security_opt {off} turns off confinement")
    if other := [o for o in opts if str(o).replace(" ", "") not in UNCONFINED + SECURITY_OPTS or not isinstance(o, str)]:
        out.append(f"{at('security_opt')}: security_opt {other} is not one this audit can judge (a profile read from a "
                   "file, an SELinux type...); only no-new-privileges is allowed")
    out.extend(_interpolation_problems(f"service {name}", svc, skip=("environment",)))
    out.extend(_deploy_problems(name, svc))
    out.extend(_network_problems(name, svc, doc.get("networks")))
    return out


def compose_problems(text: str, loader: type = Y.LOADER) -> list[str]:
    """The findings for one docker-compose text (see the module docstring).

    Raises:
        ComposeError: not YAML, or no ``services`` mapping.
    """
    doc, svcs = compose_document(text, loader)
    problems = _section_problems(doc)
    binds = _named_binds(doc, problems)
    mounts: list[tuple[str, int]] = []
    for name, svc in svcs.items():
        problems.extend(_service_problems(str(name), svc, binds, mounts, doc))
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
    findings, bad, _notes = audit06(app_compose)  # dstack 0.6 fields: init_script, requirements.gpu_policy, ...
    problems += [message for _name, message in findings] + bad
    text = app_compose.get("docker_compose_file")
    if not isinstance(text, str):
        raise ComposeError("app-compose.json has no docker_compose_file text (runner is not docker-compose)")
    return problems + compose_problems(text, loader)
