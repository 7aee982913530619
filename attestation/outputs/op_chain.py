"""The op chain of a training-API checkpoint: a SHA-256 hash chain over every ``forward_backward`` and
``optim_step`` applied to one model, in order (docs/verifier-spec.md, "API checkpoints and the op chain").

A client that kept what it sent recomputes the head from a JSONL file, one op per line, plain JSON numbers::

    {"op": "forward_backward", "loss_fn": "cross_entropy",
     "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1, 1, 1]}}]}
    {"op": "optim_step", "adam_params": {"learning_rate": 0.001, "beta1": 0.9, ...}}

Canonical form of an op (the bytes hashed): JSON with sorted keys and no spaces, where every number list is replaced
by the hex of its little-endian bytes in the dtype the Tinker SDK sends: model input tokens int32, ``target_tokens``
int64, every other ``loss_fn_inputs`` field float32, Adam parameters and ``loss_fn_config`` numbers float64 (and
``dp_epsilon``, the ε spent after a DP optim_step, float64). Chain: ``h_0`` = 32 zero bytes,
``h_i = SHA-256(b"cvm-tune-op-chain-v1:" || h_{i-1} || SHA-256(canonical(op_i)))``; the head is ``h_n`` in hex.

Pure Python (no numpy, nothing of ``app``): the verifier recomputes it alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from attestation.io.safe_yaml import parse_json

TAG = b"cvm-tune-op-chain-v1:"
GENESIS = "0" * 64
INT64_FIELDS = frozenset({"target_tokens"})
OPS = ("forward_backward", "optim_step")
MAX_OPS_FILE = 1 << 30


class OpChainError(ValueError):
    """An op that has no canonical form (unknown op, a value of the wrong type)."""


def _pack(fmt: str, values: Any, what: str) -> str:
    if not isinstance(values, list):
        raise OpChainError(f"{what}: a list of numbers is required")
    try:
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (fmt == "f" or fmt == "d") and not math.isfinite(v):
                raise TypeError(v)
            if fmt in "iq" and not isinstance(v, int):
                raise TypeError(v)
        return struct.pack(f"<{len(values)}{fmt}", *values).hex()
    except (TypeError, struct.error) as exc:
        raise OpChainError(f"{what}: not a list of {'integers' if fmt in 'iq' else 'finite numbers'} "
                           f"in range ({exc})") from None


def _f64(value: Any, what: str) -> str:
    return _pack("d", [value], what)


def canonical(op: dict[str, Any]) -> bytes:
    """The canonical bytes of one op (a JSONL line, parsed).

    Raises:
        OpChainError: not a forward_backward/optim_step of the documented shape.
    """
    if not isinstance(op, dict) or op.get("op") not in OPS:
        raise OpChainError(f"op must be one of {', '.join(OPS)}")
    if op["op"] == "optim_step":
        params = op.get("adam_params")
        if not isinstance(params, dict):
            raise OpChainError("optim_step needs adam_params (an object)")
        doc: dict[str, Any] = {"op": "optim_step",
                               "adam_params": {str(k): _f64(v, f"adam_params.{k}") for k, v in params.items()}}
        if op.get("dp_epsilon") is not None:
            doc["dp_epsilon"] = _f64(op["dp_epsilon"], "dp_epsilon")
    else:
        data, cfg = op.get("data"), op.get("loss_fn_config")
        if not isinstance(op.get("loss_fn"), str) or not isinstance(data, list):
            raise OpChainError("forward_backward needs loss_fn (a string) and data (a list)")
        if cfg is not None and not isinstance(cfg, dict):
            raise OpChainError("loss_fn_config must be an object")
        datums = []
        for i, d in enumerate(data):
            if not isinstance(d, dict) or not isinstance(d.get("loss_fn_inputs", {}), dict):
                raise OpChainError(f"data[{i}] must be an object with model_input and loss_fn_inputs")
            inputs = {str(k): _pack("q" if k in INT64_FIELDS else "f", v, f"data[{i}].loss_fn_inputs.{k}")
                      for k, v in d.get("loss_fn_inputs", {}).items()}
            datums.append({"model_input": _pack("i", d.get("model_input"), f"data[{i}].model_input"),
                           "loss_fn_inputs": inputs})
        doc = {"op": "forward_backward", "loss_fn": op["loss_fn"], "data": datums,
               "loss_fn_config": None if cfg is None else {
                   str(k): v if isinstance(v, str) else _f64(v, f"loss_fn_config.{k}") for k, v in cfg.items()}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def link(prev_hex: str, op: dict[str, Any]) -> str:
    """The chain head after appending ``op`` to a chain whose head is ``prev_hex``."""
    return hashlib.sha256(TAG + bytes.fromhex(prev_hex) + hashlib.sha256(canonical(op)).digest()).hexdigest()


def head(ops: list[dict[str, Any]]) -> str:
    """The head of a chain of ``ops`` (:data:`GENESIS` for none)."""
    h = GENESIS
    for op in ops:
        h = link(h, op)
    return h


def read_ops(path: Path) -> list[dict[str, Any]]:
    """The ops of a JSONL file (blank lines skipped).

    Raises:
        OpChainError: a line that is not a JSON object, or a file that cannot be read.
    """
    try:
        if Path(path).stat().st_size > MAX_OPS_FILE:
            raise OpChainError(f"{path} is larger than {MAX_OPS_FILE} bytes")
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OpChainError(f"cannot read {path}: {exc}") from None
    ops = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        op = parse_json(line, f"{path} line {n}", OpChainError)
        if not isinstance(op, dict):
            raise OpChainError(f"{path} line {n}: not a JSON object")
        ops.append(op)
    return ops
