"""Step 3 of a training run: validated rows -> the in-memory dataset TRL trains on (no cache files, nothing on disk)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.errors import TrainingError


def build_dataset(rows: Sequence[Mapping[str, Any]], tok: Any, *, assistant_only_loss: bool) -> Any:
    """An in-memory ``datasets.Dataset`` in a format TRL trains natively.

    All-chat rows stay conversational (``messages``; TRL applies the chat template, and
    ``assistant_only_loss`` masks everything but the ``{% generation %}`` spans). All-text rows stay
    ``text``, each ending with the EOS token: TRL appends it when missing, but Unsloth replaces TRL's
    dataset preparation with one that does not, so it is appended here for both backends (TRL then
    adds nothing). Mixed rows need one schema, so chat rows are rendered with the tokenizer's chat
    template into ``text`` (the trailing newline after the final end-of-turn is dropped so that the
    text ends with EOS); the token ids match TRL's own rendering.

    Args:
        rows: Validated rows.
        tok: The tokenizer (its chat template renders chat rows in the mixed case).
        assistant_only_loss: Must only be set when every row is a chat row.

    Returns:
        ``datasets.Dataset`` held in memory (no cache files).

    Raises:
        TrainingError: no rows, a malformed row (index only, no content), or
            ``assistant_only_loss`` with text rows.
    """
    from datasets import Dataset

    if not rows:
        raise TrainingError("no rows to train on", fix="provide a dataset with at least one row")
    chats: list[list[dict[str, str]] | None] = []
    for i, row in enumerate(rows):
        messages, text = row.get("messages"), row.get("text")
        if isinstance(text, str) and messages is None:
            chats.append(None)
        elif isinstance(messages, list) and messages and text is None and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            chats.append([{"role": m["role"], "content": m["content"]} for m in messages])
        else:
            raise TrainingError(f"row {i} is neither a chat row nor a text row", fix="validate the dataset first")
        if assistant_only_loss and chats[-1] is not None and not any(m["role"] == "assistant" for m in chats[-1]):
            raise TrainingError(f"row {i} has no assistant message: nothing to train on with assistant_only_loss",
                                fix="remove the row or set training.assistant_only_loss: false")
    n_chat = sum(c is not None for c in chats)
    if assistant_only_loss and n_chat < len(rows):
        raise TrainingError(
            f"training.assistant_only_loss needs chat rows only, but {len(rows) - n_chat} of {len(rows)} rows are text rows",
            fix="set training.assistant_only_loss: false or remove the text rows",
        )
    if n_chat == len(rows):
        return Dataset.from_list([{"messages": c} for c in chats])
    eos = tok.eos_token

    def with_eos(text: str) -> str:
        return text if text.endswith(eos) else text + eos

    if n_chat == 0:
        return Dataset.from_list([{"text": with_eos(row["text"])} for row in rows])
    eos_nl = f"{eos}\n"
    records = []
    for row, chat in zip(rows, chats, strict=True):
        if chat is None:
            records.append({"text": with_eos(row["text"])})
            continue
        rendered = tok.apply_chat_template(chat, tokenize=False)
        records.append({"text": with_eos(rendered[:-1] if rendered.endswith(eos_nl) else rendered)})
    return Dataset.from_list(records)


def sft_dataset(rows: Sequence[Mapping[str, Any]], tokenized: Sequence[Mapping[str, Sequence[int]]] | None, tok: Any,
                *, assistant_only_loss: bool, backend: str) -> Any:
    """The dataset handed to TRL: the token stage's ids when given (``hf``), else :func:`build_dataset`."""
    pre = _pretokenized(rows, tokenized, backend=backend)
    return pre if pre is not None else build_dataset(rows, tok, assistant_only_loss=assistant_only_loss)


def _pretokenized(rows: Sequence[Mapping[str, Any]], tokenized: Sequence[Mapping[str, Sequence[int]]] | None, *,
                  backend: str) -> Any:
    """The token stage's ids as a ``datasets.Dataset`` TRL trains on as is, or ``None`` to let TRL tokenize ``rows``.

    TRL's SFT preparation skips its tokenization when the dataset has ``input_ids``; it still builds
    the labels (from ``assistant_masks``), truncates to ``max_length`` and drops rows without a
    trainable token, so the ids, labels and losses are those of its own tokenization, computed once.
    Unsloth replaces TRL's preparation with its own, whose handling of token ids and assistant masks
    is not TRL's: it always gets the rows (``None`` here).

    Raises:
        TrainingError: ``tokenized`` does not line up with ``rows``.
    """
    if tokenized is None or backend != "hf":
        return None
    if len(tokenized) != len(rows):
        raise TrainingError(f"{len(tokenized)} tokenized rows for {len(rows)} rows",
                            fix="pass the token stage's ids for exactly the rows it kept")
    from datasets import Dataset

    columns = ("input_ids", "assistant_masks") if tokenized and "assistant_masks" in tokenized[0] else ("input_ids",)
    return Dataset.from_dict({c: [list(t[c]) for t in tokenized] for c in columns})


def is_pretokenized(dataset: Any) -> bool:
    """Whether TRL will take ``dataset`` as already tokenized (then ``assistant_only_loss`` must not be passed
    to ``SFTConfig``: TRL refuses it for a non-conversational dataset; the ``assistant_masks`` column
    masks the labels either way)."""
    return "input_ids" in dataset.column_names
