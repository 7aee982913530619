"""DP-SGD per API model (opt-in at create_model through ``user_metadata``): per-datum clipping, Gaussian noise at
each optim_step, and the ε spent by the project's Opacus accountant (:func:`app.training.privacy.epsilon`).

``user_metadata`` keys (strings, as the SDK sends them): ``dp.noise_multiplier`` (σ), ``dp.max_grad_norm`` (C),
``dp.dataset_size`` (N, the rows the client samples from), ``dp.batch_size`` (its expected batch, B: the sample rate
is q = B / N), optional ``dp.delta`` (default 1 / N², as the nightly run) and ``dp.accountant`` (``rdp`` or
``prv``). Each datum's gradient is clipped to C; an optim_step adds N(0, σ²C²) to the sum of the clipped gradients,
divides by B and takes the Adam step; ε is reported in its metrics (``dp_epsilon``) and hashed into the op chain.
The accountant assumes the client draws each batch by Poisson sampling at rate q: the server cannot see how it chose
its batches, so that part of the guarantee is the client's to keep.
"""

from __future__ import annotations

from typing import Any

from app.api.errors import BadRequest

KEYS = ("noise_multiplier", "max_grad_norm", "dataset_size", "batch_size", "delta", "accountant")


def options(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """The DP settings ``user_metadata`` asks for (None: no DP).

    Raises:
        BadRequest: an unknown ``dp.*`` key, or a value out of range.
    """
    from app.training.privacy import default_delta

    given = {k[3:]: v for k, v in (meta or {}).items() if k.startswith("dp.")}
    if not given:
        return None
    unknown = sorted(set(given) - set(KEYS))
    if unknown:
        raise BadRequest(f"user_metadata dp.{unknown[0]} is not a DP setting (known: dp.{', dp.'.join(KEYS)})")
    try:
        sigma, clip = float(given["noise_multiplier"]), float(given["max_grad_norm"])
        n, b = int(given["dataset_size"]), int(given["batch_size"])
        delta = float(given["delta"]) if "delta" in given else default_delta(n)
    except KeyError as exc:
        raise BadRequest(f"DP needs user_metadata dp.{exc.args[0]}") from None
    except ValueError as exc:
        raise BadRequest(f"a DP setting is not a number: {exc}") from None
    accountant = str(given.get("accountant", "rdp"))
    if not (0.01 <= sigma <= 1e6 and 0 < clip <= 1e6 and 2 <= n and 1 <= b <= n and 0 < delta < 1
            and accountant in ("rdp", "prv")):
        raise BadRequest("DP settings out of range: 0.01 <= noise_multiplier <= 1e6, 0 < max_grad_norm, "
                         "dataset_size >= 2, 1 <= batch_size <= dataset_size, 0 < delta < 1, accountant rdp or prv")
    return {"noise_multiplier": sigma, "max_grad_norm": clip, "dataset_size": n, "batch_size": b,
            "sample_rate": b / n, "delta": delta, "accountant": accountant, "steps": 0, "epsilon": 0.0}


def clip_into(params: list[Any], sums: list[Any], clip: float) -> None:
    """Add this datum's gradient (in ``p.grad``), clipped to L2 norm ``clip``, into ``sums``; clear ``p.grad``."""
    import torch

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    scale = min(1.0, clip / (norm + 1e-6))
    for s, g in zip(sums, grads):
        s.add_(g, alpha=scale)
    for p in params:
        p.grad = None


def noisy_grads(params: list[Any], sums: list[Any], dp: dict[str, Any]) -> None:
    """``p.grad`` = (sum of clipped gradients + N(0, σ²C²)) / B; the sums are cleared. Noise from the OS's CSPRNG."""
    import os

    import torch

    gen = torch.Generator(device=params[0].device).manual_seed(int.from_bytes(os.urandom(8), "little"))
    std = dp["noise_multiplier"] * dp["max_grad_norm"]
    for p, s in zip(params, sums):
        noise = torch.normal(0.0, std, size=s.shape, generator=gen, device=s.device, dtype=s.dtype)
        p.grad = (s + noise) / dp["batch_size"]
        s.zero_()


def account(dp: dict[str, Any]) -> float:
    """One more step: the ε spent so far at ``dp['delta']`` (recorded in ``dp``)."""
    from app.training.privacy import epsilon

    dp["steps"] += 1
    dp["epsilon"] = float(epsilon(dp["accountant"], [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"])],
                                  dp["delta"]))
    return dp["epsilon"]
