"""Deployment: the Dockerfile, the compose file and the locks keep their invariants; dstack's compose-hash and
app-id are computed as dstack does (checked on real captures); the container's entry command runs end to end with
the volumes laid out as in the compose file; env encryption and the bundle server work."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.compose import app_compose as C
from attestation.compose.audit import audit as compose_audit
from attestation.bundle.manifest import BuildInfo, Manifest
from attestation.bundle.verify import _build
from attestation.policy import simulator_policy
from attestation.verify import QuoteFindings

from app.run.build_info import lock_mismatches, lock_pins
from app.config import load_config
from app.deploy.app_compose import check_env, encrypt_env, render_deployment, verify_public_key
from app.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "attestation"
TEST_IMAGE = "registry.example.com/cvm-tune@sha256:" + "5e" * 32
SMOKE_TOKEN = "smoke-test-token"
DIGEST_PINNED = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


# ---------------------------------------------------------------- parsing the deployment files
def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def _dockerfile(flavor: str = "cpu") -> dict[str, Any]:
    """Global ARGs, stages, and the final stage's ENV (ARGs expanded), COPY targets, USER, ENTRYPOINT, CMD, HEALTHCHECK."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    args: dict[str, str] = {}
    stages: list[dict[str, Any]] = []
    for line in (ln.strip() for ln in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr == "FROM":
            stages.append({"from": rest.strip(), "lines": []})
        elif instr == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif stages:
            stages[-1]["lines"].append((instr, rest.strip()))
    args["FLAVOR"] = flavor

    def expand(value: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)

    final = stages[-1]
    out: dict[str, Any] = {"args": args, "stages": stages, "env": {}, "copy": {}, "run": []}
    for instr, rest in final["lines"]:
        if instr == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                out["env"][key] = expand(value)
        elif instr == "COPY" and not rest.startswith("--from"):
            src, dst = expand(rest).split()
            out["copy"][dst] = src
        elif instr in ("ENTRYPOINT", "CMD"):
            out[instr.lower()] = json.loads(rest)
        elif instr == "HEALTHCHECK":
            out["healthcheck"] = json.loads(rest.split(" CMD ", 1)[1])
        elif instr in ("USER", "RUN"):
            out[instr.lower()] = rest if instr == "USER" else [*out["run"], rest]
    return out


def _ci_install_line() -> str:
    return next(ln for ln in (REPO / ".ci" / "run").read_text().splitlines()
                if "requirements/install.sh" in ln and not ln.startswith("#"))


# ---------------------------------------------------------------- Dockerfile
def test_dockerfile_pins_its_base_by_digest_and_builds_in_two_stages() -> None:
    df = _dockerfile()
    assert DIGEST_PINNED.match(df["args"]["BASE_IMAGE"]) and C.image_digest(df["args"]["BASE_IMAGE"]) != C.PLACEHOLDER_DIGEST
    assert [s["from"] for s in df["stages"]] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"], "every stage from the pinned base"
    final = [instr for instr, _ in df["stages"][-1]["lines"]]
    copies = [rest for instr, rest in df["stages"][-1]["lines"] if instr == "COPY"]
    assert "--from=build /opt/venv /opt/venv" in copies, "the final stage takes only the built venv"
    assert not any(c.split()[0] in ("app/", "attestation/", ".", "requirements/") for c in copies), "no source tree in the image"
    run = " ".join(df["run"])
    assert not re.search(r"apt-get|gcc|build-essential|pip install", run), "no build tools or installs in the final stage"
    assert "ADD" not in final


def test_dockerfile_installs_with_the_ci_script_and_lock() -> None:
    build = " ".join(rest for instr, rest in _dockerfile()["stages"][0]["lines"] if instr == "RUN")
    assert "sh requirements/install.sh /opt/venv requirements/${FLAVOR}.lock" in build
    assert "sh requirements/install.sh .venv requirements/test.lock --editable" in _ci_install_line()
    assert "-r cpu.lock" in (REPO / "requirements" / "test.lock").read_text().splitlines(), "CI installs cpu.lock itself"
    for flavor in ("cpu", "gpu"):
        assert (REPO / "requirements" / f"{flavor}.lock").is_file()
    assert "PIP_NO_CACHE_DIR=1" in " ".join(rest for instr, rest in _dockerfile()["stages"][0]["lines"] if instr == "ENV")


def test_gpu_image_build_checks_the_triton_toolchain() -> None:
    """The GPU flavor's final stage runs the same check as a CUDA training run (the app's own function)."""
    run = " ".join(_dockerfile("gpu")["run"])
    assert 'if [ "$FLAVOR" = gpu ]' in run and "from app.training.options import triton_toolchain_problem" in run
    code = re.search(r'python -c "([^"]+)"', run)
    assert code is not None
    ok = subprocess.run([sys.executable, "-c", code.group(1)], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr  # this machine has a compiler and headers (or no triton at all)


def test_dockerfile_runtime_settings() -> None:
    from app.training import OFFLINE_ENV

    df = _dockerfile()
    assert df["user"] == "10001" and "useradd --uid 10001" in " ".join(df["run"]), "non-root user"
    assert "chown 10001:10001 /data/output" in " ".join(df["run"]), "a new output volume is writable for the app user"
    for key, value in OFFLINE_ENV.items():
        assert df["env"][key] == value, f"{key} must be set in the image"
    assert df["copy"]["/etc/cvm-tune/config.yaml"] == "configs/dstack.yaml"
    assert df["healthcheck"] == ["cvm-tune", "status", "--health", "--config", "/etc/cvm-tune/config.yaml"]
    assert df["entrypoint"] == ["cvm-tune"] and df["cmd"] == _compose()["services"]["cvm-tune"]["command"]
    assert df["env"]["CVM_TUNE_LOCK_FILE"] == "/opt/cvm-tune/requirements/cpu.lock"
    assert df["copy"][df["env"]["CVM_TUNE_LOCK_FILE"]] == "requirements/cpu.lock", "the image ships the lock it installed"


# ---------------------------------------------------------------- docker-compose.yaml
def test_compose_service_invariants() -> None:
    svcs = _compose()["services"]
    svc = svcs["cvm-tune"]
    for name, s in svcs.items():
        assert DIGEST_PINNED.match(s["image"]), f"{name}: image pinned by digest"
        assert s["init"] is True, f"{name}: PID 1 must forward SIGTERM (init: true)"
        assert "build" not in s and s["restart"] in ("on-failure", "unless-stopped", "always")
    vols = svc["volumes"]
    assert "/var/run/dstack.sock:/var/run/dstack.sock" in vols
    assert [n for n, s in svcs.items() if any(v.startswith("/var/run/dstack.sock:") for v in s.get("volumes", []))] == ["cvm-tune"]
    assert "dataset:/data/dataset:ro" in vols, "inputs read-only"
    assert not any("/models" in v for v in vols), "the base model is a layer of the deployment image: stored once"
    assert "output:/data/output" in vols and svcs["bundles"]["volumes"] == ["output:/data/output:ro"]
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert re.search(r"^\d+s$", svc["stop_grace_period"]) and int(svc["stop_grace_period"][:-1]) < 90


def test_compose_has_no_secrets_in_clear() -> None:
    for name, svc in _compose()["services"].items():
        for var, value in C.env_entries(svc).items():
            if C.SECRET_NAME.search(var) and not var.endswith("_SHA256"):
                assert value is None, f"{name}: {var} must come from dstack's encrypted env"


def test_dstack_config_matches_compose_mounts() -> None:
    cfg = load_config(REPO / "configs" / "dstack.yaml")
    assert cfg.tee.mode == "dstack" and cfg.dataset.key.source == "getkey"
    mounts = {v.split(":")[1]: v for v in _compose()["services"]["cvm-tune"]["volumes"]}
    assert mounts["/data/dataset"].endswith(":ro") and str(cfg.dataset.path).startswith("/data/dataset/")
    assert not any(str(cfg.base_model.path).startswith(m) for m in mounts), "the model is in the image, not on a volume"
    assert str(cfg.output.dir) == "/data/output"


def _deployment(**kw: Any) -> Any:
    template = (REPO / "docker-compose.yaml").read_text()
    token = hashlib.sha256(SMOKE_TOKEN.encode()).hexdigest()
    return render_deployment(template, kw.pop("image", TEST_IMAGE), C.AppComposeSettings(**kw), bundles_token_sha256=token)


def test_app_compose_for_the_template_is_what_dstack_expects() -> None:
    dep = _deployment()
    doc = json.loads(dep.app_compose)
    assert list(doc)[:4] == ["manifest_version", "name", "runner", "docker_compose_file"]
    assert doc["public_logs"] is False and doc["public_sysinfo"] is False and doc["kms_enabled"] is True
    assert doc["allowed_envs"] == ["CVM_TUNE_ALERT_WEBHOOK"], "pass-through variables, nothing else"
    assert C.images(doc) == {"cvm-tune": TEST_IMAGE, "bundles": TEST_IMAGE}
    assert compose_audit(doc) == [] and dep.compose_hash == hashlib.sha256(dep.app_compose).hexdigest()
    assert dep.app_id is None, "with KMS the app id is the deployment's, not the file's"
    assert _deployment(kms_enabled=False).app_id == _deployment(kms_enabled=False).compose_hash[:40]


def test_render_refuses_placeholders_unpinned_images_and_public_logs() -> None:
    template = (REPO / "docker-compose.yaml").read_text()
    for image in ("registry.example.com/cvm-tune:latest", f"registry.example.com/cvm-tune@{C.PLACEHOLDER_DIGEST}"):
        with pytest.raises(ConfigError, match="not pinned by digest"):
            render_deployment(template, image, C.AppComposeSettings(), bundles_token_sha256="ab" * 32)
    with pytest.raises(ConfigError, match="SHA-256 of your bearer token"):
        render_deployment(template, TEST_IMAGE, C.AppComposeSettings(), bundles_token_sha256=None)
    with pytest.raises(ConfigError, match="public_logs"):
        _deployment(public_logs=True)
    leaky = template.replace("- TZ=UTC", "- HF_TOKEN=hf_secret")
    with pytest.raises(ConfigError, match="HF_TOKEN has a value in clear"):
        render_deployment(leaky, TEST_IMAGE, C.AppComposeSettings(), bundles_token_sha256="ab" * 32)


# ---------------------------------------------------------------- compose-hash and app-id on real captures
def _runtime_events(path: Path) -> dict[str, str]:
    return {e["event"]: e["event_payload"] for e in json.loads(path.read_text()) if e["imr"] == 3}


def test_compose_hash_and_app_id_match_a_real_dstack_cvm() -> None:
    """NEAR MPC's dstack 0.5.8 node (KMS off): the file reproduces, and hashes to the measured values."""
    tcb = json.loads((DATA / "dstack_nearmpc_tcb_info.json").read_text())
    raw = tcb["app_compose"].encode()
    doc = C.load(raw)
    events = _runtime_events(DATA / "dstack_nearmpc_event_log.json")
    digest = C.compose_hash(raw)
    assert digest == events["compose-hash"] == tcb["compose_hash"]
    assert C.app_id(doc, digest) == events["app-id"] == digest[:40]
    quote = (DATA / "dstack_nearmpc_quote.bin").read_bytes()
    assert quote[232:280].hex() == C.mr_config_id_v1(digest), "MRCONFIGID (TD report body offset 184) = 01 || compose-hash"
    public = json.loads((DATA / "dstack_nearmpc_public_data.json").read_text())["tee_participant_info"]["Dstack"]
    assert C.compose_hash(public["tcb_info"]["app_compose"].encode()) == digest
    # dstack's vmm-cli writes exactly these bytes for these settings (indent 4, its key order, no newline).
    settings = C.AppComposeSettings(name=doc["name"], kms_enabled=False, gateway_enabled=False, local_key_provider_enabled=True,
                                    public_logs=True, public_sysinfo=True, no_instance_id=True, secure_time=False)
    assert C.render(doc["docker_compose_file"], settings) == raw
    assert C.compose_hash(C.render(doc["docker_compose_file"], settings, style="normalized")) != digest, "the bytes matter"


def test_normalized_form_matches_the_dstack_sdk() -> None:
    from dstack_sdk import get_compose_hash

    doc = json.loads(_deployment().app_compose)
    normalized = C.render(doc["docker_compose_file"], C.AppComposeSettings(allowed_envs=tuple(doc["allowed_envs"])), style="normalized")
    assert C.compose_hash(normalized) == get_compose_hash(doc)


def test_kms_app_id_is_not_derivable_from_the_compose_hash() -> None:
    """The official simulator's capture (KMS key provider): its app-id is not compose_hash[:20]."""
    events = _runtime_events(DATA / "dstack_simulator_event_log.json")
    assert events["app-id"] != events["compose-hash"][:40]
    quote = (DATA / "dstack_simulator_quote.bin").read_bytes()
    assert quote[232:280].hex() == C.mr_config_id_v1(events["compose-hash"])
    assert C.app_id({"kms_enabled": True}, events["compose-hash"]) is None
    assert C.app_id({"kms_enabled": True}, events["compose-hash"], pinned_app_id="0x" + events["app-id"]) == events["app-id"]


def test_compose_hash_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    tcb = json.loads((DATA / "dstack_nearmpc_tcb_info.json").read_text())
    (tmp_path / "app-compose.json").write_text(tcb["app_compose"])
    assert main(["compose-hash", str(tmp_path / "app-compose.json"), "--json"]) == 1, "public logs, Docker socket: refused"
    out = json.loads(capsys.readouterr().out)
    assert (out["compose_hash"], out["app_id"]) == (tcb["compose_hash"], tcb["compose_hash"][:40])
    assert out["problems"][0] == "public_logs is not false: container logs would be served on the guest agent's public port"
    assert any("/var/run/docker.sock" in p for p in out["problems"])  # the bad-compose table: tests/test_compose_audit.py
    assert main(["app-compose", "--image", TEST_IMAGE, "--compose", str(REPO / "docker-compose.yaml"), "--out-dir",
                 str(tmp_path / "d"), "--bundles-token-sha256", "ab" * 32]) == 0
    assert main(["compose-hash", str(tmp_path / "d" / "app-compose.json")]) == 0
    assert C.compose_hash((tmp_path / "d" / "app-compose.json").read_bytes()) in capsys.readouterr().out
    assert main(["compose-hash", str(tmp_path / "missing.json")]) == 2


# ---------------------------------------------------------------- locks and the install script
@pytest.mark.parametrize("name", ["verify", "cpu", "test", "gpu"])
def test_lock_is_up_to_date_with_its_pins(name: str) -> None:
    sys.path.insert(0, str(REPO / "requirements"))
    try:
        import lock
    finally:
        sys.path.remove(str(REPO / "requirements"))
    assert not lock.is_stale(name), f"requirements/{name}.lock is stale: run .venv/bin/python requirements/lock.py {name}"
    _, pins = lock.parse_pins(REPO / "requirements" / f"{name}.txt")
    text = (REPO / "requirements" / f"{name}.lock").read_text()
    locked = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\$", text, re.M))
    inherited = set(lock_pins(REPO / "requirements" / "cpu.lock")) if name == "test" else set()
    assert {p: v for p, v in pins if p not in inherited} == locked
    for entry in re.split(r"\n(?=[A-Za-z])", text.split("\n", 3)[3]):
        if "==" in entry:
            assert re.search(r"--hash=sha256:[0-9a-f]{64}", entry), f"no hash for {entry.splitlines()[0]}"


def test_the_verifier_pins_are_the_versions_every_lock_installs() -> None:
    """verify.lock (the verifier alone) holds no training package and nothing CI does not test: each of its pins is
    the version cpu.txt and gpu.txt pin."""
    sys.path.insert(0, str(REPO / "requirements"))
    try:
        import lock
    finally:
        sys.path.remove(str(REPO / "requirements"))
    verify = dict(lock.parse_pins(REPO / "requirements" / "verify.txt")[1])
    assert not {"torch", "transformers", "peft", "trl", "opacus", "flwr", "datasets"} & set(verify)
    for other in ("cpu", "gpu"):
        pins = dict(lock.parse_pins(REPO / "requirements" / f"{other}.txt")[1])
        assert {p: pins.get(p) for p in verify} == verify, other


def test_this_environment_is_the_cpu_lock() -> None:
    """CI installed test.lock (= cpu.lock + test tools) through install.sh: every cpu pin is what is installed."""
    assert lock_mismatches(REPO / "requirements" / "cpu.lock") == []


def test_readme_starts_with_two_commands_and_ci_runs_the_second() -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```(?:sh|bash)?\n(.*?)```", text, re.S)
    assert block, "README must start with a code block of set-up commands"
    commands = [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', commands[1]], ".ci/run is the README's command alone"
    assert "cvm-tune run" in commands[0] and "sh requirements/install.sh .venv requirements/cpu.lock --editable" in commands[0]


# ---------------------------------------------------------------- the container's entry command, without docker
def _host_path(container_path: str, mounts: dict[str, Path]) -> Path:
    for target, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if container_path == target or container_path.startswith(target + "/"):
            return host / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{container_path} is on no volume of the compose file")


def _read_only(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.chmod(Path(dirpath) / name, 0o444)
        os.chmod(dirpath, 0o555)


@pytest.fixture(scope="module")
def container_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the compose file's cvm-tune command as the image would: Dockerfile ENV + compose environment, the image's
    config with its container paths mapped onto temp dirs standing in for the compose volumes, the guest agent
    (the cvm-tune simulator serving the app-compose.json rendered from docker-compose.yaml) at the socket mount."""
    from app.dataset import DerivedKeySource, encrypt_file
    from app.tee import GuestAgent
    from app.training import build_tiny_model
    from dstack_sdk import DstackClient

    tmp = tmp_path_factory.mktemp("cvm")
    df, svc = _dockerfile("cpu"), _compose()["services"]["cvm-tune"]
    dep = _deployment()
    (tmp / "app-compose.json").write_bytes(dep.app_compose)
    sock_dir = Path(tempfile.mkdtemp(prefix="cvm-", dir="/tmp"))  # unix socket paths must stay short
    sock = sock_dir / "dstack.sock"
    sim = subprocess.Popen([sys.executable, "-m", "app", "simulator", "--socket", str(sock), "--app-compose",
                            str(tmp / "app-compose.json")], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert "TEST CA" in sim.stdout.readline()
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        mounts: dict[str, Path] = {}
        for volume in svc["volumes"]:
            src, dst = volume.split(":")[:2]
            mounts[dst] = sock if src.startswith("/") else tmp / "volumes" / src
            if not src.startswith("/"):
                mounts[dst].mkdir(parents=True, exist_ok=True)
        layer = tmp / "deployment-image" / "models"  # the base model: a read-only layer of the deployment image
        mounts["/opt/cvm-tune/models"] = layer
        cfg = yaml.safe_load((REPO / df["copy"]["/etc/cvm-tune/config.yaml"]).read_text())
        for section, key in (("dataset", "path"), ("base_model", "path"), ("output", "dir")):
            cfg[section][key] = str(_host_path(cfg[section][key], mounts))
        cfg["training"].update(max_steps=3, per_device_batch_size=2, gradient_accumulation_steps=1, max_length=64,
                               save_steps=2, logging_steps=1)
        config = tmp / "etc" / "config.yaml"
        config.parent.mkdir()
        config.write_text(yaml.safe_dump(cfg))
        # The data owner encrypted the dataset to this app's GetKey-derived key; the base model was placed in advance.
        agent = GuestAgent(DstackClient(str(sock), timeout=30), endpoint=str(sock), mode="dstack")
        key = DerivedKeySource(agent.get_key, cfg["dataset"]["key"]["getkey_path"]).dataset_key()
        with resources.as_file(resources.files("app") / "data" / "sample.jsonl") as sample:
            encrypt_file(sample, Path(cfg["dataset"]["path"]), key, dataset_id="smoke", dataset_version=1)
            first_row = sample.read_text().splitlines()[0]
        build_tiny_model(Path(cfg["base_model"]["path"]))
        _read_only(layer)
        for volume in svc["volumes"]:
            if volume.endswith(":ro"):
                _read_only(mounts[volume.split(":")[1]])
        command = df["entrypoint"] + svc["command"]
        if command[1] == "serve":  # the service mode: run the due slot once and exit
            command.append("--once")
        command = [str(config) if arg == "/etc/cvm-tune/config.yaml" else arg for arg in command]
        env = {**os.environ, **{k: v for k, v in df["env"].items() if k not in ("PATH", "HOME")},
               **{k: v for k, v in C.env_entries(svc).items() if v is not None},
               "DSTACK_SIMULATOR_ENDPOINT": str(sock)}  # stands in for the /var/run/dstack.sock mount
        env["CVM_TUNE_LOCK_FILE"] = str(REPO / df["copy"][df["env"]["CVM_TUNE_LOCK_FILE"]])
        assert command[0] == "cvm-tune"
        home = tmp / "home"
        home.mkdir()
        proc = subprocess.run([sys.executable, "-m", "app", *command[1:]], env=env, cwd=home, capture_output=True,
                              text=True, timeout=600)
    finally:
        sim.terminate()
        sim.wait(timeout=20)
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {"proc": proc, "output": _host_path("/data/output", mounts), "dep": dep, "df": df, "first_row": first_row}


def test_container_command_runs_against_the_simulator(container_run: dict[str, Any]) -> None:
    from attestation import verify_bundle

    from app.simulator import GuestAgentSimulator

    exports = [p for p in (container_run["output"] / "exports").iterdir() if p.is_dir()]  # PROMOTED, CANDIDATE: pointers
    assert len(exports) == 1
    manifest = Manifest.model_validate_json((exports[0] / "manifest.json").read_bytes())
    assert manifest.tee.mode == "dstack" and manifest.tee.compose_hash == container_run["dep"].compose_hash
    b = manifest.build
    assert b is not None and b.image == TEST_IMAGE and b.image_digest == C.image_digest(TEST_IMAGE)
    assert b.base_image == container_run["df"]["args"]["BASE_IMAGE"] and b.lock_file == "cpu.lock"
    assert b.lock_sha256 == hashlib.sha256((REPO / "requirements" / "cpu.lock").read_bytes()).hexdigest()
    assert b.lock_mismatches == []
    verdict = verify_bundle(exports[0], policy=simulator_policy(GuestAgentSimulator().test_root_ca_der), now=int(time.time()))
    status = {c.name: c.status for c in verdict.checks}
    assert verdict.accepted, [c for c in verdict.checks if c.status == "fail"]
    assert status["build.image"] == status["build.lock"] == status["compose.hash"] == "pass"
    logs = container_run["proc"].stdout + container_run["proc"].stderr
    assert ("Export bundle:" in logs or "service: succeeded" in logs), logs[-2000:]
    assert container_run["first_row"][:60] not in logs, "no dataset content in the logs"


def test_verifier_build_checks_compare_with_the_measured_compose(tmp_path: Path) -> None:
    doc = json.loads(_deployment().app_compose)
    (tmp_path / "app-compose.json").write_text(json.dumps(doc))
    good = {"image": TEST_IMAGE, "image_digest": C.image_digest(TEST_IMAGE), "base_image": None, "lock_file": "cpu.lock",
            "lock_sha256": "ab" * 32, "lock_mismatches": []}
    cases = [(good, "pass", "pass"), ({**good, "image": TEST_IMAGE.replace("5e", "6f")}, "fail", "pass"),
             ({**good, "lock_mismatches": ["trl: 1.15.0 installed, lock 1.16.0"]}, "pass", "fail"), (None, "fail", "skip")]
    for build, image_status, lock_status in cases:
        m = Manifest.model_construct(build=None if build is None else BuildInfo(**build))
        f = QuoteFindings()
        _build(f, tmp_path, m)
        assert [(c.name, c.status) for c in f.checks] == [("build.image", image_status), ("build.lock", lock_status)]


# ---------------------------------------------------------------- bundles out of the CVM
def test_bundle_server_serves_only_with_the_token(container_run: dict[str, Any], tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    from attestation import verify_bundle

    from app.service.bundles import BundleServer, fetch, list_runs
    from app.errors import StateError
    from app.simulator import GuestAgentSimulator

    pinned = hashlib.sha256(SMOKE_TOKEN.encode()).hexdigest()
    assert f"CVM_TUNE_BUNDLES_TOKEN_SHA256={pinned}" in container_run["dep"].docker_compose
    server = BundleServer(container_run["output"], pinned, host="127.0.0.1", port=0).start()
    try:
        runs = list_runs(server.url, SMOKE_TOKEN)
        assert len(runs) == 1 and runs[0]["exported"] and runs[0]["status"] == "exported"
        with pytest.raises(StateError, match="HTTP 401"):
            list_runs(server.url, "wrong")
        for path in ("/v1/bundles/../runs", f"/v1/bundles/{runs[0]['run_id']}/..%2F..%2Fstate%2Faudit.jsonl"):
            req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {SMOKE_TOKEN}"})
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(req, timeout=10)
        out = fetch(server.url, runs[0]["run_id"], tmp_path, SMOKE_TOKEN)
        # The service's first night is promoted: /v1/promoted lists that bundle.
        req = urllib.request.Request(server.url + "/v1/promoted", headers={"Authorization": f"Bearer {SMOKE_TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            promoted = json.loads(resp.read())
        assert runs[0]["promoted"] and promoted["run_id"] == runs[0]["run_id"] and "manifest.json" in promoted["files"]
    finally:
        server.stop()
    verdict = verify_bundle(out, policy=simulator_policy(GuestAgentSimulator().test_root_ca_der), now=int(time.time()))
    assert verdict.accepted


def test_bundle_token_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    from app.service.bundles import new_token, read_token

    digest = new_token(tmp_path / "t")
    assert stat.S_IMODE((tmp_path / "t").stat().st_mode) == 0o600
    assert hashlib.sha256(read_token(tmp_path / "t").encode()).hexdigest() == digest
    with pytest.raises(ConfigError):
        new_token(tmp_path / "t")


# ---------------------------------------------------------------- dstack encrypted env
def _dh_decrypt(blob_hex: str, private_key: Any) -> dict[str, Any]:
    """dstack-util's dh_decrypt (crypto.rs), re-implemented: eph_pk(32) || iv(12) || AES-256-GCM(X25519 secret)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    blob = bytes.fromhex(blob_hex)
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(blob[:32]))
    return dict(json.loads(AESGCM(shared).decrypt(blob[32:44], blob[44:], None)))


def test_env_encrypt_round_trip_without_echoing_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from app.cli import main

    sk = X25519PrivateKey.generate()
    pk = sk.public_key().public_bytes_raw().hex()
    secret = "https://hooks.example.com/T0KEN-never-printed"
    (tmp_path / "env").write_text(f"# alerts\nCVM_TUNE_ALERT_WEBHOOK={secret}\n")
    (tmp_path / "app-compose.json").write_bytes(_deployment().app_compose)
    assert main(["env", "encrypt", "--public-key", pk, "--env-file", str(tmp_path / "env"), "--app-compose",
                 str(tmp_path / "app-compose.json"), "-o", str(tmp_path / "blob")]) == 0
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err and "not authenticated" in captured.err
    assert _dh_decrypt((tmp_path / "blob").read_text().strip(), sk) == {"env": [{"key": "CVM_TUNE_ALERT_WEBHOOK", "value": secret}]}
    (tmp_path / "env2").write_text(f"HF_TOKEN={secret}\n")
    assert main(["env", "encrypt", "--public-key", pk, "--env-file", str(tmp_path / "env2"), "--app-compose",
                 str(tmp_path / "app-compose.json")]) == 2
    err = capsys.readouterr().err
    assert "allowed_envs" in err and secret not in err


def test_env_checks_follow_dstack_limits() -> None:
    with pytest.raises(ConfigError, match="not a valid variable name"):
        check_env({"1BAD": "x"}, None)
    with pytest.raises(ConfigError, match="bytes"):
        check_env({"BIG": "x" * (128 * 1024 + 1)}, None)
    with pytest.raises(ConfigError, match="32 bytes"):
        encrypt_env({"A": "b"}, "abcd")


def test_env_public_key_must_be_signed_by_the_pinned_kms() -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from eth_keys import keys
    from eth_utils import keccak

    pub = X25519PrivateKey.generate().public_key().public_bytes_raw()
    app_id, ts = "ab" * 20, int(time.time())
    kms = keys.PrivateKey(hashlib.sha256(b"test kms").digest())
    sig = kms.sign_msg_hash(keccak(b"dstack-env-encrypt-pubkey:" + bytes.fromhex(app_id) + ts.to_bytes(8, "big") + pub))
    signer = kms.public_key.to_compressed_bytes().hex()
    verify_public_key(pub.hex(), sig.to_bytes().hex(), app_id, ts, signer)
    other = keys.PrivateKey(hashlib.sha256(b"other").digest()).public_key.to_compressed_bytes().hex()
    with pytest.raises(ConfigError, match="not by the KMS signer"):
        verify_public_key(pub.hex(), sig.to_bytes().hex(), app_id, ts, other)
    with pytest.raises(ConfigError, match="not by the KMS signer"):  # another app's key: recovers another signer
        verify_public_key(pub.hex(), sig.to_bytes().hex(), "cd" * 20, ts, signer)
    old = ts - 3600
    stale = kms.sign_msg_hash(keccak(b"dstack-env-encrypt-pubkey:" + bytes.fromhex(app_id) + old.to_bytes(8, "big") + pub))
    with pytest.raises(ConfigError, match="does not verify"):
        verify_public_key(pub.hex(), stale.to_bytes().hex(), app_id, old, signer)
