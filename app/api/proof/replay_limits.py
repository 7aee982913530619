"""What ``verify --ops --replay`` (:mod:`app.api.proof.replay`) accepts of a bundle and its ops before it runs them: what the
server accepted, under the server's limits (the bundle's ``config.json``), checked by the server's own code where
it can be (the request decoder, the loss's configuration, the custom-loss rebuild).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attestation.io.safe_yaml import parse_json
from attestation.outputs import op_chain

MODEL = "replay"
THREADS_MAX = 1024  # torch threads a replay sets (a server records its own, at most its CPUs)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes


class ReplayFailed(Exception):
    """The replay could not reproduce the bundle's weights (the reason is the check's)."""


def torch_threads(det: dict[str, Any]) -> int | None:
    """``determinism.torch_threads``: the threads the replay computes with (None: not recorded, torch's default).

    Raises:
        ReplayFailed: not a thread count in [1, THREADS_MAX].
    """
    n = det.get("torch_threads")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= THREADS_MAX):
        raise ReplayFailed(f"the manifest's op_chain.determinism.torch_threads {short(n)} is not a thread count in "
                           f"[1, {THREADS_MAX}]")
    return n


def server_limits(bundle: Path) -> Any:
    """The limits the server enforced, from the ``api`` block of the bundle's ``config.json`` (whose hash the
    verdict checked): ``max_tokens_per_request``, ``max_seq_len``, ``max_lora_rank``; the defaults where it has
    none (a bundle made before they existed).

    Raises:
        ReplayFailed: ``config.json`` unreadable, or one of them not a positive integer.
    """
    from types import SimpleNamespace

    from app.config.api import ApiSettings

    try:
        doc = parse_json((bundle / "config.json").read_bytes(), "config.json", ValueError)
    except (OSError, ValueError) as exc:
        raise ReplayFailed(f"the bundle's config.json gives no server limits: {str(exc).splitlines()[0]}") from None
    api = doc.get("api") if isinstance(doc, dict) else None
    api = api if isinstance(api, dict) else {}
    out = {}
    for name in ("max_tokens_per_request", "max_seq_len", "max_lora_rank"):
        v = api.get(name, ApiSettings.model_fields[name].default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ReplayFailed(f"the bundle's config.json api.{name} {short(v)} is not a positive integer")
        out[name] = v
    return SimpleNamespace(**out)


def check_lora(lora: Any, max_rank: int) -> dict[str, Any]:
    """The manifest's ``op_chain.lora`` as the server accepts one: rank in [1, ``max_rank``], a seed torch takes,
    each of ``train_attn``, ``train_mlp``, ``train_unembed`` true or false.

    Raises:
        ReplayFailed: anything else (the server would not have created the model).
    """
    ok = isinstance(lora, dict) and all(isinstance(lora.get(k), bool) for k in ("train_attn", "train_mlp",
                                                                                 "train_unembed"))
    rank, seed = (lora.get("rank"), lora.get("seed")) if isinstance(lora, dict) else (None, None)
    if not ok or isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ReplayFailed(f"the manifest's op_chain.lora {short(lora)} is not one the server creates (rank 1 to "
                           f"{max_rank}; train_attn, train_mlp, train_unembed true or false)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ReplayFailed(f"the manifest's op_chain.lora.seed {short(seed)} is not a seed torch takes "
                           f"([-2^63, 2^64 - 1])")
    return dict(lora)


def short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def server_op(op: dict[str, Any], custom: dict[str, Any], vocab: int, limits: Any) -> Any:
    """The forward_backward ``op`` of the record as the server decoded it: the protobuf body the SDK sends for it,
    decoded and checked by the server's own decoder under ``limits`` (token ids in the vocabulary, a known loss,
    lengths that match, data, tokens per datum and per request).

    Raises:
        BadRequest: what the server would refuse.
    """
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    from app.api import wire
    from app.api.engine.custom_loss import lookup

    msg = pb.ForwardBackwardRequest(model_id=MODEL, loss_fn=str(op.get("loss_fn")))
    for k, v in (op.get("loss_fn_config") or {}).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config[k] = float(v)
            msg.loss_fn_config_v2[k].number = float(v)
    for d in op.get("data") or []:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(d.get("model_input", []), dtype=np.int32).tobytes()
        for name, values in (d.get("loss_fn_inputs") or {}).items():
            int64 = name in op_chain.INT64_FIELDS
            t = datum.loss_fn_inputs[name]
            t.dtype = pb.DTYPE_INT64 if int64 else pb.DTYPE_FLOAT32
            t.dense = np.asarray(values, dtype=np.int64 if int64 else np.float32).tobytes()
            t.shape.append(len(values))
    out = wire.decode_forward_backward(msg.SerializeToString(), vocab=vocab, max_seq_len=limits.max_seq_len,
                                       max_tokens=limits.max_tokens_per_request)
    if out.loss_fn == "custom":
        from app.api.engine.losses import check_config

        check_config(out.loss_fn, out.loss_fn_config)
        out.extra["custom"] = lookup(custom, "the bundle's record", out)
    return out
