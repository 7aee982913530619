"""Local stand-ins for the Hub datasets the cookbook's recipes load (tests/test_cookbook.py): a directory named like
the Hub dataset, holding JSON-lines splits and a dataset card whose ``configs`` name them, which
``datasets.load_dataset(NAME[, CONFIG])`` reads when run from the directory that holds it (a local directory of that
name comes before the Hub). A few rows each, in the recipes' own columns: questions whose answer is 3,
``\\boxed{3}`` in the chats and ``#### 3`` in GSM8K's answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's question suffix
QUESTIONS = [f"Tom has {a} apples and eats {a - 3}. How many are left?" for a in range(4, 12)]


def _dataset(root: Path, name: str, config: str, splits: dict[str, list[dict[str, Any]]]) -> None:
    d = root / name
    files = []
    for split, rows in splits.items():
        f = d / config / f"{split}.jsonl"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(f"  - split: {split}\n    path: {config}/{split}.jsonl\n")
    (d / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{''.join(files)}---\n")


def chats(n: int = len(QUESTIONS)) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": q + SUFFIX}, {"role": "assistant", "content": "\\boxed{3}"}]}
            for q in QUESTIONS[:n]]


def write(root: Path) -> Path:
    """The stand-ins under ``root`` (the recipes' working directory); returns ``root``."""
    _dataset(root, "HuggingFaceH4/no_robots", "default", {"train": chats(), "test": chats(2)})
    gsm = [{"question": q, "answer": "Eat them.\n#### 3"} for q in QUESTIONS]
    _dataset(root, "openai/gsm8k", "main", {"train": gsm[:2], "test": gsm[2:4]})

    def hh(q: str, answer: str) -> str:
        return f"\n\nHuman: {q}\n\nAssistant: {answer}"

    pairs = [{"chosen": hh(q, "\\boxed{3}"), "rejected": hh(q, "Seven, I think.")} for q in QUESTIONS]
    _dataset(root, "Anthropic/hh-rlhf", "default", {"train": pairs[:4], "test": pairs[4:6]})
    (root / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats(4)))
    return root
