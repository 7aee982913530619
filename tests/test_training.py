"""Training package: tiny model, backend selection, LoRA SFT, sealed checkpoints, resume, privacy.

Run: ``python -m pytest tests/test_training.py -q`` (CPU only, nothing downloaded; the tiny model
is built once per session, each training run is a few optimizer steps on 20 rows).
"""

from __future__ import annotations

import os

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
             "UNSLOTH_DISABLE_STATISTICS"):
    os.environ.setdefault(_key, "1")

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from app.config import TrainingSettings  # noqa: E402
from app.errors import BaseModelError, StateError, TrainingError  # noqa: E402
from app.training import (  # noqa: E402
    TrainingInterrupted,
    TrainRequest,
    TrainResult,
    build_tiny_model,
    select_backend,
    train,
)
from app.training.checkpoints import (  # noqa: E402
    ADAPTER_FILES,
    LATEST,
    checkpoint_dirs,
    latest_name,
    restore_checkpoint,
    seal_checkpoint,
)
from app.training.sealed import MANIFEST  # noqa: E402
from attestation.io.hashing import sha256_file, tree_digest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "app" / "data" / "sample.jsonl"
FP = "ab" * 32
OTHER_FP = "cd" * 32
CKPT_KEY = bytes(range(32))  # the pipeline derives it from GetKey; any fixed key resumes across calls
INPUTS = {"config": "11" * 32, "dataset": "22" * 32, "base_model": "33" * 32}
CANARY = "CANARY-q7Zx-4411-plaintext"
# 20 mixed rows, batch 2: 10 steps per epoch, so the 12-step run resumes at step 8 (epoch 0)
# and its final steps run in epoch 1.
SETTINGS = TrainingSettings(max_steps=12, per_device_batch_size=2, gradient_accumulation_steps=1,
                            learning_rate=5e-3, max_length=64, save_steps=4, logging_steps=1)
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _rows(n: int = 20) -> list[dict[str, Any]]:
    with open(SAMPLE, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh][:n]


def _tensors(adapter_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _assert_same_adapter(a: Path, b: Path, atol: float = 1e-5) -> None:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert torch.allclose(ta[name], tb[name], atol=atol, rtol=0), name


def _request(base: Path, run_dir: Path, **kw: Any) -> TrainRequest:
    fields: dict[str, Any] = {"base_model_dir": base, "base_model_name": "cvm-tune/tiny-llama", "rows": _rows(),
                              "run_dir": run_dir, "settings": SETTINGS, "fingerprint": FP,
                              "checkpoint_key": CKPT_KEY, "inputs": INPUTS}
    fields.update(kw)
    return TrainRequest(**fields)


@dataclass
class Baseline:
    result: TrainResult
    logs: list[dict[str, Any]]
    run_dir: Path


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """One uninterrupted 12-step run that several tests compare against."""
    run_dir = tmp_path_factory.mktemp("baseline")
    logs: list[dict[str, Any]] = []
    result = train(_request(tiny_model, run_dir, on_log=logs.append))
    return Baseline(result, logs, run_dir)


def _copy_checkpoints(src_run: Path, dest_run: Path) -> Path:
    shutil.copytree(src_run / "checkpoints", dest_run / "checkpoints")
    return dest_run / "checkpoints"


# --- tiny model ---------------------------------------------------------------------------------------


def test_tiny_model_is_byte_identical_across_processes(tiny_model: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / "tiny"
    code = "import sys; from pathlib import Path; from app.training import build_tiny_model; build_tiny_model(Path(sys.argv[1]))"
    env = {**SUBPROCESS_ENV, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(other)], check=True, env=env, cwd=tmp_path, capture_output=True)
    digest, files = tree_digest(tiny_model)
    assert tree_digest(other) == (digest, files)
    assert sorted(files) == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"]
    assert not [p.name for p in other.parent.iterdir() if p.name.startswith(".tmp-")]


def test_tiny_model_shape_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model, local_files_only=True)
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == ("llama", 64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 4, 256)
    assert cfg.tie_word_embeddings is False and 512 <= cfg.vocab_size <= 1024
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n2 plus 3 is 5.<|im_end|>\n")
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<pad>", "<|endoftext|>")


def test_build_tiny_model_keeps_complete_dir_and_refuses_partial(tiny_model: Path, tmp_path: Path) -> None:
    before = tree_digest(tiny_model)
    build_tiny_model(tiny_model)  # complete: left as is
    assert tree_digest(tiny_model) == before
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(BaseModelError, match="incomplete"):
        build_tiny_model(partial)


# --- backend selection and imports ---------------------------------------------------------------------


def test_select_backend_on_cpu() -> None:
    assert select_backend("auto") == "hf"
    assert select_backend("hf") == "hf"
    with pytest.raises(TrainingError) as err:
        select_backend("unsloth")
    assert "unsloth" in err.value.message and err.value.fix


def test_package_import_is_light() -> None:
    code = ("import sys, app.training, app.training.backend, app.training.checkpoints; "
            "print([m for m in ('torch', 'transformers', 'trl', 'peft', 'datasets', 'unsloth') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=SUBPROCESS_ENV, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


# --- a training run -------------------------------------------------------------------------------------


def test_training_run_loss_adapter_and_metrics(baseline: Baseline, tiny_model: Path) -> None:
    r = baseline.result
    assert (r.backend, r.device, r.global_step, r.resumed_from_step) == ("hf", "cpu", 12, None)
    assert [step for step, _ in r.losses] == list(range(1, 13))
    first, last = [loss for _, loss in r.losses[:2]], [loss for _, loss in r.losses[-2:]]
    assert sum(last) / 2 < sum(first) / 2 - 0.05
    assert r.train_runtime_s > 0 and r.tokens_seen and r.tokens_seen > 0
    assert set(r.library_versions) == {"torch", "transformers", "peft", "trl", "datasets", "accelerate"}
    assert "unsloth" not in sys.modules

    assert r.adapter_dir == baseline.run_dir / "adapter"
    assert sorted(p.name for p in r.adapter_dir.iterdir()) == sorted(ADAPTER_FILES)
    cfg = json.loads((r.adapter_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "cvm-tune/tiny-llama"
    assert cfg["target_modules"] == sorted(SETTINGS.lora.target_modules)
    assert (cfg["r"], cfg["lora_alpha"]) == (SETTINGS.lora.r, SETTINGS.lora.alpha)

    assert [m["step"] for m in baseline.logs] == list(range(1, 13))
    for m in baseline.logs:
        assert set(m) == {"step", "loss", "learning_rate", "grad_norm", "epoch", "elapsed_s", "steps_this_run",
                          "tokens_this_run"}
        assert m["elapsed_s"] > 0 and m["steps_this_run"] == m["step"] and m["tokens_this_run"] > 0
        assert isinstance(m["step"], int) and all(isinstance(m[k], float) for k in ("loss", "learning_rate", "epoch"))
        assert m["grad_norm"] is None or isinstance(m["grad_norm"], float)
    assert [(m["step"], m["loss"]) for m in baseline.logs] == r.losses


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_adapter_loads_and_generates(baseline: Baseline, tiny_model: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    model = PeftModel.from_pretrained(base, baseline.result.adapter_dir).eval()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + 6


def test_two_runs_from_scratch_are_identical(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    again = train(_request(tiny_model, tmp_path))
    for name in ADAPTER_FILES:
        assert sha256_file(again.adapter_dir / name) == sha256_file(baseline.result.adapter_dir / name)
    assert again.losses == baseline.result.losses


# --- checkpoints and resume ------------------------------------------------------------------------------


def _restore(ckpts: Path, tmp: Path, fingerprint: str = FP, key: bytes = CKPT_KEY, inputs: dict | None = None):
    return restore_checkpoint(ckpts, key=key, fingerprint=fingerprint, inputs=inputs or INPUTS, scratch=tmp / "scratch")


def test_checkpoints_are_sealed_encrypted_and_rotated(baseline: Baseline, tmp_path: Path) -> None:
    ckpts = baseline.run_dir / "checkpoints"
    assert [p.name for _, p in checkpoint_dirs(ckpts)] == ["checkpoint-12", "checkpoint-8", "checkpoint-4"]  # keep=3
    assert latest_name(ckpts) == "checkpoint-12" and (ckpts / LATEST).read_text() == "checkpoint-12\n"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]
    sealed = ckpts / "checkpoint-12"
    assert (sealed / MANIFEST).is_file() and all(p.suffix == ".enc" for p in sealed.iterdir())
    # Plaintext never reaches the output volume: no trainer_state JSON, no torch zip, no safetensors header.
    for p in baseline.run_dir.rglob("*"):
        if p.is_file() and p.parent.name != "adapter":
            data = p.read_bytes()
            assert b"log_history" not in data and b"data.pkl" not in data and b"lora_A" not in data, p
    choice = _restore(ckpts, tmp_path)
    assert choice.step == 12 and choice.rejected == []
    restored = {p.name for p in choice.path.iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"} <= restored
    assert json.loads((choice.path / "trainer_state.json").read_text())["global_step"] == 12


def test_interrupted_run_resumes_to_the_same_adapter(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    """Cases 33/38/39: resume in epoch 1 from a sealed checkpoint equals the uninterrupted run."""
    with pytest.raises(TrainingInterrupted):
        train(_request(tiny_model, tmp_path, stop_after_step=8))
    assert not (tmp_path / "adapter").exists()
    assert latest_name(tmp_path / "checkpoints") == "checkpoint-8"
    resumed = train(_request(tiny_model, tmp_path))
    assert (resumed.resumed_from_step, resumed.global_step) == (8, 12)
    assert [s for s, _ in resumed.losses] == list(range(1, 13))  # steps 1-8 restored from the log history
    for (sa, la), (sb, lb) in zip(resumed.losses, baseline.result.losses, strict=True):
        assert sa == sb and la == pytest.approx(lb, abs=1e-5)
    _assert_same_adapter(resumed.adapter_dir, baseline.result.adapter_dir)
    assert resumed.tokens_seen == baseline.result.tokens_seen


def test_checkpoint_from_other_inputs_is_refused_with_a_reason(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    """Case 37: a checkpoint of another config/dataset/base model is refused, naming what differs."""
    _copy_checkpoints(baseline.run_dir, tmp_path)
    events: list[tuple[str, dict]] = []
    other_inputs = {**INPUTS, "dataset": "44" * 32}
    result = train(_request(tiny_model, tmp_path, fingerprint=OTHER_FP, inputs=other_inputs,
                            on_event=lambda t, d: events.append((t, d))))
    assert result.resumed_from_step is None
    assert result.rejected_checkpoints[0] == ("checkpoint-12", "sealed for other inputs (dataset differ)")
    assert ("checkpoint.rejected", {"checkpoint": "checkpoint-12", "reason": "sealed for other inputs (dataset differ)"}) in events
    assert [t for t, _ in events].count("checkpoint") == 3
    _assert_same_adapter(result.adapter_dir, baseline.result.adapter_dir)  # fresh run, same seed
    assert _restore(tmp_path / "checkpoints", tmp_path, fingerprint=OTHER_FP, inputs=other_inputs).step == 12


def test_corrupted_checkpoint_falls_back_to_previous(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    """Case 36: a flipped byte in a sealed blob is detected; resume falls back to checkpoint-8."""
    ckpts = _copy_checkpoints(baseline.run_dir, tmp_path)
    target = max((ckpts / "checkpoint-12").glob("0*.enc"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    result = train(_request(tiny_model, tmp_path))
    assert result.resumed_from_step == 8
    assert result.rejected_checkpoints == [("checkpoint-12", "corrupt (failed authentication)")]
    _assert_same_adapter(result.adapter_dir, baseline.result.adapter_dir)


def test_interrupted_save_is_skipped_and_cleaned(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    """Case 34: a kill mid-save leaves a .tmp- staging dir (ignored, removed) or a dir without manifest."""
    ckpts = _copy_checkpoints(baseline.run_dir, tmp_path)
    (ckpts / "checkpoint-12" / MANIFEST).unlink()
    shutil.copytree(ckpts / "checkpoint-8", ckpts / ".tmp-checkpoint-16-abcd")
    result = train(_request(tiny_model, tmp_path))
    assert result.resumed_from_step == 8
    assert result.rejected_checkpoints == [("checkpoint-12", "no manifest (interrupted save)")]
    assert not list(ckpts.glob(".tmp-*"))
    _assert_same_adapter(result.adapter_dir, baseline.result.adapter_dir)


def test_finished_checkpoint_resumes_without_steps(baseline: Baseline, tiny_model: Path, tmp_path: Path) -> None:
    """Case 39: the adapter after a resume equals the checkpoint's tensors exactly (PEFT is wrapped once)."""
    _copy_checkpoints(baseline.run_dir, tmp_path)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "stale.bin").write_bytes(b"old")
    result = train(_request(tiny_model, tmp_path))
    assert (result.resumed_from_step, result.global_step) == (12, 12)  # HF alone would run a 13th step
    assert (result.losses, result.tokens_seen) == (baseline.result.losses, baseline.result.tokens_seen)
    assert sorted(p.name for p in result.adapter_dir.iterdir()) == sorted(ADAPTER_FILES)
    _assert_same_adapter(result.adapter_dir, baseline.result.adapter_dir, atol=0.0)


def _blobs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name != MANIFEST)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "9999.enc").write_bytes(b"x"), "blobs unexpected: 9999.enc"),
        (lambda d: _blobs(d)[0].unlink(), "blobs missing: 0000.enc"),
        (lambda d: (d / MANIFEST).write_bytes(b"{not a sealed file"), "corrupt (not a sealed file)"),
        (lambda d: (d / MANIFEST).unlink(), "no manifest (interrupted save)"),
        (lambda d: shutil.copyfile(_blobs(d)[0], _blobs(d)[1]), "0001.enc belongs to another file or step"),
    ],
)
def test_restore_checkpoint_reasons(tmp_path: Path, damage: Callable[[Path], object], reason: str) -> None:
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4):
        src = tmp_path / f"plain-{step}"
        src.mkdir()
        for name in ("optimizer.pt", "trainer_state.json", "adapter_model.safetensors"):
            (src / name).write_bytes(f"{name}-{step}".encode() * 100)
        seal_checkpoint(src, ckpts, key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=step, keep=3)
    (ckpts / "checkpoint-x").mkdir()  # not a checkpoint name: ignored
    damage(ckpts / "checkpoint-4")
    choice = _restore(ckpts, tmp_path)
    assert (choice.step, choice.rejected) == (2, [("checkpoint-4", reason)])
    assert (choice.path / "optimizer.pt").read_bytes() == b"optimizer.pt-2" * 100
    assert latest_name(ckpts) == "checkpoint-2"  # LATEST follows the fallback


def test_restore_refuses_other_key_and_inputs(tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    for name in ("trainer_state.json", "adapter_model.safetensors"):
        (src / name).write_bytes(b"x" * 10)
    seal_checkpoint(src, tmp_path / "a", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=3, keep=3)
    assert _restore(tmp_path / "a", tmp_path, key=b"\x07" * 32).rejected == [
        ("checkpoint-3", "sealed with another key (other app id)")]
    seal_checkpoint(src, tmp_path / "b", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=3, keep=3)
    other = {**INPUTS, "config": "55" * 32, "base_model": "66" * 32}
    assert _restore(tmp_path / "b", tmp_path, fingerprint=OTHER_FP, inputs=other).rejected == [
        ("checkpoint-3", "sealed for other inputs (base_model, config differ)")]


def test_complete_checkpoint_newer_than_latest_is_resumed(tmp_path: Path) -> None:
    """Case 34: killed after checkpoint-4's rename but before LATEST moved: checkpoint-4 is complete and used."""
    src = tmp_path / "plain"
    src.mkdir()
    for name in ("trainer_state.json", "adapter_model.safetensors"):
        (src / name).write_bytes(b"y" * 10)
    for step in (2, 4):
        seal_checkpoint(src, tmp_path / "c", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=step, keep=3)
    (tmp_path / "c" / LATEST).write_text("checkpoint-2\n")
    assert _restore(tmp_path / "c", tmp_path).step == 4 and latest_name(tmp_path / "c") == "checkpoint-4"


def test_disk_full_while_sealing_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 35: ENOSPC mid-seal: StateError, no partial directory, LATEST not moved, previous intact."""
    import errno

    import app.training.sealed as C  # the blob writer seal_checkpoint uses

    src = tmp_path / "plain"
    src.mkdir()
    for name in ("trainer_state.json", "adapter_model.safetensors", "optimizer.pt"):
        (src / name).write_bytes(os.urandom(5000))
    ckpts = tmp_path / "checkpoints"
    seal_checkpoint(src, ckpts, key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=4, keep=3)
    before = {p.name: p.read_bytes() for p in (ckpts / "checkpoint-4").iterdir()}
    real, calls = C.encrypt_stream, []

    def full_disk(src_fh, dst_fh, *a, **kw):  # the third file write hits a full disk
        calls.append(1)
        if len(calls) == 3:
            dst_fh.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src_fh, dst_fh, *a, **kw)

    monkeypatch.setattr(C, "encrypt_stream", full_disk)
    with pytest.raises(StateError, match="No space left on device"):
        seal_checkpoint(src, ckpts, key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, step=8, keep=3)
    assert sorted(p.name for p in ckpts.iterdir()) == ["LATEST", "checkpoint-4"]
    assert latest_name(ckpts) == "checkpoint-4"
    assert {p.name: p.read_bytes() for p in (ckpts / "checkpoint-4").iterdir()} == before


# --- rows and errors ----------------------------------------------------------------------------------------


def test_dataset_formats(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from app.training.sft_data import build_dataset

    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    mixed = build_dataset([chat, {"text": "plain note"}], tok, assistant_only_loss=False)
    assert mixed.column_names == ["text"] and mixed.cache_files == []
    assert mixed[0]["text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>"
    assert mixed[1]["text"] == "plain note" + tok.eos_token  # EOS here, not left to TRL (Unsloth's prep adds none)
    assert build_dataset([chat], tok, assistant_only_loss=True).column_names == ["messages"]
    text_only = build_dataset([{"text": "a"}, {"text": "b" + tok.eos_token}], tok, assistant_only_loss=False)
    assert text_only.column_names == ["text"] and text_only["text"] == ["a" + tok.eos_token, "b" + tok.eos_token]
    with pytest.raises(TrainingError, match="1 of 2 rows are text rows"):
        build_dataset([chat, {"text": "plain note"}], tok, assistant_only_loss=True)
    with pytest.raises(TrainingError) as err:
        build_dataset([chat, {"messages": CANARY}], tok, assistant_only_loss=False)
    assert "row 1" in err.value.message and CANARY not in err.value.message


def test_trl_trains_text_rows_with_one_eos_and_the_explicit_optimizer(tiny_model: Path, tmp_path: Path) -> None:
    """What the trainer tokenized: EOS once (TRL adds none on top of build_dataset's); AdamW without weight decay."""
    from app.training import backend as B
    from app.training.sft_data import build_dataset
    from app.training.batch import BatchPlan

    req = _request(tiny_model, tmp_path)
    model, tok, peft_config = B._load_hf(req, False)
    ds = build_dataset([{"text": "plain note"}, {"text": "done" + tok.eos_token}], tok, assistant_only_loss=False)
    sealing = {"key": CKPT_KEY, "inputs": INPUTS, "root": tmp_path / "checkpoints"}
    trainer = B._make_trainer(req, model, tok, peft_config, ds, None, tmp_path / "scratch", cuda=False, backend="hf",
                              plan=BatchPlan(1, 1, 3), world=1, sealing=sealing)
    first, second = (trainer.train_dataset[i]["input_ids"] for i in (0, 1))
    assert first == tok(text="plain note" + tok.eos_token)["input_ids"] and first.count(tok.eos_token_id) == 1
    assert second[-1] == tok.eos_token_id and second.count(tok.eos_token_id) == 1
    args = trainer.args
    assert (str(getattr(args.optim, "value", args.optim)), args.weight_decay, args.warmup_steps) == ("adamw_torch_fused", 0.0, 0)
    assert args.per_device_eval_batch_size == 3


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_export_resets_unsloths_auto_mapping_only(tiny_model: Path, tmp_path: Path) -> None:
    """Unsloth's get_peft_model adds auto_mapping {..., unsloth_fixed: true}; the exported config is PEFT's own."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from app.training.checkpoints import export_adapter

    def exported(auto_mapping: dict[str, Any] | None, name: str) -> dict[str, Any]:
        base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
        model.peft_config["default"].auto_mapping = auto_mapping
        return json.loads((export_adapter(model, tmp_path / name, "tiny") / "adapter_config.json").read_text())

    unsloth = {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama.modeling_llama",
               "unsloth_fixed": True}
    plain = exported(None, "plain")
    assert exported(unsloth, "unsloth") == plain and plain["auto_mapping"] is None
    custom = {"base_model_class": "MyModel", "parent_library": "my_models"}  # a custom class needs it: kept
    assert exported(custom, "custom")["auto_mapping"] == custom


def test_max_length_beyond_the_base_models_positions_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    limit = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(TrainingError, match=f"exceeds the base model's max_position_embeddings {limit}"):
        train(_request(tiny_model, tmp_path, settings=SETTINGS.model_copy(update={"max_length": limit + 1})))
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "checkpoints").exists()


def test_assistant_only_loss_trains_on_chat_rows(tiny_model: Path, tmp_path: Path) -> None:
    rows = [r for r in _rows(40) if "messages" in r][:8]
    settings = SETTINGS.model_copy(update={"assistant_only_loss": True, "max_steps": 2})
    result = train(_request(tiny_model, tmp_path, rows=rows, settings=settings))
    assert result.global_step == 2 and all(loss > 0 for _, loss in result.losses)


def test_zero_trainable_tokens_is_a_training_error(tiny_model: Path, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}]
    settings = SETTINGS.model_copy(update={"assistant_only_loss": True, "max_length": 8})
    with pytest.raises(TrainingError, match="zero trainable tokens"):
        train(_request(tiny_model, tmp_path, rows=rows, settings=settings))


def test_exception_inside_training_is_wrapped(tiny_model: Path, tmp_path: Path) -> None:
    def boom(_metrics: dict[str, Any]) -> None:
        raise ValueError("callback exploded\nsecond line")

    with pytest.raises(TrainingError) as err:
        train(_request(tiny_model, tmp_path, on_log=boom, settings=SETTINGS.model_copy(update={"max_steps": 1})))
    assert err.value.message == "training failed: ValueError: callback exploded"
    assert isinstance(err.value.__cause__, ValueError)


def test_request_checks(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="fingerprint"):
        train(_request(tiny_model, tmp_path, fingerprint="not-hex"))
    with pytest.raises(TrainingError, match="absolute path"):
        train(_request(tiny_model, tmp_path, base_model_name=str(tiny_model)))


def test_missing_base_model_dir(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="does not exist") as err:
        train(_request(tmp_path / "nope", tmp_path / "run"))
    assert str(tmp_path / "nope") in err.value.message and err.value.fix


def test_garbled_base_model_dir(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text("{ this is not json")
    with pytest.raises(BaseModelError, match="cannot load base model"):
        train(_request(broken, tmp_path / "run"))


# --- privacy --------------------------------------------------------------------------------------------------

_CANARY_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO)
    import transformers
    transformers.logging.set_verbosity_info()
    from app.config import TrainingSettings
    from app.training import TrainRequest, train
    base, run_dir, rows = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    settings = TrainingSettings(max_steps=2, per_device_batch_size=2, gradient_accumulation_steps=1,
                                max_length=64, save_steps=1, logging_steps=1)
    logs = []
    train(TrainRequest(base_model_dir=base, base_model_name="tiny", rows=rows, run_dir=run_dir,
                       settings=settings, fingerprint="ef" * 32, on_log=logs.append))
    print(json.dumps(logs))
""")


def test_no_plaintext_on_disk_and_no_hf_cache(tiny_model: Path, tmp_path: Path) -> None:
    rows = _rows(6) + [
        {"messages": [{"role": "user", "content": f"secret {CANARY}?"}, {"role": "assistant", "content": CANARY}]},
        {"text": f"note {CANARY}"},
    ]
    dirs = {name: tmp_path / name for name in ("hf_home", "hf_datasets", "xdg", "tmp", "run")}
    for d in dirs.values():
        d.mkdir()
    env = {**SUBPROCESS_ENV, "HF_HOME": str(dirs["hf_home"]), "HF_DATASETS_CACHE": str(dirs["hf_datasets"]),
           "XDG_CACHE_HOME": str(dirs["xdg"]), "TMPDIR": str(dirs["tmp"])}
    proc = subprocess.run([sys.executable, "-c", _CANARY_SCRIPT, str(tiny_model), str(dirs["run"]), json.dumps(rows)],
                          env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert CANARY not in proc.stdout and CANARY not in proc.stderr  # logs carry metrics only
    assert (dirs["run"] / "adapter" / "adapter_model.safetensors").is_file()
    assert not [p for d in ("hf_home", "hf_datasets") for p in dirs[d].rglob("*") if p.is_file()]
    needle = CANARY.encode()
    for d in dirs.values():
        for p in d.rglob("*"):
            if p.is_file():
                assert needle not in p.read_bytes(), p


# --- loss watchdog (case 26) ------------------------------------------------------------------------------------


def test_loss_watchdog_detector() -> None:
    from app.config import LossWatchdogSettings
    from app.training.watchdog import LossWatchdog

    dog = LossWatchdog(LossWatchdogSettings(spike_factor=3.0, window=4, patience=2))
    assert [dog.check(s, v) for s, v in enumerate([5.0, 4.8, 4.7, 4.9], 1)] == [None] * 4
    assert dog.check(5, 20.0) is None and dog.suspicious  # one spike: wait, but seal nothing
    assert dog.check(6, 4.6) is None and not dog.suspicious  # recovered
    assert dog.check(7, 30.0) is None
    assert "spiked to 31 at step 8" in dog.check(8, 31.0)
    assert LossWatchdog(LossWatchdogSettings()).check(1, float("nan")) == "loss is nan at step 1"
    assert LossWatchdog(LossWatchdogSettings()).check(1, 5.0, float("inf")) == "gradient norm is inf at step 1"
    assert LossWatchdog(LossWatchdogSettings(enabled=False)).check(1, float("inf")) is None


def _poisoned_copy(tiny_model: Path, dest: Path) -> Path:
    """The tiny model with infinite embeddings: the real forward pass yields a NaN loss."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, dest)
    weights = load_file(str(dest / "model.safetensors"))
    name = next(k for k in weights if "embed_tokens" in k)
    weights[name] = weights[name] * float("inf")
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_case26_diverging_run_aborts_keeps_last_good_checkpoint_and_exports_nothing(
        tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingInterrupted):  # a good run up to its checkpoint at step 4
        train(_request(tiny_model, tmp_path / "run", stop_after_step=4))
    poisoned = _poisoned_copy(tiny_model, tmp_path / "poisoned")
    with pytest.raises(TrainingError) as err:  # the same run continues and its loss turns NaN at step 5
        train(_request(poisoned, tmp_path / "run"))
    assert type(err.value).__name__ == "LossDiverged"
    assert err.value.message == "loss watchdog: loss is nan at step 5; aborted, nothing exported"
    assert not (tmp_path / "run" / "adapter").exists()
    assert [s for s, _ in checkpoint_dirs(tmp_path / "run" / "checkpoints")] == [4]
    assert latest_name(tmp_path / "run" / "checkpoints") == "checkpoint-4"
    assert _restore(tmp_path / "run" / "checkpoints", tmp_path).step == 4  # the last good one, intact
