"""The Tinker wire formats the server reads and writes, with the SDK's own protobuf module (``tinker.proto``).

``forward_backward``/``forward`` bodies arrive as ``tinker_public_pb2.ForwardBackwardRequest`` (zstd only when the
server's client config asks for it; it does not); ``ForwardBackwardOutput`` and ``SampleResponse`` results go back as
protobuf, the only form SDK 0.38 accepts for them. Decoded requests are plain Python (:class:`Op`), the form the op
chain (:mod:`attestation.outputs.op_chain`) hashes and the engine runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from app.api.errors import BadRequest

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}
_KNOWN_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "custom")


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]  # target_tokens int64, the rest float32


@dataclass
class Op:
    """One decoded forward_backward / forward request."""

    model_id: str
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    loss_fn_config: dict[str, float | str] | None = None
    seq_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The op as the client's JSONL records it (:mod:`attestation.outputs.op_chain`)."""
        return {"op": "forward_backward", "loss_fn": self.loss_fn, "loss_fn_config": self.loss_fn_config,
                "data": [{"model_input": d.tokens,
                          "loss_fn_inputs": {k: v.tolist() for k, v in d.inputs.items()}} for d in self.data]}

    @property
    def n_tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


def decode_forward_backward(body: bytes, *, vocab: int, max_seq_len: int, max_tokens: int,
                            model: Callable[[str], object] = lambda _id: None) -> Op:
    """Parse and check a protobuf forward_backward body; ``model`` is called with its model id as soon as it parses,
    before anything else is checked (a model that is not there is the first answer, whatever else is wrong).

    Raises:
        BadRequest: malformed (a token chunk that is not whole int32s too), an unknown loss, a token id outside the
            vocabulary, a length mismatch, an image or audio chunk, a sparse tensor, or over the configured limits.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequest(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    model(msg.model_id)
    if msg.loss_fn not in _KNOWN_LOSSES:
        raise BadRequest(f"loss_fn {msg.loss_fn!r} is not served (served: {', '.join(_KNOWN_LOSSES)})")
    if not msg.data:
        raise BadRequest("forward_backward with no data")
    config: dict[str, float | str] = {k: (v.text if v.WhichOneof("value") == "text" else float(v.number))
                                      for k, v in msg.loss_fn_config_v2.items()}
    config.update({k: float(v) for k, v in msg.loss_fn_config.items() if k not in config})
    data, total = [], 0
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadRequest(f"data[{i}]: only token (encoded_text) chunks are served")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise BadRequest(f"data[{i}]: a token chunk of {len(raw)} bytes is not whole int32s")
            tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        if not tokens or len(tokens) > max_seq_len:
            raise BadRequest(f"data[{i}]: model input has {len(tokens)} tokens (1 to {max_seq_len} allowed)")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"data[{i}]: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in d.loss_fn_inputs.items()}
        _check_inputs(inputs, len(tokens), msg.loss_fn, vocab, i)
        total += len(tokens)
        data.append(Datum(tokens, inputs))
    if total > max_tokens:
        raise BadRequest(f"request carries {total} tokens; at most {max_tokens} per request")
    return Op(msg.model_id, msg.loss_fn, msg.forward_only, data, config or None, msg.seq_id)


def _tensor(t: Any, what: str) -> np.ndarray:
    if t.HasField("sparse_csr"):
        raise BadRequest(f"{what}: sparse tensors are not served; send it dense")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None or len(t.dense) % np.dtype(dtype).itemsize:
        raise BadRequest(f"{what}: dtype must be float32 or int64 with whole elements")
    arr = np.frombuffer(t.dense, dtype=dtype).copy()
    if list(t.shape) and math.prod(t.shape) != arr.size or len(t.shape) > 1:
        raise BadRequest(f"{what}: shape {list(t.shape)} does not fit {arr.size} values (1-D tensors only)")
    if dtype is np.float32 and not np.isfinite(arr).all():
        raise BadRequest(f"{what}: values must be finite")
    return arr


def _check_inputs(inputs: dict[str, np.ndarray], n: int, loss_fn: str, vocab: int, i: int) -> None:
    need = {"cross_entropy": ("target_tokens",), "importance_sampling": ("target_tokens", "logprobs", "advantages"),
            "ppo": ("target_tokens", "logprobs", "advantages"), "cispo": ("target_tokens", "logprobs", "advantages"),
            "dro": ("target_tokens", "logprobs", "advantages"), "custom": ("target_tokens",)}[loss_fn]
    for name in need:
        if name not in inputs:
            raise BadRequest(f"data[{i}]: loss {loss_fn} needs loss_fn_inputs.{name}")
    for name, arr in inputs.items():
        if arr.size != n:
            raise BadRequest(f"data[{i}]: loss_fn_inputs.{name} has {arr.size} values for {n} input tokens")
    if inputs["target_tokens"].dtype != np.int64:
        raise BadRequest(f"data[{i}]: target_tokens must be int64")
    tt = inputs["target_tokens"]
    if ((tt < 0) | (tt >= vocab)).any():
        raise BadRequest(f"data[{i}]: a target token id is outside the vocabulary (0..{vocab - 1})")
    for name, arr in inputs.items():
        if name != "target_tokens" and arr.dtype != np.float32:
            raise BadRequest(f"data[{i}]: loss_fn_inputs.{name} must be float32")


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput`` protobuf: one batched ``ArrayRecord`` of float32 fields, one row per datum."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    if per_datum:
        rec = msg.loss_fn_outputs.add(num_datums=len(per_datum))
        for name in per_datum[0]:
            arrays = [np.ascontiguousarray(d[name], dtype=np.float32) for d in per_datum]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            bt = rec.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], bool]], prompt_logprobs: list[float] | None,
                    topk: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """A ``SampleResponse`` protobuf: (tokens, logprobs, stopped) per sequence; prompt logprobs with NaN first; the
    top-k prompt logprobs as ``(token ids, logprobs)``, two ``(len(prompt), k)`` arrays (``TopkLogprobs``)."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stopped in sequences:
        s = msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH)
        s.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk is not None:
        ids, lps = topk
        msg.topk_prompt_logprobs.length, msg.topk_prompt_logprobs.k = ids.shape
        msg.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        msg.topk_prompt_logprobs.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
    return msg.SerializeToString()
