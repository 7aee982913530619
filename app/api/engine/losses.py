"""The Tinker losses, per datum, summed (``loss:sum``): ``cross_entropy``, ``importance_sampling``, ``ppo``,
``cispo``, ``dro``, as Tinker defines them.

``logp`` are the model's log-probabilities of ``target_tokens``; ``inputs`` are the datum's ``loss_fn_inputs``
(``logprobs``: the sampler's, ``advantages``: the client's); ``r = exp(logp - logprobs)``.

* cross_entropy: ``-sum(weights * logp)`` (weights default to 1).
* importance_sampling: ``-sum(r * advantages)``.
* ppo: ``-sum(min(r * A, clamp(r, low, high) * A))``; ``low``/``high`` are ``loss_fn_config``'s
  ``clip_low_threshold``/``clip_high_threshold``, bounds of the ratio itself (default 0.8 and 1.2: ε = 0.2).
* cispo: ``-sum(sg(clamp(r, low, high)) * logp * A)``, the clipped ratio a constant weight (same thresholds and
  defaults as ppo).
* dro: ``-sum(logp * A - beta / 2 * (logp - logprobs) ** 2)``; ``beta`` from ``loss_fn_config`` (default 0.05).
"""

from __future__ import annotations

from typing import Any

import numpy as np


CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold"),
               "cispo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",), "custom": ("loss_id",)}
CLIP_DEFAULTS = (0.8, 1.2)  # ppo and cispo: the importance ratio's bounds (Tinker's ε = 0.2)
DRO_BETA = 0.05


def check_config(name: str, config: dict[str, Any] | None) -> None:
    """``loss_fn_config`` as loss ``name`` reads it: only its keys, each a finite number (PPO's thresholds in
    [0, 1e6]). Checked before a forward_backward touches any state.

    Raises:
        BadRequest: an unknown key, a value that is not a finite number, or a threshold out of range.
    """
    import math
    import re

    from app.api.errors import BadRequest

    if name == "custom":  # a server-side custom loss (app.api.engine.custom_loss), named by its canonical hash
        lid = (config or {}).get("loss_id")
        if set(config or {}) != {"loss_id"} or not isinstance(lid, str) or not re.fullmatch(r"[0-9a-f]{64}", lid):
            raise BadRequest("loss custom needs loss_fn_config {\"loss_id\": <the id create_custom_loss answered>}")
        return
    for key, value in (config or {}).items():
        if key not in CONFIG_KEYS.get(name, ()):
            known = ", ".join(CONFIG_KEYS.get(name, ())) or "none"
            raise BadRequest(f"loss_fn_config.{key} is not a setting of loss {name} (its settings: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 <= value <= 1e6:
            raise BadRequest(f"loss_fn_config.{key} must be a finite number in [0, 1e6] (got {value!r})")
    if name in ("ppo", "cispo"):
        low, high = _clip(config)
        if low > high:
            raise BadRequest(f"loss_fn_config: clip_low_threshold {low} is above clip_high_threshold {high}")


def _clip(config: dict[str, Any] | None) -> tuple[float, float]:
    cfg = config or {}
    return float(cfg.get("clip_low_threshold", CLIP_DEFAULTS[0])), float(cfg.get("clip_high_threshold", CLIP_DEFAULTS[1]))


def loss(name: str, logp: Any, inputs: dict[str, np.ndarray], config: dict[str, Any] | None, custom: Any = None,
         metrics: dict[str, float] | None = None) -> Any:
    """One datum's loss; ``custom`` (an :class:`app.api.engine.custom_loss.Loss`) for ``custom``, whose metrics are summed
    into ``metrics``."""
    import torch

    def field(key: str, default: float | None = None) -> Any:
        if key not in inputs:
            return torch.full_like(logp, default)
        return torch.as_tensor(inputs[key], dtype=logp.dtype, device=logp.device)

    if name == "cross_entropy":
        return -(field("weights", 1.0) * logp).sum()
    if name == "custom":
        value, extra = custom(logp, *(field(n) for n, _rank in custom.inputs[1:]))
        for k, v in extra.items():
            if metrics is not None:
                metrics[k] = metrics.get(k, 0.0) + float(v.detach() if isinstance(v, torch.Tensor) else v)
        return value
    adv = field("advantages")
    if name == "dro":
        beta = float((config or {}).get("beta", DRO_BETA))
        return -(logp * adv - 0.5 * beta * (logp - field("logprobs")) ** 2).sum()
    ratio = torch.exp(logp - field("logprobs"))
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    low, high = _clip(config)
    clipped = torch.clamp(ratio, low, high)
    if name == "cispo":
        return -(clipped.detach() * logp * adv).sum()
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def score(logits: Any, d: Any) -> tuple[Any, float, dict[str, np.ndarray]]:
    """One datum's log-probabilities of its ``target_tokens`` under ``logits`` (its rows), its weight (the sum of
    its ``weights``, else its token count) and its output (``logprobs``, ``elementwise_loss``)."""
    import torch

    target = torch.as_tensor(d.inputs["target_tokens"], device=logits.device)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, target[:, None])[:, 0]
    weight = float(d.inputs["weights"].sum()) if "weights" in d.inputs else len(d.tokens)
    lp = logp.detach().cpu().numpy()
    return logp, weight, {"logprobs": lp,
                          "elementwise_loss": -lp * d.inputs.get("weights", np.ones(len(d.tokens), np.float32))}


def op_metrics(total: float, weight: float, sums: dict[str, float], datums: int) -> dict[str, float]:
    """An op's metrics: ``loss:sum``, ``loss:mean`` (over its weight) and a custom loss's (:func:`reduce_metrics`)."""
    return {"loss:sum": total, "loss:mean": total / max(weight, 1e-9), **reduce_metrics(sums, datums)}


def reduce_metrics(sums: dict[str, float], datums: int) -> dict[str, float]:
    """A custom loss's metrics over a request: ``…:sum`` summed, ``…:mean`` averaged over its datums."""
    return {k: v / max(datums, 1) if k.endswith(":mean") else v for k, v in sums.items()}
