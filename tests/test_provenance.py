"""Hub-ready, signed outputs: base model Hub id in adapter_config.json and the card, the merged export, the OpenSSF
model signature (key derived from GetKey, never written), re-signing with another key, and `cvm-tune publish`.

One run (module scope, 2 steps, merged export on, small shards) serves every test; the embedded-defaults bundle is
covered in test_slice.py (PEFT loading, card, the model_signing CLI, one-byte tampering).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from app.cli import main
from app.config import TeeSettings
from app.errors import KeySourceError
from app.export.signing import derive_key, public_key_pem, sign_dir
from app.tee import open_guest_agent
from attestation.bundle.model_sig import run_key_path

HUB_ID = "test-org/tiny-llama"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("provenance")
    cfg = {"output": {"dir": str(root / "out")}, "training": {"max_steps": 2, "save_steps": 2},
           "base_model": {"hub_id": HUB_ID, "revision": "main"},
           "export": {"merged": True, "merged_max_shard_size": "300KB", "license": "apache-2.0"}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "--config", str(root / "cfg.yaml")]) == 0
    bundle = next((root / "out" / "exports").iterdir())
    return {"root": root, "out": root / "out", "bundle": bundle, "policy": root / "out" / "simulator-test-policy.yaml",
            "manifest": json.loads((bundle / "manifest.json").read_text())}


def _verify(bundle: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    rc = main(["verify", str(bundle), "--policy", str(policy), "--json"])
    checks = {c["name"]: c["status"] for c in json.loads(capsys.readouterr().out)["checks"]}
    assert (rc == 0) == ("fail" not in checks.values())
    return checks


def _copy(run: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run["bundle"], tmp_path / "bundle"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _model_signing_verify(directory: Path, key_pem: str, tmp_path: Path, *ignore: str,
                          git: bool = False) -> subprocess.CompletedProcess:
    key = tmp_path / "signing-key.pem"
    key.write_text(key_pem)
    extra = [a for p in ignore for a in ("--ignore-paths", str(directory / p))]
    extra += ["--no-ignore-git-paths"] if git else []
    cmd = [str(Path(sys.executable).parent / "model_signing"), "verify", "key", str(directory),
           "--signature", str(directory / "model.sig"), "--public_key", str(key), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_hub_id_in_adapter_config_manifest_and_card(run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import ModelCard
    from peft import AutoPeftModelForCausalLM

    from app.training import build_tiny_model

    adapter = run["bundle"] / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == (HUB_ID, "main")
    assert (run["manifest"]["base_model"]["hub_id"], run["manifest"]["base_model"]["revision"]) == (HUB_ID, "main")
    card = ModelCard.load(run["bundle"] / "README.md")
    assert (card.data.base_model, card.data.license, card.data.library_name) == (HUB_ID, "apache-2.0", "peft")
    assert "no Hub id" not in card.text and "merged/" in card.text
    monkeypatch.chdir(tmp_path)  # the Hub id resolves as a local directory of that name, offline
    build_tiny_model(tmp_path / HUB_ID)
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), local_files_only=True)
    assert model.peft_config["default"].base_model_name_or_path == HUB_ID


def test_merged_export_is_sharded_hashed_signed_and_equals_base_plus_lora(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = run["bundle"] / "merged"
    shards = sorted(p.name for p in merged.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (merged / "model.safetensors.index.json").is_file()
    on_disk = {f"merged/{p.name}" for p in merged.iterdir()}
    assert on_disk <= set(run["manifest"]["files"]) and "merged/model.sig" in on_disk
    assert run["manifest"]["signing"]["signed"] == ["adapter", "merged"]
    checks = _verify(run["bundle"], run["policy"], capsys)
    assert checks["model.signature"] == "pass" and checks["manifest.files"] == "pass"
    tok = AutoTokenizer.from_pretrained(str(merged), local_files_only=True)
    ids = tok("merged weights", return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(str(run["out"] / "models" / "tiny-llama"))
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, str(run["bundle"] / "adapter"))(**ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(merged), local_files_only=True)(**ids).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_changed_merged_shard_fails(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(run, tmp_path)
    _flip(next(bundle.glob("merged/model-*.safetensors")))
    checks = _verify(bundle, run["policy"], capsys)
    assert checks["model.signature"] == "fail" and checks["manifest.files"] == "fail"


@pytest.mark.parametrize("tamper", [False, True])
def test_adapter_resigned_with_another_key_fails_both_verifiers(run: dict, tmp_path: Path, tamper: bool,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An attacker's own signature (over the same or a changed adapter) does not verify under the manifest's key."""
    bundle = _copy(run, tmp_path)
    adapter = bundle / "adapter"
    if tamper:
        _flip(adapter / "adapter_model.safetensors")
    (adapter / "model.sig").unlink()
    other = ec.generate_private_key(ec.SECP256R1())
    sign_dir(other, adapter)
    assert _model_signing_verify(adapter, public_key_pem(other), tmp_path).returncode == 0  # a valid signature...
    assert _model_signing_verify(adapter, run["manifest"]["signing"]["public_key_pem"], tmp_path).returncode == 1
    checks = _verify(bundle, run["policy"], capsys)  # ...but not by the key the quote binds
    assert checks["model.signature"] == "fail" and checks["manifest.files"] == "fail"


def test_signing_key_is_derived_from_getkey_and_never_written(run: dict) -> None:
    run_id = run["manifest"]["run_id"]
    with open_guest_agent(TeeSettings()) as agent:  # the embedded simulator: same app id, same GetKey
        key = derive_key(agent.get_key, run_key_path(run_id))
        other = derive_key(agent.get_key, "cvm-tune/some-other-path")
    assert public_key_pem(key) == run["manifest"]["signing"]["public_key_pem"]
    assert run["manifest"]["signing"]["key_path"] == f"cvm-tune/model-signing/v1/runs/{run_id}"
    assert public_key_pem(other) != public_key_pem(key)
    secret = key.private_numbers().private_value.to_bytes(32, "big")
    for path in run["out"].rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret not in data and secret.hex().encode() not in data and b"PRIVATE KEY" not in data, path
    with pytest.raises(KeySourceError):
        derive_key(lambda _path, _purpose: b"short", run_key_path(run_id))


def test_an_adapter_from_another_run_of_the_deployment_fails_the_librarys_own_check(
        run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each run signs with its own key: another run's adapter (other weights, signed in the same CVM) carries a valid
    signature, but not under this run's key, so ``model_signing verify`` alone tells the runs apart."""
    bundle = _copy(run, tmp_path)
    adapter = bundle / "adapter"
    _flip(adapter / "adapter_model.safetensors")  # the other night's weights
    with open_guest_agent(TeeSettings()) as agent:  # the same deployment (app id) as the run
        other_run = derive_key(agent.get_key, run_key_path("run-20260101T000000Z-0000"))
    sign_dir(other_run, adapter)
    assert _model_signing_verify(adapter, public_key_pem(other_run), tmp_path).returncode == 0
    assert _model_signing_verify(adapter, run["manifest"]["signing"]["public_key_pem"], tmp_path).returncode == 1
    assert _verify(bundle, run["policy"], capsys)["model.signature"] == "fail"


@pytest.mark.parametrize("name", [".gitattributes", ".git/config"])
def test_an_added_git_file_fails_the_library_check_with_no_ignore_git_paths(
        run: dict, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The library skips git files by default; the documented command passes --no-ignore-git-paths, and so does
    ``cvm-tune verify``."""
    bundle = _copy(run, tmp_path)
    added = bundle / "adapter" / name
    added.parent.mkdir(exist_ok=True)
    added.write_text("*.safetensors filter=lfs\n")
    key = run["manifest"]["signing"]["public_key_pem"]
    assert _model_signing_verify(bundle / "adapter", key, tmp_path).returncode == 0  # the library's default
    assert _model_signing_verify(bundle / "adapter", key, tmp_path, git=True).returncode == 1
    assert _verify(bundle, run["policy"], capsys)["model.signature"] == "fail"


def test_publish_stages_the_verified_bundle_as_a_hub_repo(run: dict, tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    repo = tmp_path / "repo"
    assert main(["publish", str(run["bundle"]), "--repo", "owner/adapter", "--policy", str(run["policy"]),
                 "--stage-only", str(repo)]) == 0
    bundle_files = {p.relative_to(run["bundle"]).as_posix() for p in run["bundle"].rglob("*") if p.is_file()}
    staged = {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()}
    adapter_files = {f for f in bundle_files if f.startswith("adapter/")}
    assert {f.removeprefix("adapter/") for f in adapter_files} | {"README.md"} <= staged
    assert {f for f in bundle_files if f.startswith("merged/")} <= staged
    others = bundle_files - adapter_files - {"README.md"} - {f for f in bundle_files if f.startswith("merged/")}
    assert {f"attestation/{f}" for f in others} | {"attestation/manifest.json", "attestation/quote.bin"} <= staged
    assert len(staged) == len(bundle_files)
    assert ModelCard.load(repo / "README.md").data.base_model == HUB_ID
    res = _model_signing_verify(repo, run["manifest"]["signing"]["public_key_pem"], tmp_path, "attestation", "merged", "README.md")
    assert res.returncode == 0, res.stdout + res.stderr


def test_publish_refuses_without_uploading(run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    args = ["publish", str(run["bundle"]), "--repo", "owner/adapter"]
    assert main([*args, "--stage-only", str(repo)]) == 1  # default policy: a simulator quote is rejected
    assert "nothing was uploaded" in capsys.readouterr().err and not repo.exists()
    bundle = _copy(run, tmp_path)
    _flip(bundle / "adapter" / "tokenizer.json")
    assert main(["publish", str(bundle), "--repo", "owner/adapter", "--policy", str(run["policy"]),
                 "--stage-only", str(repo)]) == 1
    assert not repo.exists()
    assert main(["publish", str(run["bundle"]), "--repo", "no-owner", "--policy", str(run["policy"])]) == 2
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert main([*args, "--policy", str(run["policy"])]) == 2  # verified, but no token: nothing sent
    assert "HF_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # offline (HF_HUB_OFFLINE=1): the library refuses to connect
    assert main([*args, "--policy", str(run["policy"])]) == 7
    assert "upload to owner/adapter failed" in capsys.readouterr().err


@pytest.mark.parametrize("section", [{"base_model": {"hub_id": "not a repo id"}}, {"base_model": {"revision": "main"}},
                                     {"export": {"merged_max_shard_size": "4 GB"}}, {"export": {"license": "Apache 2"}}])
def test_bad_provenance_settings_are_config_errors(tmp_path: Path, section: dict, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(section))
    assert main(["validate-config", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


class _FakeHub:
    """A loopback stand-in for the Hub's HTTP API (repo create, preupload, commit): records what the client sends."""

    def __init__(self, *, refuse_commit: bool = False) -> None:
        import http.server
        import threading

        self.created: list[dict] = []
        self.commits: list[tuple[str, list[dict]]] = []
        self.auth: set[str] = set()
        self.validated: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_a: object) -> None:
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.auth.add(self.headers.get("Authorization", ""))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    hub.created.append(json.loads(body))
                    return self._reply(200, {"url": f"{hub.url}/owner/adapter"})
                if path == "/api/validate-yaml":  # the client has the Hub check README.md's front matter first
                    hub.validated.append(json.loads(body)["content"])
                    return self._reply(200, {"errors": [], "warnings": []})
                if path.endswith("/preupload/main"):
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                       for f in files]})
                if path.endswith("/commit/main"):
                    if refuse_commit:
                        return self._reply(403, {"error": "You don't have the rights to create a commit in this repo"})
                    hub.commits.append((path, [json.loads(line) for line in body.splitlines() if line.strip()]))
                    return self._reply(200, {"commitUrl": f"{hub.url}/owner/adapter/commit/{'ab' * 20}",
                                             "commitOid": "ab" * 20})
                return self._reply(404, {"error": f"no route {path}"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("refuse", [False, True])
def test_publish_uploads_the_staged_repo_with_huggingface_hub(run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              refuse: bool) -> None:
    """hub.upload against a loopback Hub endpoint: one commit holding exactly the staged folder, byte for byte, sent
    with the configured token; a refused commit is an ExportError (exit 7 in the CLI), nothing reported published."""
    import base64

    import huggingface_hub.constants

    from app.export import hub
    from app.errors import ExportError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # loopback only: the fake Hub below
    monkeypatch.setenv("HF_TOKEN", "hf_loopback_test_token")
    folder = hub.stage_repo(run["bundle"], tmp_path / "repo")
    with _FakeHub(refuse_commit=refuse) as fake:
        if refuse:
            with pytest.raises(ExportError, match="upload to owner/adapter failed"):
                hub.upload(folder, "owner/adapter", private=True, message="m", endpoint=fake.url)
            assert fake.commits == []
            return
        url = hub.upload(folder, "owner/adapter", private=True, message="cvm-tune bundle x", endpoint=fake.url)
    assert url == f"{fake.url}/owner/adapter/commit/{'ab' * 20}"
    assert [(c["organization"], c["name"], c["type"], c["visibility"]) for c in fake.created] == [
        ("owner", "adapter", "model", "private")]
    assert fake.auth == {"Bearer hf_loopback_test_token"}
    [(path, lines)] = fake.commits
    assert path == "/api/models/owner/adapter/commit/main"
    assert lines[0] == {"key": "header", "value": {"summary": "cvm-tune bundle x", "description": ""}}
    sent = {ln["value"]["path"]: base64.b64decode(ln["value"]["content"]) for ln in lines[1:] if ln["key"] == "file"}
    staged = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert sent == staged and {"README.md", "adapter_config.json", "model.sig", "attestation/manifest.json"} <= set(sent)
    assert fake.validated == [staged["README.md"].decode()]


def test_cvm_self_verification_covers_the_model_signature(run: dict, tmp_path: Path) -> None:
    """In a CVM the export publishes only bundles passing every INTEGRITY_CHECKS check: model.signature is one, so a
    staged bundle whose adapter is signed by any other key is never published."""
    import time

    from app.errors import ExportError
    from app.export.stage import publish_gate
    from attestation import DEFAULT_POLICY, verify_bundle
    from attestation.bundle.verify import INTEGRITY_CHECKS

    assert "model.signature" in INTEGRITY_CHECKS
    bundle = _copy(run, tmp_path)
    (bundle / "adapter" / "model.sig").unlink()
    sign_dir(ec.generate_private_key(ec.SECP256R1()), bundle / "adapter")
    verdict = verify_bundle(bundle, policy=DEFAULT_POLICY, now=int(time.time()))
    assert "model.signature" in {c.name for c in verdict.failed}
    with pytest.raises(ExportError, match="fails its own verification"):
        publish_gate([("default", verdict)], simulated=False, run_id="r")
    good = verify_bundle(run["bundle"], policy=DEFAULT_POLICY, now=int(time.time()))
    publish_gate([("default", good)], simulated=False, run_id="r")  # the honest bundle passes every integrity check


def test_the_cards_verify_commands_work_as_written_from_the_exports_directory(run: dict, tmp_path: Path) -> None:
    """The card's commands, copied as they are, from the directory holding the bundle: verify with the policy the
    run wrote, and the library's own signature check."""
    exports = tmp_path / "exports"
    shutil.copytree(run["bundle"], exports / run["bundle"].name)
    shutil.copy(run["policy"], tmp_path / run["policy"].name)  # as the run laid it out: next to exports/
    card = (run["bundle"] / "README.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in card.split("```sh")[1:]]
    script = "set -e\n" + "".join(b.split("```", 1)[0] for b in blocks[:2])
    assert "cvm-tune verify" in script and "model_signing verify key" in script
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script], cwd=exports, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ACCEPTED" in proc.stdout and "Verification succeeded" in proc.stdout + proc.stderr


def test_the_card_links_the_published_browser_verifier_only_when_one_is_configured() -> None:
    """export.verify_page_url: the card tells readers to open the page and drop the bundle; without it, no link."""
    import pytest as _pytest
    from pydantic import ValidationError

    from app.config import ExportSettings
    from app.export.card import CardInputs, model_card

    base = dict(run_id="run-1", version="1", simulated=False, base_name="tiny", hub_id=None, revision=None,
                base_tree="0" * 64, license="other", dataset={"dataset_id": "d"}, backend="hf", hyper={}, steps=1,
                last_loss=None, eval_loss=None, source_sha="0" * 40, public_key_pem="KEY\n", merged=False)
    url = "https://verify.example.org/verify.html"
    with_page = model_card(CardInputs(**base, verify_page_url=url)).decode()
    assert f"open {url} and drop the bundle's folder" in with_page
    assert "verify.html" not in model_card(CardInputs(**base)).decode()
    for bad in ("http://plain.example.org/v.html", "https://x.org/a b", "javascript:alert(1)"):
        with _pytest.raises(ValidationError):
            ExportSettings(verify_page_url=bad)
