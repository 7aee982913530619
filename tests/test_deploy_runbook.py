"""docs/deploy.md is a tested runbook: every deploy-tool command in it uses the tool's documented flags, and the
commands cvm-tune prints (deploy-plan, app-compose, bundles token) are the ones the page shows."""
from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from app.cli import main
from app.deploy.plan import needs

REPO = Path(__file__).resolve().parent.parent
DEPLOY_MD = REPO / "docs" / "deploy.md"
IMAGE = "registry.example.com/cvm-tune-data@sha256:" + "5e" * 32

# The flags each tool documents, recorded from its source (commands and subcommands as the page uses them).
DOCUMENTED: dict[tuple[str, ...], set[str]] = {
    # Phala-Network/phala-cloud, cli/src/commands/deploy/command.ts @ 0013b054 (CLI 1.1.x: `-t/--instance-type`,
    # `--no-public-logs`, `--no-public-sysinfo`, `-e` KEY=VALUE or env file) + core/common-flags (cvm-id, uuid,
    # interactive, private-key, rpc-url, transaction-hash) and the global --json / --api-token.
    ("phala", "deploy"): {
        "--cvm-id", "--uuid", "-i", "--interactive", "--debug", "-n", "--name", "-c", "--compose", "-t", "--instance-type",
        "--disk-size", "--fs", "--image", "-r", "--region", "--node-id", "-e", "--env", "--kms", "--kms-contract",
        "--kms-contract-id", "--key-provider-mode", "--experimental-key-provider-type", "--skip-gateway",
        "--custom-app-id", "--nonce", "--pre-launch-script", "--private-key", "--rpc-url", "--wait", "--force-stop",
        "--ssh-pubkey", "--dev-os", "--no-dev-os", "--prepare-only", "--commit", "--token", "--compose-hash",
        "--transaction-hash", "--public-logs", "--no-public-logs", "--public-sysinfo", "--no-public-sysinfo",
        "--public-tcbinfo", "--no-public-tcbinfo", "--secure-time", "--no-secure-time", "--listed", "--no-listed",
        "--json", "--api-token"},
    # same source tree, cli/src/commands/cvms/attestation: positional CVM name/id, --json.
    ("phala", "cvms", "attestation"): {"--json", "--cvm-id", "-i", "--interactive", "--api-token"},
    # Dstack-TEE/dstack v0.5.11, vmm/src/vmm-cli.py: main parser (--url) and `deploy` (lines 1692-1770).
    ("vmm-cli.py", "deploy"): {
        "--url", "--name", "--image", "--compose", "--vcpu", "--memory", "--disk", "--swap", "--env-file",
        "--user-config", "--app-id", "--port", "--gpu", "--ppcie", "--pin-numa", "--hugepages", "--kms-url",
        "--gateway-url", "--stopped", "--no-tee", "--tee", "--net"},
    # Docker CLI reference (docs.docker.com/reference/cli/docker/): the flags this page uses.
    ("docker", "build"): {"-t", "--tag", "-f", "--file", "--build-arg"},
    ("docker", "push"): set(),
    ("docker", "buildx", "imagetools", "inspect"): {"--format", "--raw"},
}
# Deprecated in phala CLI 1.1.x ("Use --instance-type instead", "Use -e instead", "Use --kms instead").
DEPRECATED = {("phala", "deploy"): {"--vcpu", "--memory", "--env-file", "--kms-id"}}


def _logical_lines(text: str) -> list[str]:
    return [ln.split(" #", 1)[0].strip() for ln in re.sub(r"\\\n\s*", " ", text).splitlines()]


def _sh_blocks(page: Path) -> list[str]:
    return re.findall(r"^\s*```sh\n(.*?)^\s*```", page.read_text(), flags=re.S | re.M)


def tool_commands(page: Path) -> list[tuple[tuple[str, ...], list[str]]]:
    """(command path, argv) of every documented-tool invocation in the page's sh blocks."""
    out = []
    for block in _sh_blocks(page):
        for line in _logical_lines(block):
            words = shlex.split(line.split(">", 1)[0], comments=True) if line else []
            for key in sorted(DOCUMENTED, key=len, reverse=True):
                if tuple(words[: len(key)]) == key:
                    out.append((key, words))
                    break
            else:
                assert not words or words[0] not in {"phala", "vmm-cli.py", "docker"}, f"unknown command: {line}"
    return out


def flag_problems(key: tuple[str, ...], argv: list[str]) -> list[str]:
    flags = {w.split("=", 1)[0] for w in argv[len(key):] if w.startswith("-")}
    return ([f"{' '.join(key)}: {f} is not a documented flag" for f in sorted(flags - DOCUMENTED[key])]
            + [f"{' '.join(key)}: {f} is deprecated" for f in sorted(flags & DEPRECATED.get(key, set()))])


COMMANDS = tool_commands(DEPLOY_MD)


@pytest.mark.parametrize(("key", "argv"), COMMANDS, ids=[" ".join(a[:3]) for _, a in COMMANDS])
def test_every_deploy_command_uses_documented_flags(key: tuple[str, ...], argv: list[str]) -> None:
    assert flag_problems(key, argv) == []


def test_flag_check_can_fail() -> None:
    assert flag_problems(("phala", "deploy"), ["phala", "deploy", "--vcpu", "8"]) == [
        "phala deploy: --vcpu is not a documented flag", "phala deploy: --vcpu is deprecated"]
    assert flag_problems(("vmm-cli.py", "deploy"), ["vmm-cli.py", "deploy", "--disk-size", "1G"])


def test_the_page_deploys_with_resources_private_logs_and_the_alert_env() -> None:
    keys = [k for k, _ in COMMANDS]
    assert ("phala", "deploy") in keys and ("vmm-cli.py", "deploy") in keys and ("phala", "cvms", "attestation") in keys
    phala = next(a for k, a in COMMANDS if k == ("phala", "deploy"))
    for flag in ("-t", "--disk-size", "--no-public-logs", "--no-public-sysinfo", "-e"):
        assert flag in phala, flag
    vmm = next(a for k, a in COMMANDS if k == ("vmm-cli.py", "deploy"))
    got = {f: vmm[vmm.index(f) + 1] for f in ("--vcpu", "--memory", "--disk", "--gpu")}
    need = needs(16, 50)
    assert int(got["--vcpu"]) >= need.vcpu and int(got["--memory"][:-1]) >= need.memory_gb
    assert int(got["--disk"][:-1]) >= need.disk_gb and got["--gpu"] == "all"
    assert "deploy/secrets.env" in phala and "deploy/secrets.env" in vmm
    text = DEPLOY_MD.read_text()
    assert "--vcpu" not in " ".join(phala) and "1.1.x" in text


@pytest.fixture
def deploy_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Path:
    """Step 3 of the page, run in a temporary directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docker-compose.yaml").write_text((REPO / "docker-compose.yaml").read_text())
    assert main(["bundles", "token", "deploy-bundles.token"]) == 0
    assert main(["app-compose", "--image", IMAGE, "--bundles-token", "deploy-bundles.token", "--out-dir", "deploy"]) == 0
    (tmp_path / "deploy" / "secrets.env").write_text("CVM_TUNE_ALERT_WEBHOOK=https://alerts.example/hook\n")
    capsys.readouterr()
    return tmp_path / "deploy"


def _plan_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["deploy-plan", *args]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_deploy_plan_prints_the_commands_the_page_shows(deploy_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shown = {shlex.join(a) for k, a in COMMANDS if k in (("phala", "deploy"), ("vmm-cli.py", "deploy"))}
    phala = _plan_line(capsys, "--target", "phala", "--model-gb", "16", "--instance-type", "h200.small", "--disk", "200G")
    vmm = _plan_line(capsys, "--target", "vmm", "--model-gb", "16", "--os-image", "dstack-nvidia-0.5.11",
                     "--kms-url", "https://kms.example:8000")
    assert {phala, vmm} == shown
    assert sorted(p.name for p in deploy_dir.iterdir()) == ["app-compose.json", "docker-compose.yaml", "secrets.env"]


@pytest.mark.parametrize(("args", "error"), [
    (["--target", "vmm", "--memory", "16G"], "memory 16 GB < 32 GB"),
    (["--target", "vmm", "--vcpu", "1", "--disk", "20G"], "vCPU 1 < 8, disk 20 GB < 112 GB"),
    (["--target", "vmm", "--memory", "1024M"], "is not N, NG or NT"),
    (["--target", "vmm", "--os-image", "dstack-nvidia-dev-0.5.11"], "dev image"),
    (["--target", "vmm", "--kms-url", ""], "needs --os-image"),
    (["--target", "phala", "--instance-type", ""], "needs --instance-type"),
    (["--target", "phala", "--vcpu", "4", "--memory", "24G"], "vCPU 4 < 8, memory 24 GB < 32 GB"),
    (["--target", "phala", "--model-gb", "0"], "--model-gb must be > 0"),
])
def test_deploy_plan_refuses(deploy_dir: Path, args: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--model-gb": "16", "--os-image": "dstack-nvidia-0.5.11", "--kms-url": "https://kms", "--instance-type": "h200.small"}
    args = [*args, *(x for flag, value in base.items() if flag not in args for x in (flag, value))]
    before = sorted(p.name for p in deploy_dir.iterdir())
    assert main(["deploy-plan", *args]) == 2
    out = capsys.readouterr()
    assert error in out.err and "phala deploy" not in out.out and "vmm-cli.py" not in out.out
    assert sorted(p.name for p in deploy_dir.iterdir()) == before


def test_deploy_plan_refuses_bad_inputs(deploy_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["deploy-plan", "--target", "phala", "--model-gb", "16", "--instance-type", "h200.small"]
    env = deploy_dir / "secrets.env"
    env.write_text("OTHER=1\n")
    assert main(args) == 2 and "['OTHER'] are not in the app-compose's allowed_envs" in capsys.readouterr().err
    env.write_text("\n")
    assert main(args) == 2 and "no environment variables" in capsys.readouterr().err
    env.write_text("CVM_TUNE_ALERT_WEBHOOK=https://secret-hook.example/abc\n")
    doc = json.loads((deploy_dir / "app-compose.json").read_text())
    (deploy_dir / "app-compose.json").write_text(json.dumps({**doc, "public_logs": True}))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "fails its audit: public_logs is not false" in err and "secret-hook" not in err
    (deploy_dir / "app-compose.json").write_text(json.dumps({**doc, "allowed_envs": []}))
    assert main(args) == 2 and "alerts would be dropped" in capsys.readouterr().err


def test_token_app_id_and_wrong_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bundles", "token", "t"]) == 0
    out = capsys.readouterr().out
    digest = hashlib.sha256((tmp_path / "t").read_text().strip().encode()).hexdigest()
    assert digest in out and "cvm-tune app-compose --image IMAGE@sha256:DIGEST --bundles-token t" in out
    compose = str(REPO / "docker-compose.yaml")
    base = ["app-compose", "--image", IMAGE, "--compose", compose]
    assert main([*base, "--bundles-token", "t", "--bundles-token-sha256", "ab" * 32, "--out-dir", "a"]) == 2
    assert "is not the SHA-256 of the token in t" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([*base, "--bundles-token", "t", "--bundles-token-sha256", digest, "--out-dir", "b"]) == 0
    out = capsys.readouterr().out
    assert "app-id        not in the file: with KMS the deployment assigns it" in out and "None" not in out
    assert f"CVM_TUNE_BUNDLES_TOKEN_SHA256={digest}" in (tmp_path / "b" / "docker-compose.yaml").read_text()
    # a compose that already pins another token hash is refused, not silently kept
    again = ["app-compose", "--image", IMAGE, "--compose", str(tmp_path / "b" / "docker-compose.yaml"), "--out-dir", "c"]
    assert main([*again, "--bundles-token-sha256", "cd" * 32]) == 2
    assert "not the hash of your token" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert main([*base, "--bundles-token", "t", "--no-kms", "--out-dir", "d"]) == 0
    raw = (tmp_path / "d" / "app-compose.json").read_bytes()
    assert f"app-id        {hashlib.sha256(raw).hexdigest()[:40]}\n" in capsys.readouterr().out
    assert main([*base, "--bundles-token", "t", "--key-provider-id", "ab" * 32, "--app-id", "ef" * 20, "--out-dir", "e"]) == 0
    out = capsys.readouterr().out
    assert "app-id        " + "ef" * 20 + " (pinned by your KMS deployment)" in out and "mr_config_id  v3 03 || SHA-256 of the MrConfigV3" in out


def test_compose_hash_from_info_takes_the_measured_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real CVM's published attestation data (NEAR MPC, dstack 0.5.8): tcb_info.app_compose hashes to its compose-hash,
    whether tcb_info is an object (Phala API, this capture) or a JSON string (the guest agent's Info)."""
    public = json.loads((REPO / "tests" / "data" / "attestation" / "dstack_nearmpc_public_data.json").read_text())
    tcb = public["tee_participant_info"]["Dstack"]["tcb_info"]
    for doc in ({"tcb_info": tcb}, {"app_id": "x", "tcb_info": json.dumps(tcb)}):
        (tmp_path / "info.json").write_text(json.dumps(doc))
        assert main(["compose-hash", str(tmp_path / "info.json"), "--from-info", "--save", str(tmp_path / "m.json"), "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["compose_hash"] == tcb["compose_hash"]
        assert hashlib.sha256((tmp_path / "m.json").read_bytes()).hexdigest() == tcb["compose_hash"]
        (tmp_path / "m.json").unlink()
    (tmp_path / "info.json").write_text(json.dumps({"tcb_info": {"mrtd": "00"}}))
    assert main(["compose-hash", str(tmp_path / "info.json"), "--from-info", "--save", str(tmp_path / "m.json")]) == 2
    assert "no tcb_info.app_compose" in capsys.readouterr().err and not (tmp_path / "m.json").exists()
    assert main(["compose-hash", str(tmp_path / "info.json"), "--save", str(tmp_path / "m.json")]) == 2
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize(("extra", "error"), [(["--key-provider-id", "zz"], "is not hex"),
                                              (["--key-provider-id", "ab", "--app-id", "12"], "not 20 bytes of hex")])
def test_app_compose_refuses_bad_ids_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str],
                                                        error: str, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["app-compose", "--image", IMAGE, "--compose", str(REPO / "docker-compose.yaml"),
            "--bundles-token-sha256", "ab" * 32, "--out-dir", "out", *extra]
    assert main(args) == 2 and error in capsys.readouterr().err and not (tmp_path / "out").exists()
