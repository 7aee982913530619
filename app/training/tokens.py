"""Token budget: the too-long policy and the zero-trainable-token check, before any training step.

Every row is tokenized with the base model's tokenizer the way TRL's ``SFTTrainer`` will tokenize
it: rows rendered by :func:`app.training.sft_data.build_dataset` (chat rows through the chat
template, with assistant masks when ``assistant_only_loss``; text rows with EOS appended), labels
= all tokens or the assistant tokens, truncation to the first ``max_length`` tokens. Then:

* ``too_long: truncate``: rows longer than ``max_length`` are kept and counted (TRL keeps their
  first ``max_length`` tokens); ``too_long: drop``: they are removed and counted;
* rows left without a trainable token (a prompt that fills ``max_length``, no assistant tokens)
  are removed and counted, where TRL would drop them silently or fail;
* nothing left: :class:`~app.errors.AllRowsFilteredError` with the count per reason; rows left
  but no trainable token at all: :class:`~app.errors.ZeroTrainableTokensError`.

Counts only, never content. The counts go to the run's manifest (``dataset.validation``).

:func:`tokenize_rows` also returns the token ids of the kept rows (untruncated, with the assistant
masks when ``assistant_only_loss``): the ``hf`` backend hands them to TRL, which then builds the
labels, truncates and trains without tokenizing the rows a second time (``app.training.sft_data``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from app.errors import AllRowsFilteredError, BaseModelError, ZeroTrainableTokensError

TooLong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class TokenReport:
    """What the policy did (row and token counts)."""

    max_length: int
    rows_in: int
    too_long: int  # rows longer than max_length
    truncated: int  # kept and truncated (policy truncate)
    dropped_too_long: int  # policy drop
    dropped_no_trainable: int  # no token contributes to the loss
    rows_out: int
    tokens: int  # tokens of the kept rows after truncation
    trainable_tokens: int
    too_long_lines: tuple[int, ...] = ()  # line numbers (when given) of the rows over max_length
    no_trainable_lines: tuple[int, ...] = ()  # ... and of the rows dropped without a trainable token

    def counts(self) -> dict[str, int]:
        """The counts (for the manifest), without the line lists."""
        return {k: v for k, v in asdict(self).items() if isinstance(v, int)}


def apply_token_policy(rows: Sequence[Mapping[str, Any]], *, base_model_dir: Path, max_length: int,
                       assistant_only_loss: bool, too_long: TooLong,
                       lines: Sequence[int] | None = None) -> tuple[list[Mapping[str, Any]], TokenReport]:
    """Apply the policy (module docstring) and return the rows to train on, in their order.

    ``lines`` (the source line of each row) only labels the report. Raises as :func:`tokenize_rows`.
    """
    keep, _, report = tokenize_rows(rows, base_model_dir=base_model_dir, max_length=max_length,
                                    assistant_only_loss=assistant_only_loss, too_long=too_long, lines=lines)
    return keep, report


def tokenize_rows(rows: Sequence[Mapping[str, Any]], *, base_model_dir: Path, max_length: int,
                  assistant_only_loss: bool, too_long: TooLong, lines: Sequence[int] | None = None,
                  ) -> tuple[list[Mapping[str, Any]], list[dict[str, list[int]]], TokenReport]:
    """:func:`apply_token_policy`, plus the token ids of each kept row (aligned with the kept rows).

    Each entry is ``{"input_ids": [...]}`` (+ ``"assistant_masks"`` when ``assistant_only_loss``),
    before truncation, exactly as TRL's SFT preprocessing tokenizes the row.

    Raises:
        BaseModelError: the tokenizer cannot be loaded from ``base_model_dir``.
        AllRowsFilteredError: no row is left.
        ZeroTrainableTokensError: rows are left but none has a trainable token.
        TrainingError: rows the trainer could not take at all (``build_dataset``).
    """
    from app.training import set_offline_env

    set_offline_env()
    from transformers import AutoTokenizer

    from app.training.sft_data import build_dataset

    try:
        tok = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure: the message names the type only
        raise BaseModelError(f"cannot load the tokenizer from {base_model_dir}: {type(exc).__name__}") from None
    keep: list[Mapping[str, Any]] = []
    encoded: list[dict[str, list[int]]] = []
    long_at: list[int] = []
    zero_at: list[int] = []
    truncated = tokens = trainable = 0
    records = build_dataset(rows, tok, assistant_only_loss=assistant_only_loss)
    for i, (row, rec) in enumerate(zip(rows, records, strict=True)):
        ids, mask = _tokenize(tok, rec, assistant_only_loss)
        line = lines[i] if lines is not None else i + 1
        if len(ids) > max_length:
            long_at.append(line)
            if too_long == "drop":
                continue
        kept = min(len(ids), max_length)
        row_trainable = sum(mask[:max_length]) if mask is not None else kept
        if row_trainable == 0:
            zero_at.append(line)
            continue
        truncated += len(ids) > max_length
        tokens += kept
        trainable += row_trainable
        keep.append(row)
        encoded.append({"input_ids": ids} if mask is None else {"input_ids": ids, "assistant_masks": mask})
    dropped_long, dropped_zero = (len(long_at) if too_long == "drop" else 0), len(zero_at)
    report = TokenReport(max_length=max_length, rows_in=len(rows), too_long=len(long_at), truncated=truncated,
                         dropped_too_long=dropped_long, dropped_no_trainable=dropped_zero, rows_out=len(keep),
                         tokens=tokens, trainable_tokens=trainable, too_long_lines=tuple(long_at),
                         no_trainable_lines=tuple(zero_at))
    if not keep:
        cls = ZeroTrainableTokensError if dropped_zero == len(rows) else AllRowsFilteredError
        raise cls(f"no row left to train on: of {len(rows)} rows, {dropped_long} longer than max_length "
                  f"({max_length} tokens) were dropped and {dropped_zero} had zero trainable tokens")
    return keep, encoded, report


def _tokenize(tok: Any, rec: Mapping[str, Any], assistant_only_loss: bool) -> tuple[list[int], list[int] | None]:
    """Token ids and (assistant_only_loss) the assistant mask, as TRL's SFT preprocessing computes them."""
    messages = rec.get("messages")
    if messages is not None:
        out = tok.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=assistant_only_loss)
        return list(out["input_ids"]), list(out["assistant_masks"]) if assistant_only_loss else None
    return list(tok(text=rec["text"])["input_ids"]), None  # build_dataset ended every text row with EOS
