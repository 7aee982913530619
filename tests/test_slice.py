"""The whole slice: simulator -> encrypted dataset -> `cvm-tune run` -> `cvm-tune verify`, then tampering.

One demo run (module scope) produces a bundle; each tamper test copies it and changes one thing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.simulator import GuestAgentSimulator

STEPS = 12
# What the export adds to the trainer's two adapter files: the base's tokenizer and the OpenSSF signature.
ADAPTER_EXTRAS = ("adapter/chat_template.jinja", "adapter/model.sig", "adapter/tokenizer.json", "adapter/tokenizer_config.json")


def _write_config(path: Path, out: Path, **extra: object) -> Path:
    cfg = {"output": {"dir": str(out)}, "training": {"max_steps": STEPS, "save_steps": 4, "logging_steps": 1}}
    for key, value in extra.items():
        cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `cvm-tune run` on the embedded defaults (fewer steps), through the CLI entry point."""
    root = tmp_path_factory.mktemp("demo")
    out = root / "out"
    cfg = _write_config(root / "cfg.yaml", out)
    lines: list[str] = []
    import builtins

    real_print = builtins.print
    builtins.print = lambda *a, **k: lines.append(" ".join(str(x) for x in a))  # capture the CLI's output
    try:
        rc = main(["run", "--config", str(cfg)])
    finally:
        builtins.print = real_print
    bundle = next((out / "exports").iterdir())
    return {"rc": rc, "lines": lines, "bundle": bundle, "out": out, "policy": out / "simulator-test-policy.yaml"}


def verify(bundle: Path, *args: str) -> int:
    return main(["verify", str(bundle), *args])


def test_run_exports_a_bundle_and_prints_the_verdict(demo: dict) -> None:
    assert demo["rc"] == 0
    text = "\n".join(demo["lines"])
    assert f"Export bundle: {demo['bundle']}" in text
    assert "ACCEPTED" in text and "NOT evidence of a real TEE" in text
    assert "REJECTED under policy 'default'" in text and "quote.signature" in text


def test_bundle_layout(demo: dict) -> None:
    files = sorted(p.relative_to(demo["bundle"]).as_posix() for p in demo["bundle"].rglob("*") if p.is_file())
    assert files == sorted([
        "README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors", *ADAPTER_EXTRAS,
        "app-compose.json", "audit-anchors.jsonl", "audit.jsonl", "collateral.json", "config.json", "event_log.json", "gpu-evidence.json",
        "manifest.json", "quote.bin", "quote.hex", "report/loss.png", "report/report.json"])
    manifest = json.loads((demo["bundle"] / "manifest.json").read_text())
    assert manifest["schema"] == "cvm-tune/manifest/v1"
    assert manifest["backend"]["name"] == "hf"
    assert manifest["tee"]["mode"] == "embedded-simulator"
    assert manifest["audit"]["rtmr3"] == "unsupported"  # the default simulator is dstack 0.6: EmitEvent is gone
    assert manifest["audit"]["anchors"] == sum(  # so each checkpoint entry is anchored by a quote instead
        '"type":"checkpoint"' in line for line in (demo["bundle"] / "audit.jsonl").read_text().splitlines())
    adapter_cfg = json.loads((demo["bundle"] / "adapter/adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == "cvm-tune/tiny-llama"  # no build path leaks


def test_loss_goes_down(demo: dict) -> None:
    losses = json.loads((demo["bundle"] / "manifest.json").read_text())["training"]["losses"]
    assert len(losses) == STEPS
    first, last = [v for _, v in losses[:3]], [v for _, v in losses[-3:]]
    assert sum(last) / 3 < sum(first) / 3 - 0.05


def test_adapter_loads_with_peft_and_generates(demo: dict) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = demo["out"] / "models" / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(demo["bundle"] / "adapter", local_files_only=True)  # the bundle carries it
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    model = PeftModel.from_pretrained(base, demo["bundle"] / "adapter").eval()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + 6


def test_verify_accepts_under_the_simulator_policy(demo: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(demo["bundle"], "--policy", str(demo["policy"])) == 0
    assert "NOT evidence of a real TEE" in capsys.readouterr().out


def test_default_policy_rejects_simulator_quotes(demo: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(demo["bundle"]) == 1
    out = capsys.readouterr().out
    assert "FAIL quote.signature" in out


def test_verify_json_schema(demo: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(demo["bundle"], "--policy", str(demo["policy"]), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "accepted" and doc["test_root"] is True
    assert doc["tcb_status"] == "UpToDate"
    assert doc["quote_hex"] == (demo["bundle"] / "quote.bin").read_bytes().hex()
    assert doc["replayed_rtmrs"][3] == doc["measurements"]["rtmr3"]
    names = {c["name"] for c in doc["checks"]}
    for required in ("quote.signature", "report_data", "manifest.files", "event_log.replay", "audit.chain", "audit.rtmr3"):
        assert required in names


def test_verify_checks_the_inputs_when_given(demo: dict, capsys: pytest.CaptureFixture[str]) -> None:
    ds = next((demo["out"] / "datasets").iterdir())
    args = ["--policy", str(demo["policy"]), "--base-model", str(demo["out"] / "models" / "tiny-llama")]
    assert verify(demo["bundle"], *args, "--dataset", str(ds)) == 0
    other = demo["out"] / "other.cvmds"
    other.write_bytes(ds.read_bytes() + b"x")
    assert verify(demo["bundle"], *args, "--dataset", str(other)) == 1
    assert "FAIL dataset.file" in capsys.readouterr().out


def test_expired_collateral_is_cannot_verify(demo: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(demo["bundle"], "--policy", str(demo["policy"]), "--now", "4100000000") == 1
    assert "FAIL collateral.window: cannot verify" in capsys.readouterr().out


# ----------------------------------------------------------------------------- tampering
# file -> checks of which at least one must fail when one byte of that file changes
TAMPER = {
    "adapter/adapter_model.safetensors": {"manifest.files"},
    "adapter/adapter_config.json": {"manifest.files"},
    "config.json": {"manifest.files"},
    "app-compose.json": {"manifest.files", "compose.hash"},
    "README.md": {"manifest.files"},
    "audit.jsonl": {"manifest.files", "audit.chain"},
    "gpu-evidence.json": {"manifest.files", "gpu.evidence"},
    "manifest.json": {"report_data", "manifest.schema"},
    "quote.bin": {"quote.signature", "quote.parse", "quote.padding"},
    "quote.hex": {"quote.hex"},
    "event_log.json": {"event_log.replay", "event_log.parse"},
    "collateral.json": {"quote.signature", "collateral.parse", "collateral.chains"},
    "report/report.json": {"manifest.files"},
    "report/loss.png": {"manifest.files"},
    **{name: {"model.signature"} for name in ADAPTER_EXTRAS},  # tokenizer files and the signature itself
}


def _copy(demo: dict, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(demo["bundle"], dst)
    return dst


def _failed(bundle: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> set[str]:
    rc = verify(bundle, "--policy", str(policy), "--json")
    doc = json.loads(capsys.readouterr().out)
    failed = {c["name"] for c in doc["checks"] if c["status"] == "fail"}
    assert (rc == 1) == bool(failed)
    return failed


@pytest.mark.parametrize("name", sorted(TAMPER))
@pytest.mark.parametrize("where", [0.25, 0.5, 0.9])
def test_one_byte_flip_in_any_bundle_file_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      name: str, where: float) -> None:
    bundle = _copy(demo, tmp_path)
    path = bundle / name
    data = bytearray(path.read_bytes())
    pos = int(len(data) * where)
    if name == "quote.bin":
        pos = min(pos, 631)  # inside the signed header+body (the verifier also rejects non-zero padding)
    if name == "event_log.json":  # a boot event's event_type is not measured: flip inside the next digest value
        pos = data.index(b'"digest":"', pos) + 12
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    failed = _failed(bundle, demo["policy"], capsys)
    assert failed & TAMPER[name], f"flip in {name}@{pos}: failed checks {failed}"


def test_added_file_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(demo, tmp_path)
    (bundle / "adapter" / "extra.safetensors").write_bytes(b"unsigned")
    assert "bundle.files" in _failed(bundle, demo["policy"], capsys)


def test_removed_report_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(demo, tmp_path)
    (bundle / "report" / "loss.png").unlink()  # the manifest lists it: all report files or none
    assert {"bundle.files", "manifest.files"} <= _failed(bundle, demo["policy"], capsys)


def test_removed_file_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(demo, tmp_path)
    (bundle / "README.md").unlink()
    assert {"bundle.files", "manifest.files"} <= _failed(bundle, demo["policy"], capsys)


def test_symlink_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(demo, tmp_path)
    target = bundle / "config.json"
    moved = tmp_path / "config.json"
    shutil.move(target, moved)
    target.symlink_to(moved)
    assert "bundle.files" in _failed(bundle, demo["policy"], capsys)


def test_quote_from_other_content_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A valid quote (same simulator, same test CA) for different report_data: only the binding fails."""
    bundle = _copy(demo, tmp_path)
    sim = GuestAgentSimulator()
    resp = sim.get_quote(b"\x42" * 64)
    (bundle / "quote.bin").write_bytes(bytes.fromhex(resp["quote"]))
    (bundle / "quote.hex").write_text(resp["quote"] + "\n")
    (bundle / "event_log.json").write_text(resp["event_log"])
    failed = _failed(bundle, demo["policy"], capsys)
    assert "report_data" in failed
    assert "quote.signature" not in failed


def test_reordered_audit_is_rejected(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _copy(demo, tmp_path)
    lines = (bundle / "audit.jsonl").read_bytes().splitlines(keepends=True)
    (bundle / "audit.jsonl").write_bytes(b"".join([lines[1], lines[0], *lines[2:]]))
    assert "audit.chain" in _failed(bundle, demo["policy"], capsys)


def test_adapter_loads_with_plain_peft_offline(demo: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter dir is a PEFT repo: AutoPeftModelForCausalLM finds the base by its recorded name (here a local
    directory of that name, offline), the tokenizer is in it, and plain PeftModel on the local base agrees."""
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.training import build_tiny_model
    from attestation.io.hashing import tree_digest

    adapter = demo["bundle"] / "adapter"
    name = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    manifest = json.loads((demo["bundle"] / "manifest.json").read_text())
    monkeypatch.chdir(tmp_path)
    build_tiny_model(tmp_path / name)  # deterministic: the same weights the run trained on
    assert tree_digest(tmp_path / name)[0] == manifest["base_model"]["tree_sha256"]
    tokenizer = AutoTokenizer.from_pretrained(str(adapter), local_files_only=True)
    ids = tokenizer("the adapter loads", return_tensors="pt")
    auto = AutoPeftModelForCausalLM.from_pretrained(str(adapter), local_files_only=True)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(demo["out"] / "models" / "tiny-llama")),
                                      str(adapter))
    with torch.no_grad():
        assert torch.equal(auto(**ids).logits, plain(**ids).logits)


def test_model_card_has_hub_front_matter(demo: dict) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(demo["bundle"] / "README.md")
    manifest = json.loads((demo["bundle"] / "manifest.json").read_text())
    assert (card.data.library_name, card.data.pipeline_tag, card.data.license) == ("peft", "text-generation", "other")
    assert {"lora", "peft", "confidential-computing", "tdx", "cvm-tune-simulated"} <= set(card.data.tags)
    assert card.data.base_model is None and "no Hub id" in card.text  # the embedded demo's base has no Hub name
    assert manifest["signing"]["public_key_pem"] in card.text and manifest["dataset"]["plaintext_sha256"] in card.text
    assert f"cvm-tune verify {manifest['run_id']}" in card.text and "proof.t16z.com" in card.text


def test_adapter_signature_checks_with_the_model_signing_cli(demo: dict, tmp_path: Path) -> None:
    """The library's own `model_signing verify key`, given the manifest's public key, accepts the adapter and
    rejects it after a one-byte change."""
    bundle = _copy(demo, tmp_path)
    key = tmp_path / "signing-key.pem"
    key.write_text(json.loads((bundle / "manifest.json").read_text())["signing"]["public_key_pem"])
    cmd = [str(Path(sys.executable).parent / "model_signing"), "verify", "key", str(bundle / "adapter"),
           "--signature", str(bundle / "adapter" / "model.sig"), "--public_key", str(key)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "Verification succeeded" in ok.stdout, ok.stdout + ok.stderr
    weights = bundle / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Verification failed" in bad.stderr, bad.stdout + bad.stderr


# ----------------------------------------------------------------------------- input errors (exit 2)
def test_input_errors_exit_2(demo: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(tmp_path / "missing") == 2
    (tmp_path / "empty").mkdir()
    assert verify(tmp_path / "empty") == 2
    bad_policy = tmp_path / "p.yaml"
    bad_policy.write_text("allowed_tcb_statuses: [Great]\n")
    assert verify(demo["bundle"], "--policy", str(bad_policy)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 3


def test_verify_runs_as_a_console_script_without_torch(demo: dict) -> None:
    """`cvm-tune verify` in a fresh interpreter: exit code contract, and no training stack imported."""
    code = ("import sys; from app.cli import main; rc = main(sys.argv[1:]); "
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules]; "
            "print('HEAVY', heavy); raise SystemExit(rc)")
    res = subprocess.run([sys.executable, "-c", code, "verify", str(demo["bundle"]), "--policy", str(demo["policy"])],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout


# ----------------------------------------------------------------------------- fail closed
def test_no_guest_agent_exports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("DSTACK_SIMULATOR_ENDPOINT", raising=False)
    out = tmp_path / "out"
    cfg = _write_config(tmp_path / "c.yaml", out, tee={"mode": "dstack", "endpoint": str(tmp_path / "none.sock")})
    assert main(["run", "--config", str(cfg)]) == 5
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err and "Traceback" not in err
    assert not list((out / "exports").iterdir()) if (out / "exports").exists() else True


def test_attestation_verifies_with_the_training_stack_absent(demo: dict) -> None:
    """Relying parties run the verifier on small machines: block torch & co. and verify anyway."""
    code = (
        "import sys\n"
        "for m in ('torch', 'transformers', 'trl', 'peft', 'datasets', 'accelerate', 'unsloth', 'app'):\n"
        "    sys.modules[m] = None  # any import of these now raises ImportError\n"
        "from pathlib import Path\n"
        "from attestation import load_policy, verify_bundle\n"
        "v = verify_bundle(Path(sys.argv[1]), policy=load_policy(Path(sys.argv[2])), now=1800000000)\n"
        "print('ACCEPTED' if v.accepted else [c.name for c in v.failed])\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(demo["bundle"]), str(demo["policy"])],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ACCEPTED"
