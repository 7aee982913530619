"""Token sampling for the API's ``asample``: temperature, top-k, top-p, stop tokens, per-token log-probabilities
(of the distribution sampled from), and prompt log-probabilities on request."""

from __future__ import annotations

import math
from typing import Any


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
