"""What a run needs of its validated rows as a whole: their hash, independent of the file format, and whether
they fit the training objective."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from app.dataset.rows import PREFERENCE
from app.errors import RowError
from attestation.io.hashing import canonical_json

KINDS = {"sft": ("text", "messages"), "dpo": ("preference",)}


def rows_sha256(rows: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of the rows as canonical JSONL: ``canonical_json(row) + "\\n"`` for each row, in order.

    Computed over the validated rows after deduplication (``split`` keys included), so a Parquet, an Arrow and a
    JSONL file of the same rows give the same value; for a JSONL file written in canonical form (sorted keys, no
    spaces, one row a line, no duplicates) it equals the plaintext SHA-256.
    """
    h = hashlib.sha256()
    for row in rows:
        h.update(canonical_json(row))
        h.update(b"\n")
    return h.hexdigest()


def kind(row: Mapping[str, Any]) -> str:
    """``text``, ``messages`` or ``preference`` for a validated row."""
    if any(k in row for k in PREFERENCE):
        return "preference"
    return "messages" if "messages" in row else "text"


def check_objective(rows: Sequence[Mapping[str, Any]], lines: Sequence[int], objective: str, *, source: str,
                    unit: str = "line") -> None:
    """Every row must be of a kind the objective trains on: text or chat rows for ``sft``, preference rows for
    ``dpo``.

    Raises:
        RowError: naming the first row (its line or row number) of another kind, and the count.
    """
    want = KINDS[objective]
    bad = [i for i, row in enumerate(rows) if kind(row) not in want]
    if not bad:
        return
    at = lines[bad[0]] if bad[0] < len(lines) else bad[0] + 1
    what = "a preference row (prompt/chosen/rejected)" if objective == "sft" else "a text or chat row"
    fix = ("set training.objective: dpo for preference rows" if objective == "sft"
           else "give every row prompt, chosen and rejected, or set training.objective: sft")
    raise RowError(f"{source} {unit} {at}: {what}, but training.objective is {objective} "
                   f"({len(bad)} of {len(rows)} rows)", fix=fix)
