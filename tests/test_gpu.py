"""GPU tests (``pytest -m gpu``): Unsloth training and export, no network, GPU evidence, real CUDA OOM back-off, DDP.

Skipped cleanly without CUDA (and, per test, without Unsloth or a second GPU). Every training run
happens in a fresh interpreter: Unsloth must be imported before transformers/TRL/PEFT and patches them
process-wide, and the socket guard must be in place before any of them is imported.

On the lent GPU machine (offline; see docs/gpu.md):
    mkdir -p /tmp/site /tmp/extras && tar xzf .gpu/site.tgz -C /tmp/site && tar xzf .gpu/extras.tgz -C /tmp/extras
    PYTHONPATH=/tmp/site:/tmp/extras:$PWD python3 -m pytest -m gpu -v
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


HAS_CUDA = _cuda_devices() > 0
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
needs_unsloth = pytest.mark.skipif(not HAS_UNSLOTH, reason="needs unsloth (the [gpu] extra or the offline bundle)")

# A small Llama (kernel-friendly sizes: head_dim 64) with the tiny model's local tokenizer.
SMALL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}

_TRAIN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from tests.netguard import guard
    spec = json.loads(sys.argv[1])
    with guard() as attempts:
        import torch
        if spec.get("memory_limit_gib"):  # a small GPU: the caching allocator raises a real CUDA OOM above this
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(spec["memory_limit_gib"] * 2**30 / total, 0)
        from app.config import TrainingSettings
        from app.training import TrainRequest, train
        from tests.test_training import _rows
        rows = [{"text": "the quick brown fox " * 600}] * spec["long_rows"] if spec.get("long_rows") else _rows(40)
        changes = []
        r = train(TrainRequest(base_model_dir=Path(spec["model"]), base_model_name="cvm-tune/small-llama",
                               rows=rows, run_dir=Path(spec["run_dir"]),
                               settings=TrainingSettings.model_validate(spec["settings"]), fingerprint="ab" * 32,
                               on_batch_change=changes.append))
    print(json.dumps({"backend": r.backend, "device": r.device, "losses": r.losses, "global_step": r.global_step,
                      "libraries": r.library_versions, "batch": r.batch, "changes": changes, "attempts": attempts,
                      "unsloth_imported": "unsloth" in sys.modules}))
""")


def _env() -> dict[str, str]:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO)])}


def _train(tmp: Path, model: Path, settings: dict[str, Any], *, timeout: float = 1200, **spec: Any) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    job = {"model": str(model), "run_dir": str(tmp / "run"), "settings": settings, **spec}
    try:
        proc = subprocess.run([sys.executable, "-c", _TRAIN, json.dumps(job)], cwd=tmp, env=_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the run's own output, not only pytest-timeout's stack
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"training did not finish in {timeout:g} s; its stderr ends:\n{err[-4000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built on the GPU machine, offline, by the benchmark's own builder (random init, bf16); tests/test_gpu_api.py
    uses it too."""
    out = tmp_path_factory.mktemp("models") / "small-llama"
    code = ("import sys, json; sys.path.insert(0, 'bench'); import gpu_train; from pathlib import Path; "
            "gpu_train.build_model(Path(sys.argv[1]), json.loads(sys.argv[2]), cuda=True)")
    subprocess.run([sys.executable, "-c", code, str(out), json.dumps(SMALL)], cwd=REPO, env={**_env(), "HF_HUB_OFFLINE": "1"},
                   check=True, timeout=600)
    return out


def _settings(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"max_steps": 8, "per_device_batch_size": 4, "gradient_accumulation_steps": 1,
                            "learning_rate": 2e-3, "max_length": 256, "save_steps": 4, "logging_steps": 1}
    base.update(kw)
    return base


@needs_unsloth
def test_unsloth_trains_offline_and_exports_an_adapter_plain_peft_loads(small_model: Path, tmp_path: Path) -> None:
    out = _train(tmp_path, small_model, _settings(backend="unsloth"))
    assert out["attempts"] == []  # no network at import, load, train or save
    assert out["backend"] == "unsloth" and out["unsloth_imported"] and out["device"].startswith("cuda:")
    assert {"unsloth", "unsloth_zoo", "torch", "transformers", "trl", "peft"} <= set(out["libraries"])
    assert out["global_step"] == 8 and all(v == v and v < 20 for _, v in out["losses"])  # finite
    adapter = tmp_path / "run" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "cvm-tune/small-llama" and cfg["r"] == 8

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(small_model, local_files_only=True, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()  # plain PEFT, no Unsloth in this process
    assert "unsloth" not in sys.modules
    enc = tok("What is 2 plus 3?", return_tensors="pt")
    with torch.no_grad():
        out_ids = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out_ids.shape[1] == enc["input_ids"].shape[1] + 4


@needs_unsloth
@pytest.mark.timeout(420)  # two Unsloth runs, each in a fresh interpreter that compiles again (over 150 s together)
def test_unsloth_padding_free_keeps_examples_apart(small_model: Path, tmp_path: Path) -> None:
    """Same examples per step, flattened: the first-step loss must match the padded run's."""
    padded = _train(tmp_path / "a", small_model, _settings(backend="unsloth", max_steps=2), timeout=200)
    flat = _train(tmp_path / "b", small_model, _settings(backend="unsloth", max_steps=2, gpu={"batching": "padding_free"}),
                  timeout=200)
    assert flat["losses"][0][1] == pytest.approx(padded["losses"][0][1], rel=2e-2)


def test_hf_backend_on_gpu_real_cuda_oom_backs_off(small_model: Path, tmp_path: Path) -> None:
    """A real CUDA OOM: 1 GiB for the allocator; micro-batch 128 x 1024 tokens (logits alone 256 MiB bf16) does not fit."""
    out = _train(tmp_path, small_model, _settings(backend="hf", max_steps=2, per_device_batch_size=128, max_length=1024,
                                                  gpu={"oom_retries": 7}), long_rows=256, memory_limit_gib=1.0)
    assert out["changes"] and all(c["phase"] == "train" and c["reason"] == "oom" for c in out["changes"])
    assert out["batch"]["final"]["micro"] < 128 and out["batch"]["effective"] == 128
    assert out["global_step"] == 2 and out["attempts"] == []


def test_gpu_evidence_on_this_machine() -> None:
    from app.run.gpu import collect

    info = collect("0" * 64).info
    assert info.present and info.nvidia_smi == "ok" and info.devices
    d = info.devices[0]
    assert d.name.startswith("NVIDIA") and d.uuid.startswith(("GPU-", "MIG-")) and d.driver_version and d.vbios_version
    assert info.cc_mode in ("on", "devtools", "ppcie", "off", "unknown")  # a lent machine is usually not in CC mode
    print(f"\nGPU evidence: {info.model_dump_json()}")


def test_pipeline_on_gpu_binds_evidence_and_verifies(small_model: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"  # JSON is YAML
    cfg.write_text(json.dumps({"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 4, "save_steps": 2},
                               "base_model": {"source": "local-dir", "path": str(small_model)}}))
    code = ("import sys; from tests.netguard import guard\n"
            "with guard() as attempts:\n"
            "    from app.cli import main\n    rc = main(['run', '--config', sys.argv[1]])\n"
            "print('ATTEMPTS', len(attempts)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ATTEMPTS 0" in proc.stdout
    bundle = next((tmp_path / "out" / "exports").iterdir())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["gpu"]["present"] and manifest["backend"]["device"].startswith("cuda:")
    assert manifest["backend"]["name"] == ("unsloth" if HAS_UNSLOTH else "hf")

    from attestation import load_policy, verify_bundle

    policy = load_policy(tmp_path / "out" / "simulator-test-policy.yaml")
    verdict = verify_bundle(bundle, policy=policy, now=int(time.time()))
    check = next(c for c in verdict.checks if c.name == "gpu.evidence")
    assert verdict.accepted and check.status == "pass", [c for c in verdict.checks if c.status == "fail"]
    print(f"\ngpu.evidence: {check.detail}")


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two GPUs")
def test_two_gpu_ddp_matches_one_gpu(small_model: Path, tmp_path: Path) -> None:
    two = _train(tmp_path / "two", small_model, _settings(backend="hf", per_device_batch_size=2, gpu={"devices": 2}))
    one = _train(tmp_path / "one", small_model, _settings(backend="hf", per_device_batch_size=4))
    assert two["device"].startswith("2 x cuda") and two["batch"]["effective"] == 4
    for (_, a), (_, b) in zip(two["losses"], one["losses"], strict=True):
        assert a == pytest.approx(b, rel=2e-2)  # bf16
