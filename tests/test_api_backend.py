"""The training API's backend (``api.backend``, app/api/engine/backend.py) on the CPU.

The choice is the nightly run's (auto without CUDA: hf; unsloth where it cannot run: exit 2 before anything is loaded
or listens); ``cvm-tune api serve`` decides before transformers, peft, trl (and FastAPI, tinker) are imported. The
Unsloth branch runs end to end against a stand-in ``unsloth`` package (Unsloth's names over plain transformers + PEFT,
written to a scratch directory): imported first, called with the nightly run's arguments, the placeholder adapter,
sampling through the engine's own LM head, the bundle recording backend ``unsloth`` and the imported versions.
The real Unsloth on a GPU: tests/test_gpu_api.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.api.engine import backend as B
from app.config import Config
from app.errors import ConfigError
from tests import api_drive

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
ROOT = Path(__file__).resolve().parent.parent
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


no_cuda = pytest.mark.skipif(_cuda(), reason="checks the behaviour without a CUDA GPU")


def _cfg(**api: Any) -> Config:
    return Config.model_validate({"api": api})


# --- the choice ------------------------------------------------------------------------------------------------


def test_the_setting_is_closed_and_defaults_to_auto() -> None:
    assert Config().api.backend == "auto"
    for bad in ("cuda", "Unsloth", ""):
        with pytest.raises(ValueError):
            _cfg(backend=bad)


@no_cuda
def test_auto_and_hf_without_cuda_choose_hf() -> None:
    assert B.choose(_cfg()) == "hf"
    assert B.choose(_cfg(backend="hf")) == "hf"


def test_auto_with_cuda_and_unsloth_chooses_unsloth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nightly run's rule, reused: a visible CUDA GPU and an installed unsloth (its spec; never imported here)."""
    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "unsloth" else real(name, *a))
    assert B.choose(_cfg()) == "unsloth" and B.choose(_cfg(backend="unsloth")) == "unsloth"
    assert B.choose(_cfg(backend="hf")) == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "unsloth" else real(name, *a))
    assert B.choose(_cfg()) == "hf"
    with pytest.raises(ConfigError, match="api.backend is 'unsloth' but the unsloth package is not installed"):
        B.choose(_cfg(backend="unsloth"))


@no_cuda
def test_unsloth_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        B.choose(_cfg(backend="unsloth"))
    assert err.value.exit_code == 2
    assert "api.backend is 'unsloth' but no CUDA GPU is visible" in err.value.message
    assert "api.backend" in err.value.fix and "training.backend" not in err.value.fix


@no_cuda
@pytest.mark.parametrize("config, error, fix", [
    ("api:\n  backend: unsloth\n", "api.backend is 'unsloth' but no CUDA GPU is visible",
     "set api.backend to 'auto' or 'hf'"),
    # the HF branch loads the base 4-bit as a nightly HF run does: where it cannot, refused as Unsloth is
    ("api:\n  backend: hf\ntraining:\n  gpu:\n    quantization: 4bit\n",
     "training.gpu.quantization is '4bit' but no CUDA GPU is visible", "set training.gpu.quantization: none, or serve on "
     "an NVIDIA GPU"),
], ids=["unsloth", "4bit"])
def test_serve_refuses_what_needs_a_gpu_before_anything_loads_or_listens(tmp_path: Path, config: str, error: str,
                                                                         fix: str) -> None:
    srv = api_drive.Server(tmp_path, config)
    proc = subprocess.run(srv.cmd, env=srv.env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"error: {error}" in proc.stderr and f"fix: {fix}" in proc.stderr
    assert "listening on" not in proc.stdout + proc.stderr
    assert not srv.out.exists()  # no output volume, no base model, no guest agent
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", srv.port)) != 0


def test_the_hf_branch_loads_as_the_nightly_hf_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's loader arguments are the nightly HF backend's (``hf_model_kwargs``): fp32 on the CPU, bf16 on a GPU
    that has it, 4-bit NF4 placed by device_map when configured."""
    import torch

    from app.config import TrainingSettings
    from app.training.options import hf_model_kwargs

    assert hf_model_kwargs(TrainingSettings(), cuda=False) == {"local_files_only": True, "dtype": torch.float32}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_a, **_k: True)
    assert hf_model_kwargs(_cfg().training, cuda=True) == {"local_files_only": True, "dtype": torch.bfloat16}
    cfg = Config.model_validate({"training": {"gpu": {"quantization": "4bit"}}})
    kw = hf_model_kwargs(cfg.training, cuda=True)
    assert kw["quantization_config"].load_in_4bit and kw["quantization_config"].bnb_4bit_quant_type == "nf4"
    assert kw["device_map"] == {"": 0} and kw["dtype"] == torch.bfloat16


SPY = textwrap.dedent("""
    import json, sys
    import app.api.engine.backend as B
    WATCH = ("transformers", "peft", "trl", "unsloth", "fastapi", "uvicorn", "tinker")
    def spy(cfg):
        print("AT-DECISION " + json.dumps(sorted(m for m in WATCH if m in sys.modules)), flush=True)
        raise SystemExit(0)
    B.prepare = spy
""")


def test_serve_decides_the_backend_before_transformers_peft_trl_are_imported(tmp_path: Path) -> None:
    """A fresh interpreter running `cvm-tune api serve`: what is imported when the backend is decided."""
    srv = api_drive.Server(tmp_path, "", preamble=SPY)
    proc = subprocess.run(srv.cmd, env=srv.env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("AT-DECISION "))
    assert json.loads(line.removeprefix("AT-DECISION ")) == []


# --- the Unsloth branch's own pieces, with plain PEFT --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Path:
    return tiny_model


def test_unsloth_arguments_are_the_nightly_runs_with_the_models_context(tiny: Path) -> None:
    load, peft = B.unsloth_kwargs(tiny, Config())
    assert load["model_name"] == str(tiny.resolve()) and Path(load["model_name"]).is_absolute()
    assert load["max_seq_length"] == 256  # the model's max_position_embeddings (no RoPE scaling added)
    assert (load["dtype"], load["load_in_4bit"], load["local_files_only"], load["token"]) == (None, False, True, None)
    assert (peft["r"], peft["lora_dropout"], peft["bias"], peft["init_lora_weights"]) == (1, 0.0, "none", True)
    assert peft["target_modules"] == SEVEN and peft["random_state"] == Config().training.seed
    four = Config.model_validate({"training": {"gpu": {"quantization": "4bit"}}})
    assert B.unsloth_kwargs(tiny, four)[0]["load_in_4bit"] is True


def test_model_context_reads_the_config_or_falls_back(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert B.model_context(tmp_path, 2048) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": True}))
    assert B.model_context(tmp_path, 2048) == 2048
    assert B.model_context(tmp_path / "missing", 512) == 512


def _peft(tiny: Path, targets: list[str], *, random_b: bool = True) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=1, target_modules=SEVEN, lora_dropout=0.0), adapter_name="default")
    model.add_adapter("m1", LoraConfig(r=4, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))
    if random_b:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B.m1." in n:
                    p.normal_(0, 0.5)
    model.set_adapter("m1")
    return model.eval()


def test_own_head_applies_the_lm_head_lora_at_every_length(tiny: Path) -> None:
    """Unsloth's head reads lm_head.weight for a one-token step; OwnHead applies lm_head (and its LoRA) through PEFT."""
    import torch

    model = _peft(tiny, ["q_proj", "lm_head"])

    class Hidden:  # what Unsloth returns under UNSLOTH_RETURN_HIDDEN_STATES: the final normed hidden states
        def __call__(self, **kw: Any) -> Any:
            assert os.environ.get(B.HIDDEN_ENV) == "1"
            out = model.base_model.model.model(input_ids=kw["input_ids"], use_cache=True)
            return SimpleNamespace(logits=out.last_hidden_state, past_key_values=out.past_key_values)

        def get_output_embeddings(self) -> Any:
            return model.get_output_embeddings()

    head = B.OwnHead(Hidden())
    with torch.no_grad():
        for ids in ([[5]], [[5, 6, 7, 8]]):
            want = model(input_ids=torch.tensor(ids)).logits
            got = head(input_ids=torch.tensor(ids))
            assert torch.allclose(got.logits, want, atol=1e-5) and got.past_key_values is not None
            plain = model.base_model.model.model(input_ids=torch.tensor(ids)).last_hidden_state
            assert not torch.allclose(plain @ model.get_output_embeddings().weight.T, want, atol=1e-3)  # LoRA counts
    assert B.HIDDEN_ENV not in os.environ
    with pytest.raises(Exception, match="not its final hidden states"):
        B.OwnHead(model)(input_ids=torch.tensor([[5, 6]]))  # a model that ignores the switch returns logits


def test_route_disables_only_the_layers_the_adapter_misses_and_changes_nothing(tiny: Path) -> None:
    import torch

    model = _peft(tiny, ["q_proj", "k_proj", "v_proj", "o_proj"])  # train_mlp off: the MLP has the placeholder only
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        B.route(model, "m1")
        after = model(input_ids=ids).logits
    disabled = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if getattr(m, "_disable_adapters", False)}
    assert disabled == {"gate_proj", "up_proj", "down_proj"}
    assert torch.equal(before, after)
    B.route(model, "default")
    assert not any(getattr(m, "_disable_adapters", False) for m in model.modules())


def test_check_placeholder_refuses_a_placeholder_that_is_not_zero(tiny: Path) -> None:
    import torch

    model = _peft(tiny, ["q_proj"], random_b=False)
    B.check_placeholder(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B.default." in n).add_(1.0)
    with pytest.raises(Exception, match="placeholder adapter is not zero"):
        B.check_placeholder(model)


def test_the_hf_engine_keeps_its_placeholder_and_calls_the_model_itself(tiny: Path) -> None:
    from app.api.engine.engine import Engine

    engine = Engine(tiny)
    try:
        assert (engine.backend, engine.placeholder, engine.device) == ("hf", "base", "cpu")
        assert engine.net is engine.model
        cfg = engine.model.peft_config["base"]
        assert (cfg.r, sorted(cfg.target_modules)) == (1, ["q_proj"])
        lora = engine.lora_config({"rank": 8, "train_attn": True, "train_mlp": False, "train_unembed": True})
        assert (lora.r, lora.lora_alpha, lora.lora_dropout, sorted(lora.target_modules)) == (
            8, 32, 0.0, ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"])
    finally:
        engine.stop()


# --- the Unsloth branch end to end, with a stand-in unsloth -------------------------------------------------------

STAND_IN = '''
"""A stand-in for unsloth on a machine without a GPU: Unsloth's names over plain transformers + PEFT, recording how it
was imported and called (tests/test_api_backend.py)."""
import json, os, sys
from types import SimpleNamespace

__version__ = "0.0.0+stand-in"
_state = {"late": sorted(m for m in ("transformers", "peft", "trl") if m in sys.modules),
          "env": {k: os.environ.get(k) for k in ("UNSLOTH_DISABLE_STATISTICS", "HF_HUB_OFFLINE", "HF_TOKEN",
                                                 "HF_TOKEN_PATH", "UNSLOTH_COMPILE_LOCATION")},
          "calls": []}


def _save():
    with open(os.environ["STAND_IN_REPORT"], "w") as f:
        json.dump(_state, f)


_save()


def _plain(kw):
    return {k: v for k, v in kw.items() if isinstance(v, (str, int, float, bool, list, type(None)))}


class FastLanguageModel:
    @staticmethod
    def from_pretrained(**kw):
        _state["calls"].append(["from_pretrained", _plain(kw)])
        _save()
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(kw["model_name"], local_files_only=kw["local_files_only"],
                                                     dtype=torch.float32)
        def forward(input_ids=None, past_key_values=None, use_cache=None, position_ids=None, **rest):
            if past_key_values is not None and input_ids.shape[1] == 1:  # as Unsloth's decode step: the active
                for m in model.modules():                                  # adapter's LoRA looked up in every layer
                    lora_a = m._modules.get("lora_A")
                    if lora_a is not None and not m.disable_adapters:
                        lora_a[m.active_adapters[0]]  # KeyError where the adapter does not reach
                # and the step's position read from position_ids (AttributeError on None, as Unsloth's)
                assert int(position_ids.max()) == past_key_values.get_seq_length(), "decode position off"
            out = model.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                              position_ids=position_ids)
            h = out.last_hidden_state
            if os.environ.get("UNSLOTH_RETURN_HIDDEN_STATES") == "1":  # as Unsloth: final hidden states as .logits
                return SimpleNamespace(logits=h, past_key_values=out.past_key_values)
            # as Unsloth's head: a one-token step reads lm_head.weight (a LoRA on lm_head does not count)
            logits = h @ model.lm_head.weight.T if h.shape[:2] == (1, 1) else model.lm_head(h)
            return SimpleNamespace(logits=logits, past_key_values=out.past_key_values)

        model.forward = forward
        return model, None

    @staticmethod
    def get_peft_model(model, **kw):
        _state["calls"].append(["get_peft_model", _plain(kw)])
        _save()
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=kw["r"], lora_alpha=kw["lora_alpha"], lora_dropout=kw["lora_dropout"],
                                                target_modules=kw["target_modules"], bias=kw["bias"],
                                                init_lora_weights=kw["init_lora_weights"], task_type="CAUSAL_LM"))
'''

LLAMA = '''
def resolve_logit_scaling(config):
    return 0, 0


def apply_logit_transforms(logits, softcapping, scaling):
    return logits
'''

# This machine has no GPU: the decision sees one (the stand-in needs none); the rest of the rule is the real one.
AS_IF_CUDA = textwrap.dedent("""
    import torch
    import app.api.engine.backend as B
    _real = B.choose
    def _choose(cfg):
        saved, torch.cuda.is_available = torch.cuda.is_available, lambda: True
        try:
            return _real(cfg)
        finally:
            torch.cuda.is_available = saved
    B.choose = _choose
""")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("stand-in")
    (site / "unsloth" / "models").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text(STAND_IN)
    (site / "unsloth" / "models" / "__init__.py").write_text("")
    (site / "unsloth" / "models" / "llama.py").write_text(LLAMA)
    return site


def test_the_unsloth_branch_end_to_end_with_a_stand_in(stand_in: Path, tmp_path: Path) -> None:
    report = tmp_path / "stand-in.json"
    env = {"PYTHONPATH": os.pathsep.join([str(stand_in), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p]]),
           "STAND_IN_REPORT": str(report), "HF_TOKEN": "hf_must_not_be_seen"}
    srv = api_drive.Server(tmp_path, "api:\n  backend: auto\n  max_seq_len: 128\n  max_sample_tokens: 16\n",
                           env=env, preamble=AS_IF_CUDA, netguard=True)
    try:
        log = srv.start()
        assert "training backend: unsloth (" in log and "unsloth 0.0.0+stand-in" in log, log
        run = api_drive.drive(srv, srv.out / "models" / "tiny-llama", steps=5)
        narrow = api_drive.drive(srv, srv.out / "models" / "tiny-llama", steps=2, train_mlp=False)
    finally:
        srv.stop()

    assert srv.net_attempts() == []  # nothing but its own loopback port, from import to shutdown
    seen = json.loads(report.read_text())
    assert seen["late"] == []  # imported before transformers, peft and trl
    env_seen = seen["env"]
    assert env_seen["UNSLOTH_DISABLE_STATISTICS"] == "1" and env_seen["HF_HUB_OFFLINE"] == "1"
    assert env_seen["HF_TOKEN"] is None and env_seen["HF_TOKEN_PATH"] == os.devnull
    assert env_seen["UNSLOTH_COMPILE_LOCATION"] and not Path(env_seen["UNSLOTH_COMPILE_LOCATION"]).is_relative_to(tmp_path)
    (load_name, load), (peft_name, peft) = seen["calls"]
    assert (load_name, peft_name) == ("from_pretrained", "get_peft_model")
    tiny = (srv.out / "models" / "tiny-llama").resolve()
    assert load["model_name"] == str(tiny) and load["max_seq_length"] == 256 and load["local_files_only"] is True
    assert load["load_in_4bit"] is False and load["dtype"] is None
    assert (peft["r"], peft["target_modules"], peft["lora_dropout"], peft["bias"]) == (1, SEVEN, 0.0, "none")

    losses = run["losses"]
    assert len(losses) == 5 and losses[-1] < 0.8 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
    for r in (run, narrow):  # KV-cache decode (placeholder, route, own LM head) = a forward pass over the sequence
        assert len(r["sample_tokens"]) == 8
        assert r["sample_logprobs"] == pytest.approx(r["forward_logprobs"], abs=1e-3)

    proc = api_drive.verify(srv, run["bundle"], run["ops"])
    assert proc.returncode == 0 and "op chain: pass: 10 ops" in proc.stdout, proc.stdout + proc.stderr
    manifest = json.loads((run["bundle"] / "manifest.json").read_text())
    assert manifest["backend"]["name"] == "unsloth" and manifest["backend"]["device"] == "cpu"
    libraries = manifest["backend"]["libraries"]
    assert libraries["unsloth"] == "0.0.0+stand-in" and {"torch", "transformers", "peft"} <= set(libraries)
    adapter = run["bundle"] / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (8, 32, 0.0) and not cfg.get("auto_mapping")
    assert "lm_head" in cfg["target_modules"] and cfg["base_model_name_or_path"] == "cvm-tune/tiny-llama"
    plain = api_drive.plain_peft_loss(srv, tiny, adapter, run["data"])
    assert plain["loss"] == pytest.approx(run["forward_loss"], rel=1e-4) and not plain["unsloth"]
