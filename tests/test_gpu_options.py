"""The GPU path's own logic, on the CPU without Unsloth: combinations, Unsloth/transformers/TRL arguments, env, versions.

Run: ``python -m pytest tests/test_gpu_options.py -q``.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from app.config import Config, TrainingSettings
from app.errors import TrainingError
from app.training import options as O
from app.training.batch import BatchPlan

REPO = Path(__file__).resolve().parent.parent


def _s(**gpu: object) -> TrainingSettings:
    base = TrainingSettings()
    return base.model_copy(update={"gpu": base.gpu.model_copy(update=gpu)})


@pytest.mark.parametrize(("backend", "gpu", "cuda", "match"), [
    ("hf", {"quantization": "4bit"}, False, "quantization is '4bit'"),
    ("hf", {"batching": "padding_free"}, True, "needs the Unsloth backend"),
    ("hf", {"batching": "packed"}, True, "needs the Unsloth backend"),
    ("hf", {"gradient_checkpointing": "unsloth"}, True, "gradient_checkpointing 'unsloth'"),
    ("unsloth", {"devices": 2}, True, "HF backend only"),
])
def test_refused_combinations(backend: str, gpu: dict, cuda: bool, match: str) -> None:
    with pytest.raises(TrainingError, match=match) as err:
        O.check_options(backend, _s(**gpu), cuda=cuda)
    assert err.value.fix


@pytest.mark.parametrize(("backend", "gpu", "cuda"), [
    ("hf", {}, False), ("hf", {"quantization": "4bit", "devices": 4}, True),
    ("unsloth", {"batching": "padding_free", "quantization": "4bit", "gradient_checkpointing": "unsloth"}, True),
    ("unsloth", {"batching": "packed"}, True),
])
def test_allowed_combinations(backend: str, gpu: dict, cuda: bool) -> None:
    O.check_options(backend, _s(**gpu), cuda=cuda)


def test_gradient_checkpointing_modes() -> None:
    assert O.gradient_checkpointing("hf", _s(), cuda=False) is False
    assert O.gradient_checkpointing("hf", _s(), cuda=True) is True
    assert O.gradient_checkpointing("unsloth", _s(), cuda=True) == "unsloth"
    assert O.gradient_checkpointing("unsloth", _s(gradient_checkpointing="on"), cuda=True) is True
    assert O.gradient_checkpointing("hf", _s(gradient_checkpointing="off"), cuda=True) is False


def test_unsloth_arguments_match_the_hf_lora_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = _s(quantization="4bit").model_copy(update={"max_length": 2048, "seed": 7})
    load = O.unsloth_load_kwargs(Path("models/base"), s, "unsloth")
    assert load["model_name"] == str(tmp_path / "models" / "base")  # absolute: never an "org/name" Hub lookup
    assert load["model_name"].startswith("/") and load["model_name"].count("/") > 1
    assert (load["max_seq_length"], load["load_in_4bit"], load["load_in_8bit"], load["full_finetuning"]) == (2048, True, False, False)
    assert (load["local_files_only"], load["token"], load["random_state"], load["use_gradient_checkpointing"]) == (
        True, None, 7, "unsloth")
    peft = O.unsloth_peft_kwargs(s, "unsloth")
    lora = s.lora
    assert (peft["r"], peft["lora_alpha"], peft["lora_dropout"], peft["target_modules"], peft["bias"]) == (
        lora.r, lora.alpha, lora.dropout, list(lora.target_modules), "none")
    assert peft["use_gradient_checkpointing"] == "unsloth" and peft["random_state"] == 7


def test_transformers_load_arguments() -> None:
    from transformers import BitsAndBytesConfig

    assert O.hf_load_kwargs(_s(), cuda=False, bf16=False) == {"local_files_only": True, "dtype": "float32"}
    assert O.hf_load_kwargs(_s(), cuda=True, bf16=True)["dtype"] == "bfloat16"
    q = O.hf_load_kwargs(_s(quantization="4bit"), cuda=True, bf16=True, local_rank=3)
    assert q["device_map"] == {"": 3}
    bnb = BitsAndBytesConfig(**q["quantization_config"])  # builds without bitsandbytes installed
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and str(bnb.bnb_4bit_compute_dtype) == "torch.bfloat16"


@pytest.mark.parametrize(("batching", "expected"), [
    ("padded", {"packing": False, "padding_free": False}),
    ("padding_free", {"packing": False, "padding_free": True}),
    ("packed", {"packing": True}),
])
@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
def test_sft_batch_arguments_are_accepted_by_trl(batching: str, expected: dict, tmp_path: Path) -> None:
    from trl import SFTConfig

    kw = O.sft_batch_kwargs(_s(batching=batching).model_copy(update={"save_steps": 5}), BatchPlan(2, 4, 3), has_eval=True)
    assert {k: kw[k] for k in ("packing", "padding_free") if k in kw} == expected
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["per_device_eval_batch_size"]) == (2, 4, 3)
    assert (kw["eval_strategy"], kw["eval_steps"]) == ("steps", 5)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kw)
    assert args.packing is expected["packing"] and args.gradient_accumulation_steps == 4
    assert O.sft_batch_kwargs(_s(), BatchPlan(1, 1, 1), has_eval=False)["eval_strategy"] == "no"


def test_unsloth_environment() -> None:
    env = {"HF_TOKEN": "hf_secret", "HUGGING_FACE_HUB_TOKEN": "x", "UNSLOTH_USE_MODELSCOPE": "1", "KEEP": "1"}
    O.apply_unsloth_env(env)
    assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env and "UNSLOTH_USE_MODELSCOPE" not in env
    assert env["UNSLOTH_DISABLE_STATISTICS"] == env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["HF_TOKEN_PATH"] == "/dev/null" and env["KEEP"] == "1"


def test_huggingface_hub_finds_no_token_under_the_unsloth_env(tmp_path: Path) -> None:
    """Unsloth calls huggingface_hub.login() (network) whenever get_token() returns a token."""
    (tmp_path / "token").write_text("hf_cached_token")
    code = ("import os; from app.training.options import apply_unsloth_env; apply_unsloth_env(); "
            "from huggingface_hub import get_token; print(repr(get_token()))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HF_TOKEN": "hf_env_token", "HF_TOKEN_PATH": str(tmp_path / "token"),
           "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_versions_are_the_imported_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    fake = types.ModuleType("cvm_tune_fake_unsloth")
    fake.__version__ = "2026.10.9"  # what a PYTHONPATH bundle shadowing an installed 2026.10.7 reports
    monkeypatch.setitem(sys.modules, "cvm_tune_fake_unsloth", fake)
    versions = O.imported_versions(["cvm_tune_fake_unsloth", "torch", "pytest", "not_installed_anywhere"])
    assert versions == {"cvm_tune_fake_unsloth": "2026.10.9", "torch": torch.__version__, "pytest": pytest.__version__}


def test_an_hf_run_does_not_record_unsloth_versions() -> None:
    """The GPU bundle puts unsloth on the path: an HF run there must not list it as if it had trained with it."""
    assert not {"unsloth", "unsloth_zoo"} & set(O.library_names("hf"))
    assert {"unsloth", "unsloth_zoo", "torch", "transformers", "peft", "trl"} <= set(O.library_names("unsloth"))


def test_defaults_change_nothing_and_light_imports() -> None:
    g = Config().training.gpu
    assert (g.devices, g.quantization, g.gradient_checkpointing, g.batching, g.auto_batch_size) == (1, "none", "auto", "padded", False)
    code = ("import sys, app.training.options, app.training.batch, app.training.launch, app.run.gpu, attestation.tdx.gpu; "
            "print([m for m in ('torch', 'transformers', 'trl', 'peft', 'unsloth') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("training", "message"), [
    ({"backend": "hf", "gpu": {"batching": "padding_free"}}, "needs the Unsloth backend"),
    ({"backend": "hf", "gpu": {"gradient_checkpointing": "unsloth"}}, "needs the Unsloth backend"),
    ({"backend": "unsloth", "gpu": {"devices": 2}}, "hf backend only"),
    ({"gpu": {"oom_retries": 11}}, "less than or equal to 10"),
    ({"gpu": {"quantization": "8bit"}}, "training.gpu.quantization"),
])
def test_config_refuses_what_the_backend_alone_rules_out(tmp_path: Path, training: dict, message: str) -> None:
    import yaml

    from app.config import load_config
    from app.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"training": training}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    path.write_text(yaml.safe_dump({"training": {"backend": "auto", "gpu": {"batching": "packed", "devices": 2}}}))
    assert load_config(path).training.gpu.batching == "packed"  # auto: decided at run time


# ---------------------------------------------------------------- found by reading Unsloth 2026.10.7 / 2026.10.9


def test_unsloth_compiled_code_goes_to_a_private_directory(tmp_path: Path) -> None:
    """Unsloth writes its generated trainer into ./unsloth_compiled_cache unless UNSLOTH_COMPILE_LOCATION is set."""
    env: dict[str, str] = {}
    O.apply_unsloth_env(env)
    folder = Path(env[O.UNSLOTH_COMPILE_ENV])
    assert folder.is_absolute() and folder.is_dir() and folder.name.startswith("cvm-tune-unsloth-")
    assert (folder.stat().st_mode & 0o077) == 0  # mkdtemp: private to this user
    other: dict[str, str] = {}
    O.apply_unsloth_env(other)
    assert other[O.UNSLOTH_COMPILE_ENV] != env[O.UNSLOTH_COMPILE_ENV]  # one per process (per call)
    kept = {O.UNSLOTH_COMPILE_ENV: str(tmp_path)}
    O.apply_unsloth_env(kept)
    assert kept[O.UNSLOTH_COMPILE_ENV] == str(tmp_path)  # an operator's choice is kept


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
def test_optimizer_arguments_are_the_hf_defaults(tmp_path: Path) -> None:
    """Passed explicitly so that Unsloth's SFTConfig defaults (8-bit AdamW, weight decay 0.001...) never apply.

    They equal plain TRL's defaults here, so the HF backend trains exactly as it would without them.
    """
    from trl import SFTConfig

    plain = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    explicit = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **O.OPTIMIZER_ARGS)
    for key, value in O.OPTIMIZER_ARGS.items():
        assert getattr(plain, key) == getattr(explicit, key) == value, key
    assert {"optim", "weight_decay", "warmup_steps", "eval_accumulation_steps", "torch_empty_cache_steps"} <= set(O.OPTIMIZER_ARGS)


@pytest.mark.parametrize(("config", "max_length", "limit"), [
    ({"max_position_embeddings": 256}, 257, 256),
    ({"text_config": {"max_position_embeddings": 2048}, "max_position_embeddings": 99999}, 4096, 2048),
])
def test_max_length_above_the_model_positions_is_refused(config: dict, max_length: int, limit: int) -> None:
    with pytest.raises(TrainingError, match=f"max_length {max_length} exceeds .* {limit}") as err:
        O.check_max_length(config, max_length)
    assert err.value.fix == f"set training.max_length to at most {limit}"


@pytest.mark.parametrize(("config", "max_length"), [
    ({"max_position_embeddings": 256}, 256), ({}, 10**6), ({"max_position_embeddings": None}, 8), ({"max_position_embeddings": True}, 8),
])
def test_max_length_within_or_unknown_is_accepted(config: dict, max_length: int) -> None:
    O.check_max_length(config, max_length)


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """triton 'installed', Python headers present; returns an empty PATH directory to put compilers in."""
    import importlib.util
    import sysconfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").write_text("/* */\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **kw: {"include": str(include)})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return bin_dir


def _tool(folder: Path, name: str) -> None:
    (folder / name).write_text("#!/bin/sh\nexit 0\n")
    (folder / name).chmod(0o755)


def test_triton_toolchain_needs_a_compiler_and_python_headers(fake_triton: Path, tmp_path: Path) -> None:
    path = str(fake_triton)
    assert "no C compiler" in O.triton_toolchain_problem({"PATH": path})
    assert O.triton_toolchain_problem({"PATH": path, "CC": "missing-cc"}) == "CC=missing-cc is not an executable"
    _tool(fake_triton, "clang")
    assert O.triton_toolchain_problem({"PATH": path}) is None
    _tool(fake_triton, "mycc")
    assert O.triton_toolchain_problem({"PATH": path, "CC": "mycc"}) is None
    (tmp_path / "include" / "Python.h").unlink()
    assert "no Python headers" in O.triton_toolchain_problem({"PATH": path})


def test_a_cuda_run_without_a_compiler_is_refused_before_loading(fake_triton: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_triton))
    monkeypatch.delenv("CC", raising=False)
    O.check_triton_toolchain(cuda=False)  # the CPU path never launches a Triton kernel
    with pytest.raises(TrainingError, match="Triton cannot build its GPU kernel launchers: no C compiler") as err:
        O.check_triton_toolchain(cuda=True)
    assert "install gcc" in err.value.fix


def test_no_triton_needs_no_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert O.triton_toolchain_problem({"PATH": ""}) is None


def test_unsloth_is_imported_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """prepare_backend runs in the pipeline and again in train: the second call must not warn about import order."""
    from app.training import backend as B

    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    import transformers  # noqa: F401  (imported by now: a real import would warn)

    with caplog.at_level("WARNING"):
        B._import_unsloth()
    assert not caplog.records
    assert B.prepare_backend(TrainingSettings(backend="hf")) == "hf"
