"""The Tinker losses, per datum, summed (``loss:sum``): ``cross_entropy``, ``importance_sampling``, ``ppo``.

``logp`` are the model's log-probabilities of ``target_tokens``; ``inputs`` are the datum's ``loss_fn_inputs``.

* cross_entropy: ``-sum(weights * logp)`` (weights default to 1).
* importance_sampling: ``-sum(exp(logp - logprobs) * advantages)``, ``logprobs`` being the sampler's.
* ppo: ``-sum(min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A))``, ``r = exp(logp - logprobs)``; thresholds from
  ``loss_fn_config`` (``clip_low_threshold``/``clip_high_threshold``, default 0.2 each).
"""

from __future__ import annotations

from typing import Any

import numpy as np


CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold")}


def check_config(name: str, config: dict[str, Any] | None) -> None:
    """``loss_fn_config`` as loss ``name`` reads it: only its keys, each a finite number (PPO's thresholds in
    [0, 1e6]). Checked before a forward_backward touches any state.

    Raises:
        BadRequest: an unknown key, a value that is not a finite number, or a threshold out of range.
    """
    import math

    from app.api.errors import BadRequest

    for key, value in (config or {}).items():
        if key not in CONFIG_KEYS.get(name, ()):
            known = ", ".join(CONFIG_KEYS.get(name, ())) or "none"
            raise BadRequest(f"loss_fn_config.{key} is not a setting of loss {name} (its settings: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 <= value <= 1e6:
            raise BadRequest(f"loss_fn_config.{key} must be a finite number in [0, 1e6] (got {value!r})")


def loss(name: str, logp: Any, inputs: dict[str, np.ndarray], config: dict[str, Any] | None) -> Any:
    import torch

    def field(key: str, default: float | None = None) -> Any:
        if key not in inputs:
            return torch.full_like(logp, default)
        return torch.as_tensor(inputs[key], dtype=logp.dtype, device=logp.device)

    if name == "cross_entropy":
        return -(field("weights", 1.0) * logp).sum()
    ratio = torch.exp(logp - field("logprobs"))
    adv = field("advantages")
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    cfg = config or {}
    low, high = float(cfg.get("clip_low_threshold", 0.2)), float(cfg.get("clip_high_threshold", 0.2))
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return -torch.minimum(ratio * adv, clipped * adv).sum()
