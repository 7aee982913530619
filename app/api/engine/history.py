"""A model's history as the engine records it: every change of its trainable state is one op of its chain
(:mod:`attestation.outputs.op_chain`), checked in full before anything changes."""

from __future__ import annotations

from typing import Any

from attestation.outputs import op_chain

from app.api.errors import BadRequest


FLOAT32_MAX = 3.4028234663852886e38


def check_adam(adam: dict[str, Any]) -> None:
    """Adam parameters as an optim_step needs them: every value a finite number in its range, and a first step size
    (``learning_rate / (1 - beta1)``) that a 32-bit float holds.

    Raises:
        BadRequest: a missing, non-finite or out-of-range parameter (nothing is applied).
    """
    import math

    ranges = {"learning_rate": ">= 0", "beta1": "in [0, 1)", "beta2": "in [0, 1)", "eps": "> 0",
              "weight_decay": ">= 0", "grad_clip_norm": ">= 0 (0: no clipping)"}
    for name, what in ranges.items():
        v = adam.get(name)
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and (
            0 <= v < 1 if name.startswith("beta") else v > 0 if name == "eps" else v >= 0)
        if not ok:
            raise BadRequest(f"adam_params.{name} must be a finite number {what} (got {v!r})")
    first = adam["learning_rate"] / (1 - adam["beta1"])  # the largest step size Adam applies (its first step)
    if first > FLOAT32_MAX:  # torch cannot hand it to the weights' kernels: the step would fail part-way
        raise BadRequest(f"adam_params.learning_rate {adam['learning_rate']!r} is too large: learning_rate / "
                         f"(1 - beta1) = {first:.3g} does not fit a 32-bit float")


def fresh_optimizer(params: list[Any], state: dict[str, Any] | None = None) -> Any:
    """The optimizer every adapter starts with (create, a load, and replay alike), with a saved ``state`` loaded
    when given. ``foreach``: one call for all of an adapter's tensors (a GPU's default; on a CPU the same per-tensor
    arithmetic, so the same bits, with a fraction of the Python calls), also for a state saved when it said None.

    Raises:
        ValueError, KeyError, RuntimeError: ``state`` does not fit ``params``.
    """
    import torch

    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, foreach=True)
    if state is not None:
        opt.load_state_dict(state)  # takes the saved groups' options, foreach among them
        for group in opt.param_groups:
            group["foreach"] = True
    return opt


def opt_snapshot(opt: Any) -> tuple[dict[Any, dict[str, Any]], list[dict[str, Any]]]:
    """A copy of an optimizer's state and hyperparameters, for :func:`opt_restore` should its step fail part-way
    (cheaper than a deep copy of its state_dict: only the state's tensors are cloned)."""
    import torch

    return ({p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for p, s in opt.state.items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def opt_restore(opt: Any, snapshot: tuple[dict[Any, dict[str, Any]], list[dict[str, Any]]]) -> None:
    state, groups = snapshot
    opt.state.clear()
    opt.state.update(state)
    for group, saved in zip(opt.param_groups, groups):
        group.update(saved)


def applied(m: Any, op: Any, head: str, loss_sum: float) -> None:
    """Record a forward_backward op that added its gradient to model ``m``: the chain head ``head`` (linked before
    anything changed), one more op and pending gradient, the custom loss it used, its loss and tokens."""
    m.op_head, m.ops, m.pending = head, m.ops + 1, m.pending + 1
    if "custom" in op.extra:  # the loss's document goes with the model's history (manifest op_chain)
        m.custom_losses[op.extra["custom"].id] = op.extra["custom"].doc
    m.pending_loss += loss_sum
    m.tokens_seen += op.n_tokens


def link(prev: str, record: dict[str, Any]) -> str:
    """The chain head after ``record``; a record with no canonical form is refused before anything changes."""
    try:
        return op_chain.link(prev, record)
    except op_chain.OpChainError as exc:
        raise BadRequest(f"the op cannot be recorded: {exc}") from None


def load_record(c: Any, weights_sha256: str, optimizer: bool, model_head: str) -> dict[str, Any]:
    """The ``load`` op of loading ``c`` (:mod:`attestation.outputs.op_chain`): what the client's record holds for it.
    ``weights_sha256`` is its adapter_model.safetensors' SHA-256 (the plaintext, as its bundle's manifest binds it)."""
    return {"op": "load", "checkpoint": c.path, "checkpoint_head": c.op_head, "checkpoint_ops": c.ops,
            "weights_sha256": weights_sha256, "optimizer": bool(optimizer), "model_head": model_head}
