"""The op chain of a training-API checkpoint: a SHA-256 hash chain over every op that changed one model's trainable
state, in order: ``forward_backward``, ``optim_step`` and ``load`` (docs/verifier-spec.md, "API checkpoints and the op
chain"). It is the model's whole history: a model loaded from a saved state continues that state's chain with a
``load`` op, so the chain of any checkpoint starts at the base model.

A client that kept what it sent recomputes the head from a JSONL file, one op per line, plain JSON numbers::

    {"op": "forward_backward", "loss_fn": "cross_entropy",
     "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1, 1, 1]}}]}
    {"op": "optim_step", "adam_params": {"learning_rate": 0.001, "beta1": 0.9, ...}}

Canonical form of an op (the bytes hashed): JSON with sorted keys and no spaces, where every number list is replaced
by the hex of its little-endian bytes in the dtype the Tinker SDK sends: model input tokens int32, ``target_tokens``
int64, every other ``loss_fn_inputs`` field float32, Adam parameters and ``loss_fn_config`` numbers float64 (and
``dp_epsilon``, the ε spent after a DP optim_step, float64). A ``load`` op names the saved state it loaded::

    {"op": "load", "checkpoint": "tinker://…/weights/step-10", "checkpoint_head": "<its chain head>",
     "checkpoint_ops": 21, "weights_sha256": "<SHA-256 of its adapter_model.safetensors>", "optimizer": true,
     "model_head": "<the loading model's head before the load; 64 zeros for a new model>"}

and is hashed as that JSON (sorted keys, no spaces; hex in lower case). The model's chain continues from
``checkpoint_head``: its head becomes ``link(checkpoint_head, load)`` and its op count ``checkpoint_ops + 1``, so a
record of the whole history is the saved state's ops, then the ``load`` line, then what followed. Chain: ``h_0`` =
32 zero bytes,
``h_i = SHA-256(b"cvm-tune-op-chain-v1:" || h_{i-1} || SHA-256(canonical(op_i)))``; the head is ``h_n`` in hex.

Pure Python (no numpy, nothing of ``app``): the verifier recomputes it alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from attestation.verdict import QuoteFindings

TAG = b"cvm-tune-op-chain-v1:"
GENESIS = "0" * 64
INT64_FIELDS = frozenset({"target_tokens"})
OPS = ("forward_backward", "optim_step", "load")
LOAD_KEYS = frozenset({"op", "checkpoint", "checkpoint_head", "checkpoint_ops", "weights_sha256", "optimizer",
                       "model_head"})
MAX_CHECKPOINT_NAME = 512
CHECKPOINT_PREFIX = "tinker://"
MAX_OPS_FILE = 1 << 30
MAX_LINE = 16 << 20  # characters of one line of an ops file (Unicode code points, its line end not counted)
MAX_LINE_DEPTH = 32  # nesting of one line: an object or list and each value in it count one level
MAX_NUMBER = 400  # characters of one JSON number of a line (sign, digits, fraction and exponent)
LINE_END = re.compile(r"\r\n|\r|\n")
CHECK = "op_chain.ops"


class OpChainError(ValueError):
    """An op that has no canonical form (unknown op, a value of the wrong type)."""


class OpsFileError(OpChainError):
    """The ops file itself cannot be read (missing, not a regular file, too large, not UTF-8): an input error."""


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
    except (TypeError, OverflowError, struct.error) as exc:  # OverflowError: a float beyond float32's range
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
    if op["op"] == "load":
        return json.dumps(_load_doc(op), sort_keys=True, separators=(",", ":")).encode()
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


def _hex64(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise OpChainError(f"load: {what} must be 64 lower-case hex digits")
    return value


def _load_doc(op: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(op) - LOAD_KEYS)
    if unknown:
        raise OpChainError(f"load: unknown field {unknown[0]!r}")
    n, name, opt = op.get("checkpoint_ops"), op.get("checkpoint"), op.get("optimizer")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**63:
        raise OpChainError("load: checkpoint_ops must be an integer in 0..2^63-1")
    if not isinstance(name, str) or not len(CHECKPOINT_PREFIX) < len(name) <= MAX_CHECKPOINT_NAME \
            or not name.startswith(CHECKPOINT_PREFIX):
        raise OpChainError(f"load: checkpoint must be the loaded state's path ({CHECKPOINT_PREFIX}…, "
                           f"{len(CHECKPOINT_PREFIX) + 1} to {MAX_CHECKPOINT_NAME} characters)")
    if not isinstance(opt, bool):
        raise OpChainError("load: optimizer must be true or false")
    return {"op": "load", "checkpoint": name, "checkpoint_head": _hex64(op.get("checkpoint_head"), "checkpoint_head"),
            "checkpoint_ops": n, "weights_sha256": _hex64(op.get("weights_sha256"), "weights_sha256"),
            "optimizer": opt, "model_head": _hex64(op.get("model_head"), "model_head")}


def link(prev_hex: str, op: dict[str, Any]) -> str:
    """The chain head after appending ``op`` to a chain whose head is ``prev_hex``."""
    return hashlib.sha256(TAG + bytes.fromhex(prev_hex) + hashlib.sha256(canonical(op)).digest()).hexdigest()


def head(ops: list[dict[str, Any]]) -> str:
    """The head of a chain of ``ops`` (:data:`GENESIS` for none).

    Raises:
        OpChainError: an op without a canonical form, or a ``load`` whose ``checkpoint_head``/``checkpoint_ops`` are
            not the head and count of the ops before it (the record is not the model's whole history).
    """
    h = GENESIS
    for i, op in enumerate(ops):
        try:
            if isinstance(op, dict) and op.get("op") == "load":
                doc = _load_doc(op)
                if (doc["checkpoint_head"], doc["checkpoint_ops"]) != (h, i):
                    raise OpChainError(f"it loads a state of {doc['checkpoint_ops']} ops with head "
                                       f"{doc['checkpoint_head'][:16]}…, but the {i} ops before it hash to {h[:16]}…: "
                                       "record the saved state's own ops before its load line")
            h = link(h, op)
        except OpChainError as exc:
            raise OpChainError(f"op {i + 1}: {exc}") from None
    return h


def custom_loss_id(doc: Any) -> str:
    """A server-side custom loss's id: hex SHA-256 of its document ``{name, inputs, graph}`` as the SDK sent it, as
    JSON with sorted keys and no spaces (no NaN or infinity: the SDK encodes those as ``{"float": "inf"}``)."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


NODE_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")


def document_problem(doc: Any) -> str | None:
    """Why ``doc`` is not a custom-loss document in the form the server records (None: it is): exactly ``name``
    (a string), ``inputs`` (a list of exactly ``{"name": string, "rank": 0, 1 or 2}``) and ``graph`` (exactly
    ``{"format": 1, "nodes": [...]}``, each node exactly ``{"op", "name", "target", "args", "kwargs"}``: three
    strings, ``op`` one of :data:`NODE_OPS`, a list and an object), the SDK's request after the server filled its
    defaults (``format`` 1, ``args`` [], ``kwargs`` {}). Whether the server would rebuild it is replay's check."""
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(doc, dict) or set(doc) != {"name", "inputs", "graph"} or not isinstance(doc["name"], str):
        return "it is not exactly {name, inputs, graph} with a string name"
    inputs, graph = doc["inputs"], doc["graph"]
    if not isinstance(inputs, list) or any(not isinstance(i, dict) or set(i) != {"name", "rank"} or not isinstance(
            i["name"], str) or not integer(i["rank"]) or i["rank"] not in (0, 1, 2) for i in inputs):
        return "inputs is not a list of exactly {name, rank} (rank 0, 1 or 2)"
    if not isinstance(graph, dict) or set(graph) != {"format", "nodes"} or not integer(graph["format"]) \
            or graph["format"] != 1 or not isinstance(graph["nodes"], list):
        return "graph is not exactly {format: 1, nodes: [...]}"
    for n, node in enumerate(graph["nodes"]):
        if not isinstance(node, dict) or set(node) != {"op", "name", "target", "args", "kwargs"} \
                or node["op"] not in NODE_OPS or not isinstance(node["name"], str) \
                or not isinstance(node["target"], str) or not isinstance(node["args"], list) \
                or not isinstance(node["kwargs"], dict):
            return f"graph node {n} is not exactly {{op, name, target, args (a list), kwargs (an object)}}"
    return None


def custom_loss_problems(ops: list[dict[str, Any]], losses: Any) -> list[str]:
    """Each op that used a custom loss names one the manifest holds, and each document there hashes to its id."""
    losses = losses or {}
    problems = []
    for key, doc in losses.items():
        if (why := document_problem(doc)) is not None:
            problems.append(f"custom loss {key[:16]}…: {why}")
            continue
        try:
            if custom_loss_id(doc) != key:
                problems.append(f"custom loss {key[:16]}…: its document hashes to {custom_loss_id(doc)[:16]}…")
        except (TypeError, ValueError):
            problems.append(f"custom loss {key[:16]}…: its document is not canonical JSON")
    for i, op in enumerate(ops, start=1):
        if isinstance(op, dict) and op.get("loss_fn") == "custom":
            lid = (op.get("loss_fn_config") or {}).get("loss_id") if isinstance(op.get("loss_fn_config"), dict) else None
            if lid not in losses:
                problems.append(f"op {i} uses custom loss {str(lid)[:16]}…, which the manifest does not hold")
    return problems


def dp_problems(ops: list[dict[str, Any]], dp: Any) -> list[str]:
    """A DP-SGD model's every optim_step carries the ε spent after it (``dp_epsilon``), the last one the manifest's
    ``op_chain.dp.epsilon``; a model without ``op_chain.dp`` has none (the server records one only after a DP step,
    and a model's history is all DP or all not: a load across is refused)."""
    steps = [(i, op) for i, op in enumerate(ops, start=1) if isinstance(op, dict) and op.get("op") == "optim_step"]
    if dp is None:
        return [f"op {i}: an optim_step with dp_epsilon, but the bundle records no op_chain.dp (trained without "
                "DP-SGD)" for i, op in steps if op.get("dp_epsilon") is not None][:1]
    problems = [f"op {i}: an optim_step without dp_epsilon, but the model was trained with DP-SGD (op_chain.dp)"
                for i, op in steps if op.get("dp_epsilon") is None][:1]
    eps = dp.get("epsilon") if isinstance(dp, dict) else None
    if steps and not problems and not isinstance(eps, bool) and isinstance(eps, (int, float)) \
            and float(steps[-1][1]["dp_epsilon"]) != float(eps):
        problems.append(f"op {steps[-1][0]}: the last optim_step's dp_epsilon {steps[-1][1]['dp_epsilon']!r} is not "
                        f"op_chain.dp.epsilon {eps!r}")
    return problems


def check(f: QuoteFindings, recorded: Any, ops: list[dict[str, Any]] | None, source: str) -> None:
    """Add ``op_chain.ops``: do the client's ``ops`` (read from ``source``) hash to the bundle's recorded head and
    count? ``recorded``: the manifest's ``op_chain`` block (None: the bundle is not a training-API checkpoint);
    ``ops`` None: the file had no canonical form (its reason is in ``source``)."""
    if recorded is None:
        f.add(CHECK, "fail", "the bundle records no op chain (not a training-API checkpoint)")
        return
    if ops is None:
        f.add(CHECK, "fail", source)
        return
    try:
        got = head(ops)
    except OpChainError as exc:
        f.add(CHECK, "fail", f"{source}: {exc}")
        return
    if got != recorded.head or len(ops) != recorded.ops:
        f.add(CHECK, "fail", f"{len(ops)} ops in {source} hash to {got[:16]}…; the bundle records {recorded.ops} ops "
              f"with head {recorded.head[:16]}…")
        return
    problems = custom_loss_problems(ops, getattr(recorded, "custom_losses", None))
    problems += dp_problems(ops, getattr(recorded, "dp", None))
    if problems:
        f.add(CHECK, "fail", "; ".join(problems[:3]))
        return
    n = len(getattr(recorded, "custom_losses", None) or {})
    f.add(CHECK, "pass", f"{len(ops)} ops in {source} hash to the bundle's head {got[:16]}…"
          + (f"; {n} custom loss(es), each hashing to its id" if n else ""))


def read_ops(path: Path) -> list[dict[str, Any]]:
    """The ops of a JSONL file: lines end at LF, CR LF or a lone CR; a line that is empty or holds only spaces and
    tabs is skipped; every other line is one JSON object (:func:`parse_line`).

    Raises:
        OpsFileError: the file cannot be read (missing, not a regular file, too large, not UTF-8).
        OpChainError: a line that is not a JSON object.
    """
    import stat

    try:
        st = Path(path).stat()
        if not stat.S_ISREG(st.st_mode):
            raise OpsFileError(f"{path} is not a regular file")
        if st.st_size > MAX_OPS_FILE:
            raise OpsFileError(f"{path} is larger than {MAX_OPS_FILE} bytes")
        text = Path(path).read_bytes().decode("utf-8")  # a byte-order mark is kept: line 1 is then not JSON
    except (OSError, UnicodeDecodeError) as exc:
        raise OpsFileError(f"cannot read {path}: {exc}") from None
    ops = []
    for n, line in enumerate(LINE_END.split(text), start=1):
        if not line.strip(" \t"):
            continue
        ops.append(parse_line(line, f"{path} line {n}"))
    return ops


def parse_line(line: str, what: str) -> dict[str, Any]:
    """One line of an ops file as a JSON object: at most :data:`MAX_LINE` characters, nested at most
    :data:`MAX_LINE_DEPTH` levels, no member named twice in one object, no number longer than :data:`MAX_NUMBER`
    characters, no NaN or Infinity (JSON whitespace around it is allowed: spaces and tabs).

    Raises:
        OpChainError: anything else.
    """
    from attestation.io.safe_yaml import depth

    def number(kind: type) -> Any:
        def convert(text: str) -> Any:
            if len(text) > MAX_NUMBER:
                raise ValueError(f"a number of more than {MAX_NUMBER} characters")
            return kind(text)
        return convert

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ValueError(f"member {k[:64]!r} given twice")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    if len(line) > MAX_LINE:
        raise OpChainError(f"{what}: longer than {MAX_LINE} characters")
    try:
        op = json.loads(line, parse_int=number(int), parse_float=number(float), parse_constant=constant,
                        object_pairs_hook=unique)
    except RecursionError:
        raise OpChainError(f"{what}: nested more than {MAX_LINE_DEPTH} levels") from None
    except ValueError as exc:
        raise OpChainError(f"{what} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if depth(op) > MAX_LINE_DEPTH:
        raise OpChainError(f"{what}: nested more than {MAX_LINE_DEPTH} levels")
    if not isinstance(op, dict):
        raise OpChainError(f"{what}: not a JSON object")
    return op


def read_record(path: Path) -> tuple[list[dict[str, Any]] | None, str]:
    """The client's ops and how to name them for :func:`check`; (None, the reason) when a line is not a JSON object.

    Raises:
        OpsFileError: the file cannot be read at all (an input error, not a verdict).
    """
    try:
        return read_ops(path), str(path)
    except OpsFileError:
        raise
    except OpChainError as exc:
        return None, str(exc)


# op_chain.dp's members and their JSON kinds: a number (integer or not), an integer (written without fraction or
# exponent), a string; a boolean, null, list or object is none of them.
OP_CHAIN_DP_MEMBERS: dict[str, Any] = {
    "noise_multiplier": (int, float), "max_grad_norm": (int, float), "sample_rate": (int, float),
    "delta": (int, float), "epsilon": (int, float), "dataset_size": int, "batch_size": int, "steps": int,
    "accountant": str}


def op_chain_dp_problem(dp: dict[str, Any]) -> str | None:
    """What is wrong with the kinds of a training-API bundle's ``op_chain.dp`` members (None: nothing)."""
    for k, v in dp.items():
        if k not in OP_CHAIN_DP_MEMBERS:
            return f"dp.{k} is not a member of op_chain.dp ({', '.join(OP_CHAIN_DP_MEMBERS)})"
        want = OP_CHAIN_DP_MEMBERS[k]
        if isinstance(v, bool) or not isinstance(v, want):
            return f"dp.{k} must be {'an integer' if want is int else 'a string' if want is str else 'a number'}"
    return None
