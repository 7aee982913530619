"""Hostile input at the parsing edge: alias bombs, deep JSON, damaged manifests inside bundles, and the messages a
user needs (YAML line and column, the simulator's policy). Every case ends with its documented exit code, one
`error:` line and no traceback, writes nothing, and returns in well under a second."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from app.cli import main
from attestation.compose import app_compose as C
from attestation.io import safe_yaml
from attestation.errors import PolicyError

DATA = Path(__file__).resolve().parent / "data" / "attestation"
DEEP_JSON = "[" * 200_000 + "]" * 200_000
# 10 anchors of 10 aliases each: ~500 bytes of text, 10^8 items once expanded.
ANCHORS = "x-l0: &l0 [a, a, a, a, a, a, a, a, a, a]\n" + "".join(
    f"x-l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 8))


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    start = time.monotonic()
    code = main(argv)
    assert time.monotonic() - start < 10, "a hostile input must be refused at once, not walked"
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    return code, out, err


# -- alias bombs ----------------------------------------------------------------------------------------------------

def test_expanded_nodes_counts_each_node_once_and_refuses_bombs() -> None:
    node = yaml.compose("a: &a [1, 2]\nb: [*a, *a, *a]\n")
    assert safe_yaml.expanded_nodes(node) == 1 + 2 * 1 + (1 + 2) + (1 + 3 * 3)  # map, 2 keys, a, b with a thrice
    start = time.monotonic()
    with pytest.raises(safe_yaml.YAMLLimitError, match="expand to more than 100000 nodes"):
        safe_yaml.expanded_nodes(yaml.compose(ANCHORS + "bomb: *l7\n"))
    assert time.monotonic() - start < 10  # walked, the bomb would be 10^8 nodes: minutes, not seconds
    with pytest.raises(safe_yaml.YAMLLimitError, match="refers to its own anchor"):
        safe_yaml.expanded_nodes(yaml.compose("a: &a [1, *a]\n"))
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 3000))
    assert safe_yaml.expanded_nodes(yaml.compose(chain), 10**9) > 3000  # iterative: a long chain cannot recurse out


def test_parse_yaml_refuses_bombs_and_recursion() -> None:
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 3000))
    for text in (ANCHORS + "compose_hashes: *l7\n", "a: &a [1, *a]\n", chain):
        with pytest.raises(PolicyError) as err:
            safe_yaml.parse_yaml(text, "policy p", PolicyError)
        assert type(err.value) is PolicyError


def test_policy_alias_bomb_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(ANCHORS.replace("x-l", "l") + "compose_hashes: *l7\n")
    before = _files(tmp_path)
    code, out, err = _run(["verify", str(tmp_path), "--policy", str(policy)], capsys)
    assert code == 2 and "expand to more than 100000 nodes" in err and out == ""
    assert _files(tmp_path) == before


def test_config_alias_bomb_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ANCHORS.replace("x-l", "l") + "training: {target_modules: *l7}\n")
    before = _files(tmp_path)
    code, _, err = _run(["validate-config", str(cfg)], capsys)
    assert code == 2 and err.startswith("error: config") and "expand to more than 100000 nodes" in err
    assert _files(tmp_path) == before


def test_app_compose_alias_bomb_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compose = ANCHORS + "services:\n  s:\n    image: x@sha256:" + "1" * 64 + "\n    command: *l7\n"
    path = tmp_path / "app-compose.json"
    path.write_bytes(C.render(compose, C.AppComposeSettings()))
    before = _files(tmp_path)
    code, out, err = _run(["compose-hash", str(path)], capsys)
    assert code == 2 and "expand to more than 100000 nodes" in err and out == ""
    code, _, err = _run(["app-compose", "--compose", str(tmp_path / "app-compose.json"), "--image",
                         "r/x@sha256:" + "5e" * 32, "--out-dir", str(tmp_path / "out")], capsys)
    assert code == 2 and err.startswith("error: ")
    assert _files(tmp_path) == before


# -- deep JSON in every command that reads one ----------------------------------------------------------------------

def _deep_inputs(tmp: Path) -> dict[str, Path]:
    (tmp / "deep").mkdir()
    (tmp / "deep" / "app-compose.json").write_text(DEEP_JSON)
    (tmp / "info.json").write_text(json.dumps({"tcb_info": DEEP_JSON}))  # tcb_info as a JSON string, as agents send it
    (tmp / "inner.json").write_text(json.dumps({"tcb_info": {"app_compose": DEEP_JSON}}))
    (tmp / "secrets.env").write_text("CVM_TUNE_ALERT_WEBHOOK=https://example.com/x\n")
    return {"deep": tmp / "deep" / "app-compose.json", "info": tmp / "info.json", "inner": tmp / "inner.json",
            "env": tmp / "secrets.env"}


@pytest.mark.parametrize("case", ["compose-hash", "from-info", "from-info-tcb-string", "from-info-inner", "env-encrypt",
                                  "deploy-plan", "simulator"])
def test_deep_json_inputs_are_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _deep_inputs(tmp_path)
    argv = {
        "compose-hash": ["compose-hash", str(p["deep"])],
        "from-info": ["compose-hash", "--from-info", str(p["deep"]), "--save", str(tmp_path / "saved.json")],
        "from-info-tcb-string": ["compose-hash", "--from-info", str(p["info"]), "--save", str(tmp_path / "saved.json")],
        "from-info-inner": ["compose-hash", "--from-info", str(p["inner"]), "--save", str(tmp_path / "saved.json")],
        "env-encrypt": ["env", "encrypt", "--public-key", "00" * 32, "--env-file", str(p["env"]), "--app-compose",
                        str(p["deep"]), "-o", str(tmp_path / "env.hex")],
        "deploy-plan": ["deploy-plan", "--target", "vmm", "--model-gb", "1", "--deploy-dir", str(p["deep"].parent),
                        "--env-file", str(p["env"]), "--os-image", "dstack-0.5.11", "--kms-url", "https://kms"],
        "simulator": ["simulator", "--app-compose", str(p["deep"]), "--socket", str(tmp_path / "s.sock")],
    }[case]
    before = _files(tmp_path)
    code, out, err = _run(argv, capsys)
    assert code == 2 and err.startswith("error: ") and "nested too deeply" in err, err
    assert _files(tmp_path) == before


def test_deep_key_provider_event_fails_the_check_not_the_verifier() -> None:
    ok, why = C.check_mr_config_id(b"\x02" + bytes(47), "00" * 32, "11" * 20, DEEP_JSON.encode())
    assert not ok and "nested too deeply" in why


# -- manifests inside bundles checked by --parent and --chain: damage is a rejection (exit 1) -------------------------

def _bundle(root: Path, manifest: str | bytes, quote: bytes | None = None) -> Path:
    root.mkdir(parents=True)
    (root / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else manifest.encode())
    if quote is not None:
        (root / "quote.bin").write_bytes(quote)
    return root


@pytest.mark.parametrize("damage", [DEEP_JSON, '{"run_id": "p", ', "[1, 2]", "\xff"])
def test_damaged_parent_manifest_is_a_rejection(damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = _bundle(tmp_path / "child", json.dumps({"run_id": "c", "lineage": {"parent_run_id": "p"}}))
    parent = _bundle(tmp_path / "parent", damage.encode("latin-1"))
    before = _files(tmp_path)
    code, out, _ = _run(["verify", str(child), "--parent", str(parent), "--json"], capsys)
    assert code == 1
    assert json.loads(out)["link_problems"] and "manifest" in json.loads(out)["link_problems"][0]
    assert _files(tmp_path) == before


def test_manifest_fields_of_the_wrong_type_break_the_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = _bundle(tmp_path / "child", json.dumps({"run_id": "c", "lineage": {"parent_run_id": "p"}, "base_model": 3}))
    parent = _bundle(tmp_path / "parent", json.dumps({"run_id": "p", "files": [1], "base_model": "x"}))
    code, out, _ = _run(["verify", str(child), "--parent", str(parent), "--json"], capsys)
    assert code == 1 and json.loads(out)["link_problems"] == ["parent manifest hash differs from the lineage"]


@pytest.mark.parametrize("damage", [DEEP_JSON, "not json"])
def test_damaged_manifest_in_a_chain_is_a_rejection(damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exports = tmp_path / "exports"
    _bundle(exports / "run-a", json.dumps({"run_id": "run-a", "files": [], "base_model": "x"}))
    _bundle(exports / "run-b", damage)
    before = _files(tmp_path)
    code, out, _ = _run(["verify", "--chain", str(exports), "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and not report["accepted"] and len(report["bundles"]) == 2
    assert _files(tmp_path) == before


# -- the messages: the simulator's policy, YAML line and column -----------------------------------------------------

def test_simulator_bundle_under_the_default_policy_names_the_policy_to_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.simulator import GuestAgentSimulator

    sim_quote = bytes.fromhex(GuestAgentSimulator().get_quote(b"\0" * 64)["quote"])
    out_dir = tmp_path / "cvm-tune-output"
    bundle = _bundle(out_dir / "exports" / "run-1", "{}", sim_quote)
    code, out, err = _run(["verify", str(bundle)], capsys)
    assert code == 1 and "quote.cert_chain" in out
    assert "hint:" in err and "cvm-tune simulator" in err and "--policy" in err and "simulator-test-policy.yaml" in err
    (out_dir / "simulator-test-policy.yaml").write_text("name: x\n")
    code, out, err = _run(["verify", str(bundle), "--json"], capsys)
    assert code == 1 and json.loads(out)["verdict"] == "rejected"  # stdout stays the verdict alone
    assert f"--policy {(out_dir / 'simulator-test-policy.yaml').resolve()}" in err
    real = _bundle(tmp_path / "real", "{}", (DATA / "dstack_nearmpc_quote.bin").read_bytes())  # Intel's chain
    code, _, err = _run(["verify", str(real)], capsys)
    assert code == 1 and "hint:" not in err


@pytest.mark.parametrize(("text", "where"), [
    ("name: x\nallowed_tcb_statuses: [UpToDate\n", "line 3, column 1"),
    ("name: x\n  bad: indent\n", "line 2, column 6"),
    ("name: x\nname: y\n", "line 2, column 1: duplicate key 'name'"),
])
def test_yaml_errors_name_line_and_column(text: str, where: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    policy, cfg = tmp_path / "policy.yaml", tmp_path / "config.yaml"
    policy.write_text(text)
    cfg.write_text(text.replace("name", "training").replace("allowed_tcb_statuses", "output"))
    before = _files(tmp_path)
    code, _, err = _run(["verify", str(tmp_path), "--policy", str(policy)], capsys)
    assert code == 2 and where in err.splitlines()[0], err
    code, _, err = _run(["validate-config", str(cfg)], capsys)
    assert code == 2 and where.replace("'name'", "'training'") in err.splitlines()[0], err
    assert _files(tmp_path) == before


@pytest.mark.parametrize("tagged", ["network_mode: !!binary aG9zdA==", "volumes: [!!binary LzovaG9zdA==]"])
def test_tagged_compose_is_refused_by_the_commands(tagged: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = ("services:\n  cvm-tune:\n    image: r/x@sha256:" + "0" * 64 + "\n    volumes: [/var/run/dstack.sock:/var/run/"
                "dstack.sock]\n  side:\n    image: r/x@sha256:" + "1" * 64 + f"\n    {tagged}\n")
    (tmp_path / "docker-compose.yaml").write_text(template)
    (tmp_path / "app-compose.json").write_bytes(C.render(template, C.AppComposeSettings()))
    before = _files(tmp_path)
    code, _, err = _run(["compose-hash", str(tmp_path / "app-compose.json")], capsys)
    assert code == 2 and "line 7, column" in err and "!!binary" in err
    code, _, err = _run(["app-compose", "--compose", str(tmp_path / "docker-compose.yaml"), "--image",
                         "r/x@sha256:" + "5e" * 32, "--out-dir", str(tmp_path / "deploy")], capsys)
    assert code == 2 and "!!binary" in err
    assert _files(tmp_path) == before
