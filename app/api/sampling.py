"""Token sampling for the API's ``asample``: temperature, top-k, top-p, stop tokens, per-token log-probabilities
(of the distribution sampled from), and prompt log-probabilities on request."""

from __future__ import annotations

import math
from typing import Any


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


def check_params(p: Any) -> None:
    """Refuse sampling parameters the sampler cannot honour, before anything is queued.

    Raises:
        BadRequest: temperature not finite or below 0, top_p outside 0..1, top_k below -1 (-1 and 0: no top-k), or a
            seed outside 0..2**63-1.
    """
    from app.api.errors import BadRequest

    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise BadRequest(f"sampling_params.temperature {p.temperature} must be a finite number >= 0")
    if not 0.0 <= p.top_p <= 1.0:  # NaN fails too
        raise BadRequest(f"sampling_params.top_p {p.top_p} must be between 0 and 1")
    if p.top_k < -1:
        raise BadRequest(f"sampling_params.top_k {p.top_k} must be -1 (no top-k) or more")
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        raise BadRequest(f"sampling_params.seed must be between 0 and {MAX_SEED}")


def generate(model: Any, prompt: list[int], *, max_tokens: int, temperature: float, top_k: int, top_p: float,
             stop: list[int], generator: Any, device: str) -> tuple[list[int], list[float], bool]:
    """(tokens, logprobs, stopped): up to ``max_tokens`` tokens after ``prompt`` (KV cache)."""
    import torch

    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_tokens):
        logits = out.logits[0, -1].float()
        logits = logits / temperature if temperature > 0 else logits
        lp = torch.log_softmax(logits, dim=-1)
        if temperature <= 0:
            tok = int(torch.argmax(lp))
        else:
            probs = _filtered(lp.exp(), top_k, top_p)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        if tok in stop:
            return tokens, logprobs, True
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens, logprobs, False


def _filtered(probs: Any, top_k: int, top_p: float) -> Any:
    import torch

    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p * sorted_p.sum()
        keep[0] = True  # the most probable token always stays (top_p 0: nothing else)
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def prompt_logprobs(model: Any, prompt: list[int], device: str) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for every position; NaN at position 0 (no context)."""
    import torch

    logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(prompt[1:], device=device)[:, None])[:, 0]
    return [math.nan, *lp.cpu().tolist()]
