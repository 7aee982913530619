"""Settings -> library arguments for both backends (pure: no torch/transformers/unsloth import here).

Everything the GPU path decides that is ours, and so testable on a CPU without Unsloth: which
combinations are allowed, the ``FastLanguageModel.from_pretrained`` / ``get_peft_model`` arguments,
the transformers load arguments (bf16, QLoRA), the SFTConfig batching and optimizer arguments, the
environment Unsloth is imported under, whether Triton can build its kernel launchers, and the library
versions actually imported.

Why ``padding_free`` and ``packed`` are Unsloth-only: both flatten several examples into one row and
rely on the attention kernel to keep examples apart. Unsloth builds a block mask for SDPA (and uses
varlen kernels); plain transformers SDPA does not (measured: the second example's logits change when
it follows another in the same row), and flash-attention is in neither locked stack.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import BaseModelError, TrainingError

if TYPE_CHECKING:
    from app.config import TrainingSettings
    from app.training.batch import BatchPlan

BASE_LIBS = ("torch", "transformers", "peft", "trl", "datasets", "accelerate")
UNSLOTH_LIBS = ("unsloth", "unsloth_zoo", "bitsandbytes", "triton")


def library_names(backend: str) -> tuple[str, ...]:
    """The libraries whose versions a run of ``backend`` records (the manifest's, and the GPU benchmark's)."""
    return BASE_LIBS + (UNSLOTH_LIBS if backend == "unsloth" else ())


# Set before unsloth is imported. Besides the offline switches (app.training.OFFLINE_ENV): no Hub token
# may be visible. Unsloth 2026.10's from_pretrained reads one through huggingface_hub.get_token() and
# hands it to every Hub call, and calls huggingface_hub.login() (a network call) for a token passed
# in while none is saved; this app never downloads anything and never needs one.
UNSLOTH_ENV_SET = {"UNSLOTH_DISABLE_STATISTICS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN_PATH": os.devnull}
UNSLOTH_ENV_UNSET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "UNSLOTH_USE_MODELSCOPE")
# Unsloth writes the trainer code it generates at import into UNSLOTH_COMPILE_LOCATION, by default
# ./unsloth_compiled_cache relative to the working directory (and puts that on sys.path). cvm-tune gives
# each process a private directory instead (removed at exit), unless the variable is already set.
UNSLOTH_COMPILE_ENV = "UNSLOTH_COMPILE_LOCATION"

# Optimizer arguments passed explicitly to SFTConfig. They are transformers' own defaults (torch >= 2.8),
# which the HF backend would get anyway; importing Unsloth swaps in an SFTConfig whose defaults differ
# (8-bit AdamW, weight decay 0.001, warmup 10 %, an eval accumulation and an empty-cache interval), so
# without them the two backends would not train with the same optimizer.
OPTIMIZER_ARGS: dict[str, Any] = {"optim": "adamw_torch_fused", "weight_decay": 0.0, "warmup_steps": 0,
                                  "eval_accumulation_steps": None, "torch_empty_cache_steps": None}


def check_options(backend: str, s: TrainingSettings, *, cuda: bool) -> None:
    """Refuse combinations that would train wrongly or cannot run here (before anything is loaded).

    Raises:
        TrainingError: naming the setting and what to change.
    """
    g = s.gpu
    if g.quantization == "4bit" and not cuda:
        raise TrainingError("training.gpu.quantization is '4bit' but no CUDA GPU is visible (bitsandbytes QLoRA is CUDA-only)",
                            fix="set training.gpu.quantization: none, or run on an NVIDIA GPU")
    if g.batching != "padded" and backend != "unsloth":
        raise TrainingError(f"training.gpu.batching '{g.batching}' needs the Unsloth backend: transformers' SDPA attention "
                            "would let packed examples attend to each other",
                            fix="set training.gpu.batching: padded, or use training.backend: unsloth on a GPU")
    if g.gradient_checkpointing == "unsloth" and backend != "unsloth":
        raise TrainingError("training.gpu.gradient_checkpointing 'unsloth' needs the Unsloth backend",
                            fix="set training.gpu.gradient_checkpointing to auto, on or off")
    if g.devices > 1 and backend == "unsloth":
        raise TrainingError("multi-GPU training (training.gpu.devices > 1) runs the HF backend only in cvm-tune",
                            fix="set training.backend: hf (or auto) with devices > 1, or devices: 1 for Unsloth")


def context_limit(model_config: Mapping[str, Any]) -> int | None:
    """A model config's ``max_position_embeddings`` (a nested ``text_config``'s when there is one), else None."""
    text = model_config.get("text_config")
    limit = (text if isinstance(text, Mapping) else model_config).get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def check_max_length(model_config: Mapping[str, Any], max_length: int) -> None:
    """Refuse ``training.max_length`` above the base model's ``max_position_embeddings``.

    Unsloth would not refuse: it loads the model with RoPE scaling added (an adapter trained against a
    base that plain transformers + PEFT do not reproduce); transformers would run positions the model
    was never trained on. A config without the field (or a nested ``text_config``) is not checked.

    Raises:
        TrainingError: naming both numbers.
    """
    limit = context_limit(model_config)
    if limit is not None and max_length > limit:
        raise TrainingError(f"training.max_length {max_length} exceeds the base model's max_position_embeddings {limit}",
                            fix=f"set training.max_length to at most {limit}")


def gradient_checkpointing(backend: str, s: TrainingSettings, *, cuda: bool) -> bool | str:
    """The checkpointing mode: False, True, or ``"unsloth"`` (Unsloth's offloaded variant)."""
    mode = s.gpu.gradient_checkpointing
    if s.privacy.mode == "dp-sgd":
        return False  # a recomputed forward would fire Opacus' activation hooks twice
    if mode == "auto":
        if not cuda:
            return False  # tiny CPU models only slow down
        return "unsloth" if backend == "unsloth" else True
    return {"off": False, "on": True, "unsloth": "unsloth"}[mode]


def unsloth_load_kwargs(base_model_dir: Path, s: TrainingSettings, ckpt: bool | str) -> dict[str, Any]:
    """``FastLanguageModel.from_pretrained`` arguments.

    The model name is the directory's absolute path: for a string of the form ``org/name`` and no
    offline switch, Unsloth fetches a model-name mapper from GitHub and executes it.
    """
    return {
        "model_name": str(Path(base_model_dir).resolve()),
        "max_seq_length": s.max_length,
        "dtype": None,  # bf16 where supported (Hopper), else fp16
        "load_in_4bit": s.gpu.quantization == "4bit",
        "load_in_8bit": False,
        "full_finetuning": False,
        "use_gradient_checkpointing": ckpt,
        "random_state": s.seed,
        "local_files_only": True,
        "token": None,
    }


def unsloth_peft_kwargs(s: TrainingSettings, ckpt: bool | str) -> dict[str, Any]:
    """``FastLanguageModel.get_peft_model`` arguments (same LoRA shape as the HF backend's LoraConfig)."""
    lora = s.lora
    return {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "use_gradient_checkpointing": ckpt,
        "random_state": s.seed,
        "use_rslora": False,
    }


def hf_load_kwargs(s: TrainingSettings, *, cuda: bool, bf16: bool, local_rank: int = 0) -> dict[str, Any]:
    """``AutoModelForCausalLM.from_pretrained`` arguments; dtype as a name, QLoRA as BitsAndBytesConfig kwargs.

    The caller turns ``dtype`` into ``getattr(torch, name)`` and ``quantization_config`` into
    ``transformers.BitsAndBytesConfig(**kwargs)``.
    """
    dtype = "bfloat16" if cuda and bf16 else "float32"  # fp16 weights would make AMP refuse the fp16 LoRA grads
    out: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
    if s.gpu.quantization == "4bit":
        out["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                      "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": dtype}
        out["device_map"] = {"": local_rank}  # quantized weights cannot be moved after loading
    return out


def hf_model_kwargs(s: TrainingSettings, *, cuda: bool, local_rank: int = 0) -> dict[str, Any]:
    """``AutoModelForCausalLM.from_pretrained`` arguments of the HF backend (:func:`hf_load_kwargs`, bf16 where the GPU
    has it), with torch's dtype and transformers' ``BitsAndBytesConfig``: the nightly run's and the training API's.
    With 4-bit, a ``device_map`` places the weights (they cannot be moved after loading)."""
    import torch
    from transformers import BitsAndBytesConfig

    kw = hf_load_kwargs(s, cuda=cuda, bf16=cuda and torch.cuda.is_bf16_supported(), local_rank=local_rank)
    kw["dtype"] = getattr(torch, kw["dtype"])
    if "quantization_config" in kw:
        kw["quantization_config"] = BitsAndBytesConfig(**kw["quantization_config"])
    return kw


def device_label(cuda: bool) -> str:
    """The device as manifests record it: ``cpu`` or e.g. ``cuda:0 NVIDIA H100 80GB HBM3``."""
    import torch

    return f"cuda:{torch.cuda.current_device()} {torch.cuda.get_device_name()}" if cuda else "cpu"


def sft_batch_kwargs(s: TrainingSettings, plan: BatchPlan, *, has_eval: bool) -> dict[str, Any]:
    """SFTConfig arguments for batch sizes, batching mode and evaluation.

    ``padding_free`` is always explicit: Unsloth turns padding-free on by itself when it is left unset.
    """
    out: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro,
        "gradient_accumulation_steps": plan.accumulation,
        "per_device_eval_batch_size": plan.eval_micro,
    }
    batching = s.gpu.batching
    if batching == "packed":
        out["packing"] = True
    else:
        out.update(packing=False, padding_free=batching == "padding_free")
    if has_eval:
        out.update(eval_strategy="steps", eval_steps=s.save_steps)
    else:
        out["eval_strategy"] = "no"
    return out


def apply_unsloth_env(env: dict[str, str] | None = None) -> None:
    """Set the environment Unsloth must be imported under (``os.environ`` unless ``env`` is given).

    Also gives Unsloth's generated-code cache a private directory (:data:`UNSLOTH_COMPILE_ENV`) when
    none is set, so nothing is written into the working directory.
    """
    target = os.environ if env is None else env
    target.update(UNSLOTH_ENV_SET)
    for name in UNSLOTH_ENV_UNSET:
        target.pop(name, None)
    if not target.get(UNSLOTH_COMPILE_ENV):
        folder = tempfile.mkdtemp(prefix="cvm-tune-unsloth-")
        atexit.register(shutil.rmtree, folder, True)
        target[UNSLOTH_COMPILE_ENV] = folder


def check_triton_toolchain(*, cuda: bool) -> None:
    """On a CUDA run, refuse to start when Triton could not build its kernel launchers (see below).

    Raises:
        TrainingError: naming what is missing.
    """
    if cuda and (problem := triton_toolchain_problem()) is not None:
        raise TrainingError(f"Triton cannot build its GPU kernel launchers: {problem}",
                            fix="install gcc and the Python headers in the image (the GPU Dockerfile checks this), or set CC")


def triton_toolchain_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why Triton could not build its kernel launchers here, or ``None`` when it can (or is not installed).

    On first use each Triton kernel gets a small C launcher, built with ``$CC``, else ``gcc`` or ``clang``
    from ``PATH``, against the interpreter's ``Python.h``. Unsloth's kernels run through Triton, and so
    does TRL 1.15's fused LM head on CUDA: without a compiler the run would fail only at the first
    training step, after the model is loaded.
    """
    env = os.environ if env is None else env
    if importlib.util.find_spec("triton") is None:
        return None
    cc = env.get("CC")
    if cc:
        if shutil.which(cc, path=env.get("PATH")) is None:
            return f"CC={cc} is not an executable"
    elif not any(shutil.which(name, path=env.get("PATH")) for name in ("gcc", "clang")):
        return "no C compiler: CC is unset and neither gcc nor clang is on PATH"
    scheme = sysconfig.get_default_scheme()  # the scheme triton/runtime/build.py asks for
    include = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])
    if not (include / "Python.h").is_file():
        return f"no Python headers: {include / 'Python.h'} is missing"
    return None


def imported_versions(names: Iterable[str]) -> dict[str, str]:
    """Versions of the libraries this process imported: ``module.__version__`` when imported, else metadata.

    The GPU bundle puts its own unsloth (2026.10.9) first on ``PYTHONPATH`` while the ``[gpu]`` extra pins
    2026.10.7: the manifest records what was imported, not what an installer was asked for.
    """
    out: dict[str, str] = {}
    for name in names:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if not isinstance(version, str):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        out[name] = version
    return out


def split_eval(dataset: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """``(train, eval)``: a seeded held-out share of the rows, or ``(dataset, None)`` when fraction is 0.

    Raises:
        TrainingError: the split would leave no train or no eval row.
    """
    if fraction <= 0:
        return dataset, None
    n = len(dataset)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise TrainingError(f"training.eval_fraction {fraction} leaves no train row out of {n}",
                            fix="lower training.eval_fraction or add rows")
    parts = dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (error messages never carry a whole traceback or dataset text)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit] if text else ''}".rstrip(": ")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_base_dir(base: Path, max_length: int) -> None:
    """A complete local model directory (config.json, safetensors) whose context fits ``training.max_length``.

    Raises:
        BaseModelError: missing directory or files, unreadable config.json.
        TrainingError: ``max_length`` beyond the model's context.
    """
    if not base.is_dir():
        raise BaseModelError(f"base model directory {base} does not exist",
                             fix="use base_model.source: tiny-llama, or point base_model.path at a local HF model directory")
    if not (base / "config.json").is_file() or not any((base / w).is_file() for w in WEIGHT_FILES):
        raise BaseModelError(f"base model directory {base} lacks config.json or safetensors weights",
                             fix="restore the complete model directory (config.json, model.safetensors, tokenizer files)")
    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BaseModelError(f"cannot load base model from {base}: config.json: {first_line(exc)}",
                             fix="restore the complete model directory (config.json, model.safetensors, tokenizer files)") from exc
    check_max_length(config, max_length)
