"""A newcomer needs no other tool: an age identity from cvm-tune itself, a public key given as the private key named as
such, the API's help telling the truth, and the files the docs create kept out of git."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from app.cli import _parser, main
from app.dataset.owner import load_owner_key, new_age_identity
from app.errors import KeySourceError
from attestation.outputs.confidential import decrypt, encrypt, load_identities

ROOT = Path(__file__).resolve().parent.parent
AGE_KEYGEN = re.compile(r"# created: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)\n"
                        r"# public key: (age1[02-9ac-hj-np-z]{58})\n(AGE-SECRET-KEY-1[02-9AC-HJ-NP-Z]{58})\n")


# ---- keys age ------------------------------------------------------------------------------------------------------

def test_keys_age_writes_an_identity_file_as_age_keygen_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key.txt"
    assert main(["keys", "age", "-o", str(key)]) == 0
    out = capsys.readouterr().out
    m = AGE_KEYGEN.fullmatch(key.read_text())
    assert m is not None, key.read_text()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"recipient: {m.group(2)}" in out.splitlines() and m.group(3) not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.txt"]  # no temporary file left beside it
    # what --identity reads, and a round trip to the printed recipient
    ids = load_identities(key)
    assert [str(i.to_public()) for i in ids] == [m.group(2)]
    assert decrypt(encrypt(b"weights", (m.group(2),)), ids) == b"weights"
    assert main(["keys", "age", "-y", str(key)]) == 0
    assert capsys.readouterr().out == m.group(2) + "\n"


def test_keys_age_never_overwrites_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key.txt"
    key.write_text("the user's identity\n")
    before = key.stat()
    with pytest.raises(KeySourceError) as exc:
        new_age_identity(key)
    assert type(exc.value) is KeySourceError and "already exists" in exc.value.message
    assert main(["keys", "age", "-o", str(key)]) == 4
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and "refusing to overwrite" in err[0] and err[1].startswith("fix: ")
    assert key.read_text() == "the user's identity\n" and key.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.txt"]


def test_no_page_requires_age_keygen() -> None:
    """Every page that mentions age-keygen offers `cvm-tune keys age` in the same breath (the verifier specification
    names age-keygen as the reference for the format it specifies: an implementer's page, not a how-to)."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "verifier-spec.md")]
    needing = [p.name for p in pages if "age-keygen" in (text := p.read_text()) and "cvm-tune keys age" not in text]
    assert needing == []
    assert "cvm-tune keys age" in (ROOT / "docs" / "data-owner.md").read_text()


# ---- a public key given where the private key belongs ----------------------------------------------------------------

def test_owner_public_key_given_as_the_private_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    pub = tmp_path / "acme.pub"
    assert stat.S_IMODE(pub.stat().st_mode) & 0o044  # readable by others, as a public key is
    with pytest.raises(KeySourceError) as exc:
        load_owner_key(pub)
    assert type(exc.value) is KeySourceError
    assert "public key" in exc.value.message and "chmod" not in exc.value.fix and "acme.key" in exc.value.fix
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["dataset", "encrypt", str(rows), "-o", str(tmp_path / "rows.cvmds"), "--owner-key", str(pub),
                 "--key-file", str(tmp_path / "rows.key"), "--dataset-id", "d", "--dataset-version", "1"])
    err = capsys.readouterr().err
    assert code == 4 and "acme.pub holds the owner's public key" in err and "chmod" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no dataset, no dataset key written


def test_a_private_key_readable_by_others_still_gets_chmod(tmp_path: Path) -> None:
    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    (tmp_path / "acme.key").chmod(0o644)
    with pytest.raises(KeySourceError) as exc:
        load_owner_key(tmp_path / "acme.key")
    assert type(exc.value) is KeySourceError and exc.value.fix == f"chmod 600 {tmp_path / 'acme.key'}"


# ---- api serve --help ----------------------------------------------------------------------------------------------

def test_api_serve_help_says_tls_is_the_default() -> None:
    api = next(a for a in _parser()._actions if a.dest == "command").choices["api"]
    serve = next(a for a in api._actions if a.dest == "api_command").choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "over TLS" in text and "plain HTTP, loopback only" not in text
    assert "--plain-http serves plain HTTP instead" in text


# ---- .gitignore ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fed-sim/simulator-test-policy.yaml", "fed-secure/simulator-test-policy.yaml",
                                  "ops.jsonl", "trust.pem",
                                  "dpo-demo/out/exports/run-1/manifest.json"])
def test_files_the_docs_create_are_ignored_by_git(path: str) -> None:
    proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", path], env={
        **os.environ, "GIT_CONFIG_GLOBAL": os.devnull}, capture_output=True)
    assert proc.returncode == 0, f"{path} is not ignored by .gitignore"


# ---- bundle server: token, local serve, API saves in the list and in status -----------------------------------------

def _volume(tmp_path: Path) -> Path:
    """An output volume with one exported run and one training-API save (each with its bundle's manifest)."""
    from app.api.proof.store import Checkpoint, Store
    from app.state import RunDB

    out = tmp_path / "out"
    db = RunDB(out)
    db.start_run("run-1", fingerprint="f" * 64, started_at="2026-11-28T01:00:00Z")
    db.finish_run("run-1", bundle=str(out / "exports" / "run-1"), finished_at="2026-11-28T01:05:00Z", promoted=True)
    db.close()
    store = Store(out)
    store.add_checkpoint(Checkpoint("tinker://m1/weights/ckpt-1", "owner", "m1", "training", "ckpt-1", str(out / "api"),
                                    str(out / "exports" / "api-m1-ckpt-1"), "ab" * 32, 7, {"rank": 8},
                                    "2026-11-28T02:00:00Z"))
    store.close()
    for run_id in ("run-1", "api-m1-ckpt-1"):
        (out / "exports" / run_id).mkdir(parents=True)
        (out / "exports" / run_id / "manifest.json").write_text("{}")
    (out / "exports" / "PROMOTED").write_text("run-1\n")
    return out


def test_bundles_token_hash_is_the_sha256sum_of_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import hashlib

    from app.service.bundles import read_token, serve_token_sha256, token_sha256

    tok = tmp_path / "t"
    assert main(["bundles", "token", str(tok)]) == 0
    printed = re.search(r"SHA-256 .* is ([0-9a-f]{64})", capsys.readouterr().out).group(1)
    assert printed == hashlib.sha256(tok.read_bytes()).hexdigest() == serve_token_sha256(tok, None)
    # a token file of an earlier release (with a newline) keeps the hash its compose pins: that of the token
    old = tmp_path / "old"
    old.write_text("earlier-token\n")
    old.chmod(0o600)
    assert serve_token_sha256(old, None) == token_sha256(read_token(old)) == hashlib.sha256(b"earlier-token").hexdigest()


def test_bundles_serve_takes_its_token_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.errors import ConfigError
    from app.service.bundles import TOKEN_ENV, serve_token_sha256, token_sha256

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    tok = tmp_path / "t"
    assert main(["bundles", "token", str(tok)]) == 0
    digest = token_sha256(tok.read_text())
    assert serve_token_sha256(tok, digest) == digest  # the file and the compose's pin agree
    for token_file, pinned, says in ((None, None, "needs a token"), (tok, "cd" * 32, "is not the one"),
                                     (tmp_path / "missing", None, "cannot read a token")):
        with pytest.raises(ConfigError) as exc:
            serve_token_sha256(token_file, pinned)
        assert type(exc.value) is ConfigError and says in exc.value.message
    # the command refuses to start without a token: one error line, nothing served, nothing written
    assert main(["bundles", "serve", "--output", str(tmp_path / "out"), "--host", "127.0.0.1", "--port", "0"]) == 2
    assert not (tmp_path / "out").exists()


def test_bundles_list_has_a_header_and_the_api_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.service.bundles import BundleServer, serve_token_sha256

    out = _volume(tmp_path)
    tok = tmp_path / "t"
    assert main(["bundles", "token", str(tok)]) == 0
    capsys.readouterr()
    server = BundleServer(out, serve_token_sha256(tok, None), host="127.0.0.1", port=0).start()
    try:
        assert main(["bundles", "list", server.url, "--token-file", str(tok)]) == 0
    finally:
        server.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "ID", "KIND", "STATUS", "STARTED", "(UTC)", "BUNDLE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["run-1"] == ["run-1", "run", "exported", "2026-11-28", "01:00:00", "yes", "(promoted)"]
    assert rows["api-m1-ckpt-1"] == ["api-m1-ckpt-1", "api", "saved", "2026-11-28", "02:00:00", "yes"]
    assert all(line.count("exported") <= 1 for line in lines)


def test_status_lists_the_training_api_saves(tmp_path: Path) -> None:
    import json

    from app.config import Config
    from app.service.status import render_status

    out = _volume(tmp_path)
    cfg = Config.model_validate({"output": {"dir": str(out)}})
    text = render_status(cfg)
    saves = text.split("training API saves (cvm-tune api serve), newest first:\n", 1)[1].splitlines()
    assert saves[0].split()[:3] == ["RUN", "ID", "CHECKPOINT"]
    assert saves[1].split() == ["api-m1-ckpt-1", "tinker://m1/weights/ckpt-1", "training", "7", "2026-11-28", "02:00:00",
                                str(out.resolve() / "exports" / "api-m1-ckpt-1")]
    doc = json.loads(render_status(cfg, as_json=True))
    assert [(s["run_id"], s["ops"], s["exported"]) for s in doc["api_saves"]] == [("api-m1-ckpt-1", 7, True)]


# ---- cvm-tune show ---------------------------------------------------------------------------------------------------

def _show(capsys: pytest.CaptureFixture[str], bundle: Path) -> tuple[dict[str, str], str, dict]:
    import json

    assert main(["show", str(bundle)]) == 0
    out = capsys.readouterr().out.splitlines()
    fields = dict(line.strip().split(":", 1) for line in out[1:] if line.startswith("  ") and ":" in line)
    verify = next(line.removeprefix("verify it: ") for line in out if line.startswith("verify it: "))
    assert main(["show", str(bundle), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verify"] == verify and doc["verified"] is False and doc["schema"] == "cvm-tune/show/v1"
    assert "NOT verified" in out[0]
    return {k: v.strip() for k, v in fields.items()}, verify, doc


def test_show_summarizes_a_run_and_its_verify_command_verifies_it(demo_bundle: tuple[Path, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shlex

    bundle, policy = demo_bundle
    m = json.loads((bundle / "manifest.json").read_text())
    fields, verify, doc = _show(capsys, bundle)
    assert fields["run id"] == m["run_id"] and fields["kind"] == "ad-hoc run (cvm-tune run)"
    assert fields["base model"] == "cvm-tune/tiny-llama" and fields["objective"] == "SFT" and fields["steps"] == "2"
    assert fields["dataset"].startswith(f"{m['dataset']['dataset_id']} version {m['dataset']['dataset_version']} (")
    assert fields["final loss"] == f"{m['training']['losses'][-1][1]:.4f} at step 2"
    assert fields["weights"] == "plaintext (no recipients)" and fields["privacy"] == "no differential privacy"
    assert fields["parent"] == "none: trained from the base model" and "simulator" in fields["TEE"]
    assert verify == shlex.join(["cvm-tune", "verify", str(bundle), "--policy", str(policy)])
    assert (doc["kind"], doc["steps"], doc["epsilon"], doc["recipients"]) == ("run", 2, None, [])
    assert main(shlex.split(verify)[1:]) == 0  # the hint is a command that verifies this bundle
    capsys.readouterr()



def test_show_and_verify_say_how_to_open_the_browser_verifier(demo_bundle: tuple[Path, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from app.service.verify_page import PAGE

    bundle, policy = demo_bundle
    line = (f"in a browser: open {PAGE.resolve().as_uri()} and drop the bundle on it, or SERVER/verify?bundle="
            f"/verify/bundles/{bundle.name}.tar.gz&policy=/verify/simulator-test-policy.yaml where `cvm-tune bundles "
            "serve` serves it")
    assert PAGE.resolve().as_uri().endswith("/web/dist/verify.html")  # in a checkout, the built page itself
    assert main(["show", str(bundle)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == line
    assert main(["verify", str(bundle), "--policy", str(policy)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == line
    assert main(["verify", str(bundle), "--policy", str(policy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "accepted"  # --json prints the verdict alone

def test_show_an_api_checkpoint_with_a_parent(demo_bundle: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import json

    m = json.loads((demo_bundle[0] / "manifest.json").read_text())
    m["op_chain"] = {"schema": "cvm-tune/op-chain/v1", "head": "ab" * 32, "ops": 12, "optimizer_steps": 6,
                     "checkpoint": "tinker://m1/weights/s1", "lora": {"rank": 8}, "dp": {"epsilon": 1.5}}
    m["lineage"] = {"parent_run_id": "run-0", "parent_manifest_sha256": "cd" * 32, "parent_adapter_sha256": "ef" * 32}
    m["run_id"] = "api-m1-weights-s1-1"
    bundle = tmp_path / "exports" / m["run_id"]
    bundle.mkdir(parents=True)
    (tmp_path / "exports" / "run-0").mkdir()
    (bundle / "manifest.json").write_text(json.dumps(m))
    fields, verify, doc = _show(capsys, bundle)
    assert fields["kind"] == "training-API checkpoint (cvm-tune api serve)" and "dataset" not in fields
    assert fields["op chain"] == f"12 ops (6 optimizer steps), head {'ab' * 8}…, saved as tinker://m1/weights/s1"
    assert fields["privacy"] == "DP-SGD, ε = 1.5" and fields["parent"] == "continued from run-0"
    assert verify == (f"cvm-tune verify {bundle} --policy simulator-test-policy.yaml --parent {tmp_path}/exports/run-0"
                      " --ops OPS.jsonl")
    assert (doc["kind"], doc["op_chain_ops"], doc["epsilon"], doc["parent_run_id"]) == ("api", 12, 1.5, "run-0")
    assert any("cvm-tune simulator -o" in n for n in doc["notes"])


def test_show_a_federated_round(demo_bundle: tuple[Path, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from app.cli import show
    from attestation.rounds.manifest import RoundManifest

    m = json.loads((demo_bundle[0] / "manifest.json").read_text())
    admitted = [{"client": c, "run_id": f"run-{c}", "manifest_sha256": "a" * 64, "quote_sha256": "b" * 64,
                 "adapter_sha256": "c" * 64, "trainable_tokens": 10, "weight": 0.5, "privacy_epsilon": eps,
                 "privacy_delta": 1e-5} for c, eps in (("acme", 2.0), ("globex", 3.0))]
    doc = {"schema": "cvm-tune/round-manifest/v1", "federation_id": "simulation", "round": 2, "nonce": "d" * 64,
           "created_at": "2026-11-28T03:00:00Z", "code": m["code"], "tee": m["tee"], "strategy": {"name": "fedavg"},
           "min_clients": 2, "global_adapter_sha256": "e" * 64, "previous_round_sha256": "f" * 64,
           "admitted": admitted, "rejected": [{"client": "initech", "node_id": 3, "reason": "quote rejected"}],
           "files": {}}
    RoundManifest.model_validate(doc)
    rounds = tmp_path / "fed-sim" / "aggregator" / "output" / "rounds" / "simulation"
    (rounds / "round-0001").mkdir(parents=True)
    (rounds / "round-0002").mkdir()
    (rounds / "round-0002" / "round-manifest.json").write_text(json.dumps(doc))
    (tmp_path / "fed-sim" / "simulator-test-policy.yaml").write_text("name: x\n")
    (rounds / "round-0002" / "clients" / "acme").mkdir(parents=True)  # globex's bundle has no manifest
    (rounds / "round-0002" / "clients" / "acme" / "manifest.json").write_text(json.dumps({**m, "run_id": "run-acme"}))
    fields, verify, out = _show(capsys, rounds / "round-0002")
    assert fields["kind"] == "federated round 2 (aggregator)" and fields["federation"] == "simulation"
    assert fields["admitted"] == "2 of at least 2" and fields["base model"] == "cvm-tune/tiny-llama"
    assert fields["- acme"] == (f"run run-acme, dataset {m['dataset']['dataset_id']} version 1 ({m['dataset']['rows']} "
                                f"rows), 2 steps, final loss {m['training']['losses'][-1][1]:.4f}, weight 0.5, ε 2")
    assert fields["- globex"].startswith("run run-globex, weight 0.5 (its bundle's manifest: ") and "no manifest.json" in \
        fields["- globex"]
    assert fields["rejected"] == "1; initech: quote rejected" and fields["parent"].startswith("round 1 (")
    assert verify == (f"cvm-tune verify {rounds}/round-0002 --policy {tmp_path}/fed-sim/simulator-test-policy.yaml "
                      f"--parent {rounds}/round-0001")
    assert (out["kind"], out["clients"], out["epsilon"], out["parent_round"]) == ("round", ["acme", "globex"], 3.0, 1)
    client = show.summarize(rounds / "round-0002" / "clients" / "acme")  # a client's bundle inside the round
    assert client["verify"] == (f"cvm-tune verify {rounds}/round-0002/clients/acme "
                                f"--policy {tmp_path}/fed-sim/simulator-test-policy.yaml")


@pytest.mark.parametrize("case", ["not a directory", "no manifest", "truncated", "nested", "not a manifest", "huge"])
def test_show_refuses_what_is_not_a_bundle(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import show
    from attestation.errors import BundleError

    bundle = tmp_path / "b"
    if case == "not a directory":
        bundle.write_text("x")
    else:
        bundle.mkdir()
    content = {"truncated": b'{"schema": "cvm-tune/manifest/v1", "run_id": "r', "nested": b"[" * 5000 + b"]" * 5000,
               "not a manifest": b'{"schema": "cvm-tune/manifest/v1", "run_id": "r"}',
               "huge": b" " * (show.MAX_MANIFEST + 1)}.get(case)
    if content is not None:
        (bundle / "manifest.json").write_bytes(content)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(BundleError) as exc:
        show.summarize(bundle)
    assert type(exc.value) is BundleError
    assert main(["show", str(bundle)]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert captured.out == "" and len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("fix: ")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_show_knows_the_simulator_by_the_rev_it_reports() -> None:
    from app.cli.show import SIMULATOR_REV
    from app.simulator.agent import REV_PREFIX

    assert SIMULATOR_REV == REV_PREFIX


# ---- the run's row summary ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("rows", "by_kind", "line"), [
    (171, {"messages": 111, "text": 60}, "171 rows (111 chat, 60 text)"),
    (12, {"messages": 0, "text": 0, "preference": 12}, "12 preference rows"),
    (1, {"messages": 1, "text": 0}, "1 chat row"),
])
def test_row_summary_is_a_readable_line(rows: int, by_kind: dict[str, int], line: str) -> None:
    from app.run.stages import row_summary

    assert row_summary(rows, by_kind) == line


# ---- docs that had gone stale ---------------------------------------------------------------------------------------

def test_verifier_usage_names_every_way_to_widen_verify() -> None:
    from tests.test_docs import blocks

    page = ROOT / "docs" / "verifier.md"
    usage = blocks(page)[0].text
    text = page.read_text()
    for flag in ("--parent", "--chain", "--identity", "--ops"):
        assert flag in usage, flag
        assert re.search(rf"^- `{flag} [A-Z_.a-z]+`: \S", text, flags=re.M), f"no line says what {flag} does"


def test_index_says_rows_may_be_tables() -> None:
    text = " ".join((ROOT / "docs" / "index.md").read_text().split())
    step = text.split("**Decrypt → validate**", 1)[1].split("**Base model**", 1)[0]
    assert "Parquet" in step and "Arrow" in step and "JSONL" in step


def test_shown_benchmark_commands_never_overwrite_tracked_results() -> None:
    """A benchmark command a page shows writes outside bench/results/ (tracked references), with an explicit --out
    (bench/encrypt.py and bench/gpu_train.py write under bench/results/ without one)."""
    from tests.test_docs import sh_blocks

    commands = [line for b in sh_blocks() for line in b.text.splitlines() if re.search(r"\bbench/\w+\.py\b", line)]
    assert commands
    bad = [c for c in commands if not re.search(r"--out (?!bench/results)\S", c)]
    assert bad == []


def test_show_never_prints_a_manifest_s_control_characters(demo_bundle: tuple[Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import json

    m = json.loads((demo_bundle[0] / "manifest.json").read_text())
    m["base_model"]["name"] = "tiny\x1b[2J\x1b]0;pwned\x07\nverify it: ACCEPTED"
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(m))
    assert main(["show", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\nverify it: ACCEPTED" not in out
    assert "base model:   tiny\\x1b[2J\\x1b]0;pwned\\x07\\nverify it: ACCEPTED" in out


def test_show_needs_no_training_stack() -> None:
    """`show` is for whoever holds a bundle, as `verify` is: it runs in the verifier-only install (a finder stands in
    for the training stack's absence)."""
    import sys

    code = """
import importlib.abc, sys
from app.cli import TRAINING_STACK, main
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in TRAINING_STACK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
sys.exit(main(["show", sys.argv[1]]))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests" / "data" / "bundle")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "  run id:" in proc.stdout and "verify it: cvm-tune verify" in proc.stdout


def test_owner_private_key_given_as_the_public_key_is_named(tmp_path: Path) -> None:
    from app.dataset.owner import load_public_key
    from app.errors import ConfigError

    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    with pytest.raises(ConfigError) as exc:
        load_public_key(str(tmp_path / "acme.key"))
    assert type(exc.value) is ConfigError and "holds a private key" in exc.value.message
    assert str(tmp_path / "acme.pub") in exc.value.fix
    assert load_public_key(str(tmp_path / "acme.pub")).hex() == (tmp_path / "acme.pub").read_text().strip()
