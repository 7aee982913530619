"""The compose audit (``attestation.compose.audit``): a table of bad composes, each rejected with its offending line;
the public app-compose files keep their published compose-hash and are audited the same by both YAML loaders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation import compose as C

from app.deploy import render_deployment
from app.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "attestation"
IMAGE = "registry.example.com/cvm-tune@sha256:" + "5e" * 32
TOKEN = hashlib.sha256(b"audit-test-token").hexdigest()
BUNDLES_HEAD = "    restart: unless-stopped\n"
BUNDLES_VOLUME = "      - output:/data/output:ro          # no guest-agent socket: this container gets no keys\n"
TRAINER_HEAD = "    restart: on-failure\n"
TRAINER_VOLUME = "      - /var/run/dstack.sock:/var/run/dstack.sock   # guest agent: only this container may reach it\n"


def _good() -> dict[str, Any]:
    dep = render_deployment((REPO / "docker-compose.yaml").read_text(), IMAGE, C.AppComposeSettings(), bundles_token_sha256=TOKEN)
    return json.loads(dep.app_compose)


def _text(where: str, lines: str) -> str:
    text = _good()["docker_compose_file"]
    anchor = {"bundles": BUNDLES_HEAD, "bundles.volumes": BUNDLES_VOLUME, "trainer": TRAINER_HEAD, "trainer.volumes": TRAINER_VOLUME, "top": "services:\n"}[where]
    assert text.count(anchor) == 1, anchor
    return text.replace(anchor, anchor + lines) if where != "top" else text.replace(anchor, lines + anchor)


# (case, where the lines go, lines, expected finding, expected offending line)
BAD: list[tuple[str, str, str, str, str]] = [
    ("run dir", "bundles.volumes", "      - /run:/hostrun\n", "bundles can reach the guest agent", "- /run:/hostrun"),
    ("var/run dir", "bundles.volumes", "      - /var/run:/x\n", "bundles can reach the guest agent", "- /var/run:/x"),
    ("root", "bundles.volumes", "      - /:/host/\n", "bundles can reach the guest agent", "- /:/host/"),
    ("socket, other target", "bundles.volumes", "      - /var/run/dstack.sock:/agent.sock\n", "bundles can reach the guest agent", "- /var/run/dstack.sock:/agent.sock"),
    ("socket via /run", "bundles.volumes", "      - /run/dstack.sock:/s\n", "bundles can reach the guest agent", "- /run/dstack.sock:/s"),
    ("socket, obfuscated path", "bundles.volumes", "      - //var//run/../run/./dstack.sock:/s\n", "bundles can reach the guest agent", "- //var//run/../run/./dstack.sock:/s"),
    ("socket dir", "bundles.volumes", "      - /run/dstack/:/d\n", "bundles can reach the guest agent", "- /run/dstack/:/d"),
    ("var dir", "bundles.volumes", "      - /var:/v:ro\n", "bundles can reach the guest agent", "- /var:/v:ro"),
    ("tappd socket", "bundles.volumes", "      - /var/run/tappd.sock:/t\n", "bundles can reach the guest agent", "- /var/run/tappd.sock:/t"),
    ("docker socket", "bundles.volumes", "      - /var/run/docker.sock:/d\n", "bundles can reach the guest agent", "- /var/run/docker.sock:/d"),
    ("long syntax /run", "bundles.volumes", "      - type: bind\n        source: /run\n        target: /h\n", "bundles can reach the guest agent", "- type: bind"),
    ("long syntax socket", "bundles.volumes", "      - {type: bind, source: /var/run/dstack.sock, target: /s}\n", "bundles can reach the guest agent", "- {type: bind, source: /var/run/dstack.sock, target: /s}"),
    ("host bind", "bundles.volumes", "      - /tmp:/tmp\n", "bundles: binds host path '/tmp'", "- /tmp:/tmp"),
    ("relative bind", "bundles.volumes", "      - ./:/app\n", "bundles: binds host path './'", "- ./:/app"),
    ("docker volumes dir", "bundles.volumes", "      - /var/lib/docker/volumes:/v:ro\n", "bundles: binds host path", "- /var/lib/docker/volumes:/v:ro"),
    ("trainer binds root", "trainer.volumes", "      - /:/host\n", "cvm-tune can reach the guest agent", "- /:/host"),
    ("trainer volumes_from", "trainer", "    volumes_from: [bundles]\n", "cvm-tune: volumes_from", "volumes_from: [bundles]"),
    ("privileged", "bundles", "    privileged: true\n", "bundles: privileged", "privileged: true"),
    ("trainer privileged", "trainer", "    privileged: true\n", "cvm-tune: privileged", "privileged: true"),
    ("host network", "bundles", "    network_mode: host\n", "`network_mode: host`", "network_mode: host"),
    ("host pid", "bundles", "    pid: host\n", "`pid: host`", "pid: host"),
    ("pid of the trainer", "bundles", "    pid: \"service:cvm-tune\"\n", "`pid: service:cvm-tune`", "pid: \"service:cvm-tune\""),
    ("host ipc", "bundles", "    ipc: host\n", "`ipc: host`", "ipc: host"),
    ("host userns", "bundles", "    userns_mode: host\n", "`userns_mode: host`", "userns_mode: host"),
    ("cap_add", "bundles", "    cap_add: [SYS_ADMIN]\n", "bundles: cap_add ['SYS_ADMIN']", "cap_add: [SYS_ADMIN]"),
    ("devices", "bundles", "    devices:\n      - /dev/sda:/dev/sda\n", "bundles: `devices` maps host devices", "devices:"),
    ("cgroup rules", "bundles", "    device_cgroup_rules: ['c 1:3 mr']\n", "`device_cgroup_rules` maps host devices", "device_cgroup_rules: ['c 1:3 mr']"),
    ("non-GPU reservation", "bundles", "    deploy:\n      resources:\n        reservations:\n          devices:\n            - driver: cdi\n              device_ids: [x]\n", "bundles: device reservation other than", "devices:"),
    ("duplicate key", "bundles", "    security_opt: [\"seccomp:unconfined\"]\n", "duplicate key `security_opt`", "security_opt: [\"no-new-privileges:true\"]"),
    ("seccomp off", "raw", "services:\n  s:\n    image: " + IMAGE + "\n    security_opt: [\"seccomp:unconfined\"]\n", "turns off a confinement", "security_opt: [\"seccomp:unconfined\"]"),
    ("volumes_from", "bundles", "    volumes_from: [cvm-tune]\n", "bundles: volumes_from inherits", "volumes_from: [cvm-tune]"),
    ("extends", "bundles", "    extends: {service: cvm-tune}\n", "bundles: `extends`", "extends: {service: cvm-tune}"),
    ("interpolated privileged", "bundles", "    privileged: ${PRIV:-false}\n", "`privileged` interpolates a variable", "privileged: ${PRIV:-false}"),
    ("interpolated bind", "bundles.volumes", "      - ${SRC}:/x\n", "`volumes` interpolates a variable", "- ${SRC}:/x"),
    ("build", "bundles", "    build: .\n", "bundles: `build:`", "build: ."),
    ("unpinned sidecar", "top", "", "", ""),  # replaced below
    ("anchor merge", "top", "", "", ""),  # replaced below
    ("volume driver bind", "top", "", "", ""),  # replaced below
    ("secret file", "top", "", "", ""),  # replaced below
]
SIDECAR = "services:\n  sidecar:\n    image: busybox:latest\n"
BAD[-4] = ("unpinned sidecar", "raw", SIDECAR, "sidecar: image 'busybox:latest' is not pinned", "image: busybox:latest")
BAD[-3] = ("anchor merge", "raw", "x-base: &base\n  privileged: true\nservices:\n  sidecar:\n    <<: *base\n    image: " + IMAGE + "\n",
           "sidecar: privileged", "sidecar:")
BAD[-2] = ("volume driver bind", "raw", "services:\n  s:\n    image: " + IMAGE + "\n    volumes: [v:/v]\nvolumes:\n  v:\n"
           "    driver_opts: {type: none, o: bind, device: /run}\n", "volume v: driver_opts make it a bind of host path '/run'", "v:")
BAD[-1] = ("secret file", "raw", "services:\n  s:\n    image: " + IMAGE + "\n    secrets: [k]\nsecrets:\n  k:\n    file: /var/run/dstack.sock\n",
           "secrets k: `file: /var/run/dstack.sock`", "k:")


def _compose_text(where: str, lines: str) -> str:
    if where == "raw":
        return lines
    return _text(where, lines)


@pytest.mark.parametrize(("case", "where", "lines", "finding", "line"), BAD, ids=[b[0] for b in BAD])
def test_bad_compose_is_rejected_with_its_line(case: str, where: str, lines: str, finding: str, line: str) -> None:
    text = _compose_text(where, lines)
    doc = {**_good(), "docker_compose_file": text}
    problems = C.audit(doc)
    hits = [p for p in problems if finding in p]
    assert hits, problems
    candidates = [n for n, ln in enumerate(text.splitlines(), 1) if ln.strip() == line]
    assert any(f"(line {n}: `{line}`)" in p for p in hits for n in candidates), hits


def test_bad_compose_table_covers_every_rule() -> None:
    assert len(BAD) >= 35


def test_render_refuses_a_bad_compose_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    template = (REPO / "docker-compose.yaml").read_text().replace(
        "      - output:/data/output:ro          # no guest-agent socket", "      - /run:/hostrun\n      - output:/data/output:ro          # no")
    with pytest.raises(ConfigError, match="bundles can reach the guest agent"):
        render_deployment(template, IMAGE, C.AppComposeSettings(), bundles_token_sha256=TOKEN)
    (tmp_path / "compose.yaml").write_text(template)
    out = tmp_path / "deploy"
    assert main(["app-compose", "--image", IMAGE, "--compose", str(tmp_path / "compose.yaml"), "--out-dir", str(out),
                 "--bundles-token-sha256", TOKEN]) == 2
    assert not out.exists()
    assert "/run:/hostrun" in capsys.readouterr().err


def test_issue_example_second_service_fails_compose_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second service with `/run:/hostrun`, privileged and host network: compose-hash exits 1 and names each line."""
    from app.cli import main

    doc = _good()
    doc["docker_compose_file"] = _text("bundles", "    privileged: true\n    network_mode: host\n").replace(
        BUNDLES_VOLUME, BUNDLES_VOLUME + "      - /run:/hostrun\n")
    (tmp_path / "app-compose.json").write_bytes(json.dumps(doc, indent=4).encode())
    assert main(["compose-hash", str(tmp_path / "app-compose.json"), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [p.split(" (line")[0].split(":")[0] for p in problems] == [
        "service bundles", "service bundles", "service bundles can reach the guest agent (and so the app's keys) through the bind of '/run'"]


def test_public_app_compose_files_keep_their_published_hash_and_fail_the_audit() -> None:
    """dstack-examples attestation/rtmr3-based (hash published in its report.json's compose-hash event) and NEAR MPC."""
    raw = (DATA / "dstackexamples_rtmr3_app_compose.json").read_bytes()
    report = json.loads((DATA / "dstackexamples_rtmr3_report.json").read_text())
    events = {e["event"]: e["event_payload"] for e in json.loads(report["event_log"]) if e["imr"] == 3}
    assert C.compose_hash(raw) == events["compose-hash"] == "06768e6df639ce3be65e9e5321f8b2d82dbffb01c74323462d34c2feb9653aff"
    problems = C.audit(C.load(raw), raw)
    assert [p.split(" (line")[0].split(" (app-compose.json")[0] for p in problems] == [
        "public_logs is not false: container logs would be served on the guest agent's public port",
        "public_sysinfo is not false: system information would be served on the guest agent's public port",
        "service jupyter: image 'quay.io/jupyter/base-notebook' is not pinned by digest (name@sha256:<64 hex>)",
        "service jupyter: privileged containers reach every device and the guest agent",
        "service jupyter: `network_mode: host` shares a namespace with the CVM or another container",
        "service jupyter can reach the guest agent (and so the app's keys) through the bind of '/'",
        "service jupyter can reach the guest agent (and so the app's keys) through the bind of '/var/run/tappd.sock'",
    ]
    assert "(line 12: `- /:/host/`)" in problems[5] and '(app-compose.json line 1: `"public_logs":true`)' in problems[0]


@pytest.mark.parametrize("loader", [yaml.SafeLoader, getattr(yaml, "CSafeLoader", yaml.SafeLoader)])
def test_both_yaml_loaders_give_the_same_audit(loader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    near = json.loads((DATA / "dstack_nearmpc_tcb_info.json").read_text())["app_compose"].encode()
    rtmr3 = (DATA / "dstackexamples_rtmr3_app_compose.json").read_bytes()
    corpora = [(json.dumps(_good()).encode())] + [near, rtmr3]
    corpora += [json.dumps({**_good(), "docker_compose_file": _compose_text(w, ln)}).encode() for _, w, ln, _, _ in BAD]
    monkeypatch.setattr(C, "LOADER", yaml.SafeLoader)
    reference = [C.audit(C.load(raw), raw) for raw in corpora]
    monkeypatch.setattr(C, "LOADER", loader)
    assert [C.audit(C.load(raw), raw) for raw in corpora] == reference
