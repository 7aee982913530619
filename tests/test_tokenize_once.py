"""Tokenize once: the token stage's ids go to TRL as is; same ids, labels and losses as TRL's own tokenization.

Run: ``python -m pytest tests/test_tokenize_once.py -q`` (CPU, tiny model built locally, a few seconds of training).
"""

from __future__ import annotations

import os

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_key, "1")

import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from app.config import TrainingSettings  # noqa: E402
from app.errors import TrainingError  # noqa: E402
from app.training import TrainRequest, build_tiny_model, train  # noqa: E402
from app.training.tokens import apply_token_policy, tokenize_rows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "app" / "data" / "sample.jsonl"
FP = "ab" * 32
KEY = bytes(range(32))
SETTINGS = TrainingSettings(max_steps=4, per_device_batch_size=2, gradient_accumulation_steps=1, learning_rate=5e-3,
                            max_length=48, save_steps=100, logging_steps=1)


def _rows(kind: str) -> list[dict[str, Any]]:
    with open(SAMPLE, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    chats = [r for r in rows if "messages" in r]
    if kind == "chat":
        return chats[:10]
    if kind == "text":
        return [r for r in rows if "text" in r][:10]
    return rows[:12]  # mixed


def _settings(assistant_only: bool) -> TrainingSettings:
    return SETTINGS.model_copy(update={"assistant_only_loss": assistant_only})


def _request(base: Path, run_dir: Path, rows: list[dict[str, Any]], settings: TrainingSettings,
             tokenized: Any = None) -> TrainRequest:
    return TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=rows, run_dir=run_dir,
                        settings=settings, fingerprint=FP, checkpoint_key=KEY, tokenized=tokenized)


def _policy(base: Path, rows: list[dict[str, Any]], settings: TrainingSettings) -> tuple[list[Any], list[Any]]:
    kept, ids, _ = tokenize_rows(rows, base_model_dir=base, max_length=settings.max_length,
                                 assistant_only_loss=settings.assistant_only_loss, too_long="truncate")
    return kept, ids


@pytest.fixture
def tokenizer_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts every tokenization of a row (``tok(text=...)`` and ``apply_chat_template(tokenize=True)``)."""
    from transformers import PreTrainedTokenizerBase

    calls = {"n": 0, "in_chat": 0}
    call, chat = PreTrainedTokenizerBase.__call__, PreTrainedTokenizerBase.apply_chat_template

    def counted_call(self: Any, *a: Any, **kw: Any) -> Any:
        calls["n"] += not calls["in_chat"]  # apply_chat_template(tokenize=True) calls it: counted there
        return call(self, *a, **kw)

    def counted_chat(self: Any, *a: Any, **kw: Any) -> Any:
        calls["n"] += bool(kw.get("tokenize", True))
        calls["in_chat"] += 1
        try:
            return chat(self, *a, **kw)
        finally:
            calls["in_chat"] -= 1

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counted_call)
    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", counted_chat)
    yield calls


def _trainer(base: Path, tmp: Path, rows: list[dict[str, Any]], settings: TrainingSettings, tokenized: Any) -> Any:
    from app.training import backend as B
    from app.training.batch import BatchPlan
    from app.training.sft_data import sft_dataset

    req = _request(base, tmp, rows, settings, tokenized)
    model, tok, peft_config = B._load_hf(req, False)
    data = sft_dataset(rows, tokenized, tok, assistant_only_loss=settings.assistant_only_loss, backend="hf")
    sealing = {"key": KEY, "inputs": {"fingerprint": FP}, "root": tmp / "checkpoints"}
    return B._make_trainer(req, model, tok, peft_config, data, None, tmp / "scratch", cuda=False, backend="hf",
                           plan=BatchPlan(2, 1, 2), world=1, sealing=sealing)


@pytest.mark.parametrize(("kind", "assistant_only"), [("chat", True), ("chat", False), ("text", False),
                                                      ("mixed", False)])
def test_trl_prepares_the_same_ids_and_labels(tiny_model: Path, tmp_path: Path, kind: str,
                                              assistant_only: bool) -> None:
    """TRL's preparation of the token stage's ids equals its own tokenization of the rows (truncation included)."""
    settings = _settings(assistant_only)
    longest = max(len(t["input_ids"]) for t in _policy(tiny_model, _rows(kind), settings)[1])
    settings = settings.model_copy(update={"max_length": longest - 2})  # the longest row is truncated
    rows, ids = _policy(tiny_model, _rows(kind), settings)
    own = _trainer(tiny_model, tmp_path / "own", rows, settings, None).train_dataset
    handed = _trainer(tiny_model, tmp_path / "handed", rows, settings, ids).train_dataset
    assert len(own) == len(handed) == len(rows)
    assert handed["input_ids"] == own["input_ids"] and handed["labels"] == own["labels"]
    assert any(len(i) == settings.max_length for i in own["input_ids"])  # truncation is exercised
    if assistant_only:
        assert any(-100 in labels for labels in own["labels"])  # the prompt tokens are masked in both


def test_rows_are_tokenized_once(tiny_model: Path, tmp_path: Path, tokenizer_calls: dict[str, int]) -> None:
    """The token stage tokenizes each row once; TRL, handed its ids, tokenizes none (and would, handed the rows)."""
    settings = _settings(True)
    rows = _rows("chat")
    kept, ids = _policy(tiny_model, rows, settings)
    assert tokenizer_calls["n"] == len(rows) == len(kept)
    tokenizer_calls["n"] = 0
    _trainer(tiny_model, tmp_path / "handed", kept, settings, ids)
    assert tokenizer_calls["n"] == 0
    _trainer(tiny_model, tmp_path / "own", kept, settings, None)
    assert tokenizer_calls["n"] >= len(kept)  # the counter sees TRL's own tokenization


@pytest.mark.parametrize("kind", ["chat", "mixed"])
def test_short_run_losses_identical(tiny_model: Path, tmp_path: Path, kind: str) -> None:
    """A 4-step run on the handed ids logs exactly the losses (and tokens seen) of a run where TRL tokenizes."""
    settings = _settings(kind == "chat")
    rows, ids = _policy(tiny_model, _rows(kind), settings)
    own = train(_request(tiny_model, tmp_path / "own", rows, settings))
    handed = train(_request(tiny_model, tmp_path / "handed", rows, settings, ids))
    assert len(own.losses) == settings.max_steps
    assert handed.losses == own.losses and handed.tokens_seen == own.tokens_seen
    assert (tmp_path / "handed" / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "own" / "adapter" / "adapter_model.safetensors").read_bytes()


def test_misaligned_ids_are_refused_before_training(tiny_model: Path, tmp_path: Path) -> None:
    settings = _settings(False)
    rows, ids = _policy(tiny_model, _rows("text"), settings)
    with pytest.raises(TrainingError, match="9 tokenized rows for 10 rows"):
        train(_request(tiny_model, tmp_path, rows, settings, ids[:-1]))
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "checkpoints").exists()


def test_apply_token_policy_keeps_its_answer(tiny_model: Path) -> None:
    """The ids come on top: apply_token_policy returns the same rows and counts as tokenize_rows."""
    settings = _settings(True)
    rows = _rows("chat")
    kept, report = apply_token_policy(rows, base_model_dir=tiny_model, max_length=settings.max_length,
                                      assistant_only_loss=True, too_long="drop")
    kept2, ids, report2 = tokenize_rows(rows, base_model_dir=tiny_model, max_length=settings.max_length,
                                        assistant_only_loss=True, too_long="drop")
    assert (kept, report) == (kept2, report2) and len(ids) == len(kept)
    assert all(len(t["input_ids"]) == len(t["assistant_masks"]) <= settings.max_length for t in ids)


def test_a_run_tokenizes_each_row_once(tmp_path: Path, tokenizer_calls: dict[str, int]) -> None:
    """``cvm-tune run``: the token stage tokenizes every row, the training step none again."""
    from app.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 0
    manifest = json.loads((tmp_path / "out" / "exports" / "r1" / "manifest.json").read_text())
    rows = manifest["dataset"]["validation"]["rows_in"]
    assert rows > 100 and tokenizer_calls["n"] == rows
