"""Loading a saved state into a model of the engine (:meth:`app.api.engine.engine.Engine.load`): read and checked in full,
then applied, as the ``load`` op of the model's chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.api.errors import BadRequest
from app.api.engine.history import fresh_optimizer, link


def load(engine: Any, m: Any, src: Path, *, optimizer: bool, record: dict[str, Any]) -> None:
    """Replace the model's state with the saved state in ``src``, as the ``load`` op ``record``: everything is
    read and checked first (LoRA shapes, DP or not, optimizer state, progress), then applied; the model's chain
    continues from the saved state's (``record``'s checkpoint head and op count). Without ``optimizer`` the
    Adam state starts afresh. A pending gradient is refused: the load would drop it outside the chain.

    Raises:
        BadRequest: a pending gradient, a state of another LoRA shape, a DP mismatch, or a damaged state.
    """
    import json

    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    if m.pending:
        raise BadRequest(f"model {m.id} has the gradient of {m.pending} forward_backward op(s) not yet applied: "
                         "run optim_step first (a load would discard it)")
    saved = saved_dp(src)
    if (saved is None) != (m.dp is None):
        raise BadRequest("the saved state and the model differ in DP-SGD (one has it, the other not)")
    try:
        weights = load_file(str(src / "adapter_model.safetensors"), device=engine.device)
        state = torch.load(src / "optimizer.pt", weights_only=True) if optimizer else None
        progress = json.loads((src / "progress.json").read_text()) if (src / "progress.json").is_file() else None
        steps, tokens = (int(progress["steps"]), int(progress["tokens_seen"])) if progress else (m.steps, m.tokens_seen)
        curve = [(int(a), float(b)) for a, b in progress["losses"]] if progress else list(m.losses)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise BadRequest(f"the saved state cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
    mine = get_peft_model_state_dict(engine.model, adapter_name=m.adapter)
    shapes = {k: tuple(v.shape) for k, v in mine.items()}
    if {k: tuple(v.shape) for k, v in weights.items()} != shapes:
        raise BadRequest("the saved state's LoRA tensors do not fit this model (another rank or target layers)")
    params = engine._params(m.adapter)
    try:
        fresh = fresh_optimizer(params, state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise BadRequest(f"the saved optimizer state does not fit this model: {str(exc)[:200]}") from None
    new_head = link(record["checkpoint_head"], record)
    with torch.no_grad():
        set_peft_model_state_dict(engine.model, weights, adapter_name=m.adapter)
    for p in params:
        p.grad = None
    m.optimizer = fresh
    m.steps, m.tokens_seen, m.losses, m.pending_loss = steps, tokens, curve, 0.0
    m.custom_losses = dict((progress or {}).get("custom_losses") or {})  # the loaded history's custom losses
    if saved is not None:
        m.dp = saved  # the accounting continues from the saved state's steps
        m.dp_sums = [torch.zeros_like(p) for p in params]
    m.op_head, m.ops = new_head, int(record["checkpoint_ops"]) + 1


def saved_dp(src: Path) -> dict[str, Any] | None:
    """The DP settings and spend a saved state recorded (None: trained without DP)."""
    import json

    f = Path(src) / "dp.json"
    return json.loads(f.read_text()) if f.is_file() else None
