"""GPU test (``pytest -m gpu``): the training API on Unsloth, driven by the unmodified tinker SDK.

``cvm-tune api serve`` with ``api.backend: unsloth`` on the small random-init Llama (tests/test_gpu.py's shape, built
by bench/gpu_train.py), in a fresh interpreter (Unsloth must be imported before transformers, peft and trl), offline
and under the test socket guard: cross-entropy steps with the loss falling, a greedy sample whose log-probabilities
(Unsloth's KV-cache decode) match a forward pass, also for an adapter without MLP targets; the saved bundle verifies
with ``cvm-tune verify --ops``, records backend ``unsloth`` and the imported Unsloth version, and its adapter is plain
PEFT (loaded without Unsloth, same loss). Then the HF backend with a 4-bit base (bitsandbytes NF4). The same checks run on the CPU against a stand-in ``unsloth``:
tests/test_api_backend.py.

On the lent GPU machine (see tests/test_gpu.py and docs/gpu.md):
    PYTHONPATH=/tmp/site:/tmp/extras:$PWD python3 -m pytest -m gpu tests/test_gpu_api.py -v
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests import api_drive, test_gpu


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                                 reason="needs unsloth (the [gpu] extra or the offline bundle)"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

SEVEN = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
small_model = test_gpu.small_model  # the fixture: tests/test_gpu.py's small Llama (head_dim 64, untied lm_head)


def test_api_on_unsloth_trains_samples_and_saves_a_plain_peft_adapter(small_model: Path, tmp_path: Path) -> None:
    config = (f"base_model:\n  source: local-dir\n  path: {small_model}\n  hub_id: cvm-tune/small-llama\n"
              "api:\n  backend: unsloth\n  max_seq_len: 256\n  max_sample_tokens: 16\n")
    srv = api_drive.Server(tmp_path, config, netguard=True)
    try:
        log = srv.start(timeout=900)
        assert re.search(r"training backend: unsloth \(.*\bunsloth 20\d\d\.", log), log[-4000:]
        run = api_drive.drive(srv, small_model, steps=6)
        narrow = api_drive.drive(srv, small_model, steps=2, train_mlp=False)  # MLP: the placeholder only
    finally:
        srv.stop()
    assert srv.net_attempts() == [], srv.log.read_text()[-4000:]  # offline from import to shutdown

    losses = run["losses"]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert all(b < a * 1.005 for a, b in zip(losses, losses[1:])), losses
    for r in (run, narrow):  # Unsloth's KV-cache decode with the API's adapters = a forward pass (bf16)
        assert len(r["sample_tokens"]) == 8
        assert r["sample_logprobs"] == pytest.approx(r["forward_logprobs"], abs=0.25)

    proc = api_drive.verify(srv, run["bundle"], run["ops"])
    assert proc.returncode == 0 and "op chain: pass: 12 ops" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    manifest = json.loads((run["bundle"] / "manifest.json").read_text())
    backend = manifest["backend"]
    assert backend["name"] == "unsloth" and backend["device"].startswith("cuda:"), backend
    assert re.fullmatch(r"20\d\d\.\d+\.\d+.*", backend["libraries"]["unsloth"]), backend
    assert {"unsloth_zoo", "torch", "transformers", "peft", "trl"} <= set(backend["libraries"]), backend
    assert manifest["op_chain"]["optimizer_steps"] == manifest["training"]["global_step"] == 6

    adapter = run["bundle"] / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["bias"]) == (8, 32, 0.0, "none")
    assert set(cfg["target_modules"]) == SEVEN | {"lm_head"} and not cfg.get("auto_mapping")
    assert cfg["base_model_name_or_path"] == "cvm-tune/small-llama"
    plain = api_drive.plain_peft_loss(srv, small_model, adapter, run["data"])  # fp32, no Unsloth in that process
    assert not plain["unsloth"] and plain["loss"] == pytest.approx(run["forward_loss"], rel=0.03)


def test_api_on_the_hf_backend_loads_the_base_4bit_when_configured(small_model: Path, tmp_path: Path) -> None:
    """``api.backend: hf`` with ``training.gpu.quantization: 4bit``: bitsandbytes NF4 base, LoRA trains, the bundle
    verifies with ``--ops`` and records the 4-bit setting it trained under."""
    config = (f"base_model:\n  source: local-dir\n  path: {small_model}\n  hub_id: cvm-tune/small-llama\n"
              "api:\n  backend: hf\n  max_seq_len: 256\n  max_sample_tokens: 16\n"
              "training:\n  gpu:\n    quantization: 4bit\n")
    srv = api_drive.Server(tmp_path, config, netguard=True)
    try:
        srv.start(timeout=900)
        run = api_drive.drive(srv, small_model, steps=4)
    finally:
        srv.stop()
    assert srv.net_attempts() == [], srv.log.read_text()[-4000:]
    assert run["losses"][-1] < run["losses"][0] and len(run["sample_tokens"]) == 8, run["losses"]
    proc = api_drive.verify(srv, run["bundle"], run["ops"])
    assert proc.returncode == 0 and "op chain: pass: 8 ops" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    manifest = json.loads((run["bundle"] / "manifest.json").read_text())
    assert manifest["backend"]["name"] == "hf" and manifest["backend"]["device"].startswith("cuda"), manifest["backend"]
    assert json.loads((run["bundle"] / "config.json").read_text())["training"]["gpu"]["quantization"] == "4bit"
