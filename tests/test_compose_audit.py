"""The compose audit cannot be side-stepped: a table of bad composes, each refused with its reason and line."""
from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from attestation.compose import app_compose as C
from attestation.compose import located_yaml as Y
from attestation.compose.audit import audit, canonical, compose_problems, exposes

from app.deploy.app_compose import render_deployment

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
IMAGE = "registry.example.com/cvm-tune@sha256:" + "5e" * 32
LOADERS = [pytest.param(Y.make_loader(yaml.SafeLoader), id="SafeLoader")]
if hasattr(yaml, "CSafeLoader"):
    LOADERS.append(pytest.param(Y.make_loader(yaml.CSafeLoader), id="CSafeLoader"))


def _good() -> dict:
    dep = render_deployment((REPO / "docker-compose.yaml").read_text(), IMAGE, C.AppComposeSettings(),
                            bundles_token_sha256="ab" * 32)
    return json.loads(dep.app_compose)


GOOD = _good()


def _compose(sidecar: str = "", *, top: str = "", prefix: str = "", bundles: str = "") -> str:
    """The deployable compose plus a ``sidecar`` service (body given), extra top-level volumes, or a prefix."""
    text = prefix + GOOD["docker_compose_file"]
    if bundles:
        text = text.replace("  bundles:                              # read-only",
                            "  bundles:\n" + textwrap.indent(bundles, "    ") + "    # read-only", 1)
    if sidecar:
        svc = f"  sidecar:\n    image: {IMAGE}\n" + textwrap.indent(sidecar, "    ")
        text = text.replace("\nvolumes:\n", "\n" + svc + "\nvolumes:\n", 1)
    return text + top


# (id, compose text, what the finding must say, the text on its line)
BAD = [
    ("run-dir", _compose("volumes:\n  - /run:/hostrun\n"), "reaches /run/dstack.sock", "- /run:/hostrun"),
    ("var-run-dir", _compose("volumes:\n  - /var/run:/x\n"), "reaches /run/dstack.sock", "- /var/run:/x"),
    ("root", _compose("volumes:\n  - /:/host/\n"), "reaches /run/dstack.sock", "- /:/host/"),
    ("root-double-slash", _compose("volumes:\n  - //:/host\n"), "reaches /run/dstack.sock", "- //:/host"),
    ("dotdot", _compose("volumes:\n  - /var/run/../run/:/x:ro\n"), "reaches /run/dstack.sock", "/var/run/../run/"),
    ("var", _compose("volumes:\n  - /var:/x\n"), "/var/lib/docker", "- /var:/x"),
    ("socket-other-service", _compose("volumes:\n  - /var/run/dstack.sock:/var/run/dstack.sock\n"),
     "mounted into ['cvm-tune', 'sidecar']", "- /var/run/dstack.sock:/var/run/dstack.sock"),
    ("socket-other-path", _compose("volumes:\n  - /run/dstack.sock:/tmp/agent.sock\n"),
     "mounted into ['cvm-tune', 'sidecar']", "- /run/dstack.sock:/tmp/agent.sock"),
    ("socket-dir", _compose("volumes:\n  - /var/run/dstack:/agent\n"), "/run/dstack [", "- /var/run/dstack:/agent"),
    ("tappd-socket", _compose("volumes:\n  - /var/run/tappd.sock:/var/run/tappd.sock\n"), "legacy guest agent",
     "tappd.sock:/var"),
    ("docker-socket", _compose("volumes:\n  - /var/run/docker.sock:/var/run/docker.sock\n"), "Docker socket",
     "docker.sock:/var"),
    ("dstack-files", _compose("volumes:\n  - /dstack:/d:ro\n"), "host-shared files", "- /dstack:/d:ro"),
    ("proc", _compose("volumes:\n  - /proc:/hostproc\n"), "/proc/1/root", "- /proc:/hostproc"),
    ("dev", _compose("volumes:\n  - /dev:/dev\n"), "/dev/tdx_guest", "- /dev:/dev"),
    ("relative", _compose("volumes:\n  - ./:/cfg\n"), "resolves inside /dstack", "- ./:/cfg"),
    ("long-syntax", _compose("volumes:\n  - type: bind\n    source: /var/run\n    target: /x\n"),
     "reaches /run/dstack.sock", "- type: bind"),
    ("volume-driver-opts", _compose("volumes:\n  - hostrun:/x\n",
                                    top="  hostrun:\n    driver: local\n    driver_opts: {type: none, o: bind, device: /run}\n"),
     "reaches /run/dstack.sock", "- hostrun:/x"),
    ("secret-file", _compose("secrets: [agent]\n", top="secrets:\n  agent:\n    file: /var/run/dstack.sock\n"),
     "mounted into ['cvm-tune', 'sidecar']", "secrets: [agent]"),
    ("privileged", _compose("privileged: true\n"), "privileged: True", "privileged: true"),
    ("privileged-yes", _compose("privileged: yes\n"), "privileged: True", "privileged: yes"),
    ("privileged-string", _compose("privileged: 'true'\n"), "privileged: 'true'", "privileged: 'true'"),
    ("network-host", _compose("network_mode: host\n"), "network_mode: host", "network_mode: host"),
    ("pid-host", _compose('pid: "host"\n'), "pid: host", 'pid: "host"'),
    ("ipc-host", _compose("ipc: host\n"), "ipc: host", "ipc: host"),
    ("pid-shared", _compose("pid: service:cvm-tune\n"), "shares another container", "pid: service:cvm-tune"),
    ("cap-add", _compose("cap_add: [SYS_ADMIN]\n"), "cap_add ['SYS_ADMIN']", "cap_add: [SYS_ADMIN]"),
    ("devices", _compose("devices: [/dev/tdx_guest:/dev/tdx_guest]\n"), "the only device allowed is the GPU",
     "devices: [/dev/tdx_guest"),
    ("device-rules", _compose("device_cgroup_rules: ['c 1:3 mr']\n"), "device_cgroup_rules", "device_cgroup_rules:"),
    ("unconfined", _compose("security_opt: [seccomp=unconfined]\n"), "turns off confinement", "security_opt: [seccomp"),
    ("other-reservation", _compose("deploy:\n  resources:\n    reservations:\n      devices: [{driver: foo, capabilities: [gpu]}]\n"),
     "is not the GPU", "deploy:"),
    ("volumes-from", _compose("volumes_from: [cvm-tune]\n"), "`volumes_from:`", "volumes_from: [cvm-tune]"),
    ("extends", _compose("extends: {service: cvm-tune}\n"), "`extends:`", "extends: {service"),
    ("include", _compose(prefix="include: [other.yaml]\n"), "other compose files are not measured", "include: [other"),
    ("unpinned", _compose().replace(IMAGE, "registry.example.com/cvm-tune:latest", 1), "not pinned by digest", None),
    ("build", _compose("build: .\n"), "`build:`", "build: ."),
    ("secret-in-clear", _compose("environment: [HF_TOKEN=hf_x]\n"), "HF_TOKEN has a value in clear", "environment:"),
    ("interpolated-bind", _compose("volumes:\n  - ${HOST_DIR:-/tmp}:/x\n"), "interpolated from the environment", "${HOST_DIR"),
    ("interpolated-mode", _compose("network_mode: $NET\n"), "`network_mode` is interpolated", "network_mode: $NET"),
    ("interpolated-device", _compose("volumes:\n  - v:/x\n", top="  v:\n    driver_opts: {o: bind, device: '${D}'}\n"),
     "top-level volumes (line", None),
    ("volume-relative-bind", _compose("volumes:\n  - v:/x\n", top="  v:\n    driver_opts: {type: none, o: bind, device: ./k}\n"),
     "is a relative bind", None),
    ("volume-block-device", _compose("volumes:\n  - v:/x\n", top="  v:\n    driver_opts: {type: ext4, device: /dev/vdb}\n"),
     "/dev [", "- v:/x"),
    # An anchor merged into an existing service: the finding names the anchor's line, where the text really is.
    ("anchor-merge", _compose(prefix="x-evil: &evil\n  privileged: true\n  network_mode: host\n",
                              bundles="<<: *evil\n"), "privileged: True", "  privileged: true"),
    ("alias-volumes", _compose("volumes: *vols\n", prefix="x-vols: &vols\n  - /run:/r\n"), "reaches /run/dstack.sock",
     "  - /run:/r"),
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize(("text", "reason", "line_text"), [pytest.param(t, r, ln, id=i) for i, t, r, ln in BAD])
def test_bad_compose_is_refused_with_its_reason_and_line(text: str, reason: str, line_text: str | None, loader: type) -> None:
    problems = compose_problems(text, loader)
    hits = [p for p in problems if reason in p]
    assert hits, problems
    if line_text is not None:
        line = max(n for n, s in enumerate(text.split("\n"), 1) if line_text in s)  # the last: the sidecar comes last
        assert any(f"(line {line})" in p for p in hits), (line, hits)
    doc = {**GOOD, "docker_compose_file": text}
    assert any(reason in p for p in audit(doc, loader)), "the app-compose audit reports it too"


@pytest.mark.parametrize("loader", LOADERS)
def test_the_deployable_compose_passes_with_both_loaders(loader: type) -> None:
    assert audit(GOOD, loader) == [] and compose_problems(GOOD["docker_compose_file"], loader) == []
    assert Y.parse(GOOD["docker_compose_file"], loader) == yaml.safe_load(GOOD["docker_compose_file"])


def test_app_compose_fields_are_audited() -> None:
    assert any("public_logs is not false" in p for p in audit({**GOOD, "public_logs": True}))
    assert any("public_sysinfo is not false" in p for p in audit({**GOOD, "public_sysinfo": True}))
    missing = {k: v for k, v in GOOD.items() if k != "public_sysinfo"}
    assert any("(absent; set it explicitly)" in p for p in audit(missing))
    assert any("pre_launch_script" in p for p in audit({**GOOD, "pre_launch_script": "echo"}))
    assert any("swap_size" in p for p in audit({**GOOD, "swap_size": "4G"})) and audit({**GOOD, "swap_size": 0}) == []
    assert audit({**GOOD, "runner": "bash"}) == ["runner is 'bash': only docker-compose apps can be audited here"]


@pytest.mark.parametrize("bad", ["services: [a]\n", "a: [\n", "x: &a [*a]\nservices: {s: {image: *a}}\n", "services: {s: [1]}\n",
                                 "services:\n  s:\n    image: a\n    privileged: false\n    privileged: true\n"])
def test_unparsable_composes_raise_compose_error(bad: str) -> None:
    with pytest.raises(C.ComposeError):
        compose_problems(bad)


def test_tmpfs_and_named_volumes_are_not_binds() -> None:
    text = _compose("volumes:\n  - scratch:/scratch\n  - type: tmpfs\n    target: /t\n  - data:/d\n",
                    top="  scratch:\n    driver_opts: {type: tmpfs, device: tmpfs, o: size=1g}\n  data: {}\n")
    assert compose_problems(text) == []


def test_paths() -> None:
    assert canonical("/var/run/dstack.sock") == canonical("//run//dstack.sock") == "/run/dstack.sock"
    assert canonical("/var/run/../../run") == "/run" and canonical("/var/running") == "/var/running"
    assert exposes("/tmp/cache") == [] and exposes("/opt/models") == []
    assert exposes("/") and exposes("/run") and exposes("/var") and exposes("/dev/tdx_guest")


def test_public_dstack_example_app_compose_hash_and_findings() -> None:
    """dstack-examples' rtmr3-based app-compose: its published compose-hash, and everything wrong with it."""
    raw = (DATA / "deploy" / "dstack_examples_rtmr3_app_compose.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == C.compose_hash(raw) == \
        "06768e6df639ce3be65e9e5321f8b2d82dbffb01c74323462d34c2feb9653aff"  # its report.json compose-hash event
    problems = "\n".join(audit(C.load(raw)))
    for reason in ("public_logs", "public_sysinfo", "not pinned by digest", "privileged: True", "network_mode: host",
                   "bind `/:/host/`", "legacy guest agent socket"):
        assert reason in problems, reason


def test_public_composes_findings() -> None:
    """dstack's training example: only its unpinned image. NEAR MPC's real CVM: the Docker socket, Docker's storage."""
    training = (DATA / "deploy" / "dstack_examples_training_docker_compose.yaml").read_text()
    assert compose_problems(training) == ["service jupyter (line 11): image 'unsloth/unsloth:latest' is not pinned by "
                                          "digest (name@sha256:<64 hex>)"]
    tcb = json.loads((DATA / "attestation" / "dstack_nearmpc_tcb_info.json").read_text())
    near = "\n".join(compose_problems(C.load(tcb["app_compose"].encode())["docker_compose_file"]))
    assert "service launcher (line 15): bind `/var/run/docker.sock:/var/run/docker.sock` reaches /run/docker.sock" in near
    assert "service signer-key-export (line 41): bind `/var/lib/docker/volumes:/volumes` reaches /var/lib/docker" in near


@pytest.mark.parametrize("loader", LOADERS)
def test_deeply_nested_compose_is_refused_not_a_crash(loader: type) -> None:
    """An app-compose.json in a bundle is untrusted: libyaml's composer recurses on the C stack and would crash
    the verifier on deep nesting, so depth is checked on the event stream first (both loaders, every entry point)."""
    import subprocess
    import sys

    hostile = "services: " + "[" * 200_000
    with pytest.raises(C.ComposeError, match="nested more than 32 levels"):
        compose_problems(hostile, loader)
    doc = {**_good(), "docker_compose_file": hostile}
    code = ("import json, sys\nfrom attestation.compose import app_compose as C\n"
            "try:\n    C.images(json.loads(sys.stdin.read()))\nexcept C.ComposeError as e:\n    print(e.message)\n")
    run = subprocess.run([sys.executable, "-c", code], input=json.dumps(doc), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "nested more than 32 levels" in run.stdout, (run.returncode, run.stderr[-500:])


# Text that PyYAML's safe loader turns into bytes, sets or dates while Docker Compose reads a string: refused when
# parsed, naming the line (each of these passed the audit while tags were honoured).
TAGGED = [
    ("binary-network-mode", _compose("network_mode: !!binary aG9zdA==\n"), "network_mode: !!binary"),  # "host"
    ("binary-pid", _compose("pid: !!binary aG9zdA==\n"), "pid: !!binary"),
    ("binary-volume", _compose("volumes:\n  - !!binary LzovaG9zdA==\n"), "- !!binary LzovaG9zdA=="),  # "/:/host"
    ("binary-long-source", _compose("volumes:\n  - type: bind\n    source: !!binary Lw==\n    target: /h\n"),
     "source: !!binary Lw=="),
    ("binary-security-opt", _compose("security_opt: [!!binary c2VjY29tcD11bmNvbmZpbmVk]\n"), "security_opt: [!!binary"),
    ("set", _compose("cap_drop: !!set {ALL}\n"), "cap_drop: !!set"),
    ("timestamp", _compose("labels: {a: !!timestamp 2026-01-01}\n"), "!!timestamp"),
    ("python-tag", _compose("command: !!python/object:os.system [id]\n"), "!!python"),
    ("local-tag", _compose("command: !custom x\n"), "!custom"),
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize(("text", "line_text"), [pytest.param(t, ln, id=i) for i, t, ln in TAGGED])
def test_tags_beyond_the_core_schema_are_refused_with_their_line(text: str, line_text: str, loader: type) -> None:
    line = max(n for n, s in enumerate(text.split("\n"), 1) if line_text in s)
    with pytest.raises(C.ComposeError, match=rf"line {line}, column \d+: tag !") as err:
        compose_problems(text, loader)
    assert type(err.value) is C.ComposeError
    with pytest.raises(C.ComposeError):
        audit({**GOOD, "docker_compose_file": text}, loader)


# Fields the audit used to skip: it now works from allow-lists, and each of these is a finding (with its line).
UNDERSTOOD_ONLY = [
    ("env-file-host", _compose("env_file: /dstack/.host-shared/.decrypted-env\n"), "`env_file:` reads a file",
     "env_file: /dstack"),
    ("env-file-long", _compose("env_file:\n  - path: ./app.env\n    required: false\n"), "`env_file:`", "env_file:"),
    ("config-from-env", _compose("configs: [c]\n", top="configs:\n  c: {environment: AGENT_TOKEN}\n"),
     "`environment:` fills it from the environment", "c: {environment"),
    ("secret-from-env", _compose("secrets: [s]\n", top="secrets:\n  s:\n    environment: X\n"),
     "`environment:` fills it", "environment: X"),
    ("seccomp-profile-file", _compose('security_opt: ["seccomp=/host/profile.json"]\n'), "not one this audit can judge",
     "security_opt:"),
    ("selinux-type", _compose('security_opt: ["label=type:spc_t"]\n'), "not one this audit can judge", "security_opt:"),
    ("external-host-network", _compose("networks: [hostnet]\n", top="networks:\n  hostnet: {name: host, external: true}\n"),
     "`external:` refers to something created outside", "hostnet: {name: host"),
    ("host-network-driver", _compose("networks: [n]\n", top="networks:\n  n: {driver: host}\n"), "driver 'host' is not bridge",
     "n: {driver: host}"),
    ("undefined-network", _compose("networks: [elsewhere]\n"), "'elsewhere' is not defined", "networks: [elsewhere]"),
    ("external-volume", _compose("volumes:\n  - v:/x\n", top="  v: {external: true}\n"), "`external:`", "v: {external"),
    ("nfs-volume", _compose("volumes:\n  - v:/x\n", top="  v:\n    driver_opts: {type: nfs, o: 'addr=10.0.2.2', device: ':/x'}\n"),
     "neither tmpfs nor a CVM path", "  v:"),
    ("volume-plugin", _compose("volumes:\n  - v:/x\n", top="  v: {driver: sshfs}\n"), "driver 'sshfs' is not local",
     "v: {driver: sshfs}"),
    ("unknown-service-field", _compose("use_api_socket: true\n"), "`use_api_socket:` is not a field", "use_api_socket"),
    ("post-start-hook", _compose("post_start:\n  - {command: id, privileged: true}\n"), "`post_start:` is not a field",
     "post_start:"),
    ("sysctls", _compose("sysctls: {net.ipv4.ip_forward: 1}\n"), "`sysctls:` is not a field", "sysctls:"),
    ("gpus-shortcut", _compose("gpus: all\n"), "`gpus:` is not a field", "gpus: all"),
    ("logging-driver", _compose("logging: {driver: syslog, options: {syslog-address: 'tcp://10.0.2.2:514'}}\n"),
     "`logging:` is not a field", "logging:"),
    ("unknown-top-level", _compose(prefix="models:\n  m: {model: ai/x}\n"), "`models:` is not a field", "models:"),
    ("deploy-field", _compose("deploy:\n  placement: {constraints: [x]}\n"), "`placement:` is not a field", "placement:"),
    ("gpu-options", _compose("deploy:\n  resources:\n    reservations:\n      devices: [{driver: nvidia, capabilities: [gpu],"
                             " options: {a: b}}]\n"), "`options:` is not a field", "options: {a: b}"),
    ("volume-type-image", _compose("volumes:\n  - type: image\n    source: alpine\n    target: /i\n"),
     "is not a bind, volume or tmpfs", "- type: image"),
    ("volume-long-unknown", _compose("volumes:\n  - type: volume\n    source: output\n    target: /o\n    x: 1\n"),
     "`x:` is not a field", "    x: 1"),
    ("bind-relative-no-dot", _compose("volumes:\n  - type: bind\n    source: host-shared\n    target: /h\n"),
     "is relative", "- type: bind"),
    ("secret-relative-no-dot", _compose("secrets: [s]\n", top="secrets:\n  s: {file: app-keys.json}\n"),
     "is relative", "secrets: [s]"),
    ("volume-mode-unknown", _compose("volumes:\n  - output:/o:ro,weird\n"), "not a form this audit can read",
     "- output:/o:ro,weird"),
    ("network-mode-not-string", _compose("network_mode: [host]\n"), "is not a string", "network_mode: [host]"),
    ("volumes-not-a-list", _compose("volumes: {a: b}\n"), "volumes is not a list", "volumes: {a: b}"),
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize(("text", "reason", "line_text"), [pytest.param(t, r, ln, id=i) for i, t, r, ln in UNDERSTOOD_ONLY])
def test_fields_the_audit_does_not_understand_are_findings(text: str, reason: str, line_text: str, loader: type) -> None:
    problems = compose_problems(text, loader)
    hits = [p for p in problems if reason in p]
    assert hits, problems
    line = max(n for n, s in enumerate(text.split("\n"), 1) if line_text in s)
    assert any(f"(line {line})" in p for p in hits), (line, hits)
    assert any(reason in p for p in audit({**GOOD, "docker_compose_file": text}, loader))


def test_only_the_unknown_field_is_a_finding() -> None:
    """Core-schema tags, extension fields and fields with no way out of the container pass; the unknown one does not."""
    text = _compose("x-note: anything\nhostname: side\nread_only: true\ntmpfs: [/tmp]\ncap_drop: [ALL]\n"
                    "ulimits: {nofile: 1024}\nhealthcheck: {test: [CMD, 'true'], interval: 30s}\nnetworks: [inner]\n"
                    "stop_signal: !!str SIGTERM\ncpus: !!float 2\ntty: !!bool false\nlabel_file: ./labels\n",
                    top="networks:\n  inner: {driver: bridge, internal: true}\n", prefix="x-base: &b {init: true}\n")
    line = text.split("\n").index("    label_file: ./labels") + 1
    assert compose_problems(text) == [f"service sidecar (line {line}): `label_file:` is not a field this audit "
                                      "understands; remove it (what the audit cannot judge is refused)"]


@pytest.mark.parametrize("loader", LOADERS)
def test_alias_bomb_compose_is_refused_quickly(loader: type) -> None:
    anchors = "x-l0: &l0 [a, a, a, a, a, a, a, a, a, a]\n" + "".join(
        f"x-l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 8))
    text = _compose("command: *l7\n", prefix=anchors)
    assert len(text) < 8000
    with pytest.raises(C.ComposeError, match="expand to more than 100000 nodes"):
        compose_problems(text, loader)
