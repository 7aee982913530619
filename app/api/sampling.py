"""Token sampling for the API's ``asample``: temperature, top-k, top-p, stop token ids and stop strings, per-token
log-probabilities (of the distribution sampled from), and prompt log-probabilities (and their top k) on request.

Stops follow Tinker's ``SamplingParams.stop``: ``None`` stops at the tokenizer's end-of-sequence token, ``[]`` never
stops early, token ids stop once one of them is sampled, strings once the decoded text of the sampled tokens holds
one of them (the EOS token stops too in both cases). The token that stopped generation stays in the result, as do the
tokens that spell a stop string (stop reason ``stop``), as Tinker returns them: a renderer's ``parse_response``
finds the stop sequence in what it decodes. Reaching ``max_tokens`` first gives stop reason ``length``.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_TOPK = 20  # topk_prompt_logprobs served (each prompt position carries k ids and logprobs)
MASK_LOGPROB = -99999.0  # tinker.types.topk_logprobs.MASK_LOGPROB: a top-k row with nothing in it


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


@dataclass(frozen=True)
class Stop:
    """When a sequence ends before ``max_tokens``: a token in ``tokens``, or a string of ``strings`` in its text."""

    tokens: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


def stop_of(stop: Any, eos: frozenset[int]) -> Stop:
    """The :class:`Stop` of a request's ``SamplingParams.stop`` (``eos``: the base model's end-of-sequence ids).

    Raises:
        BadRequest: an empty stop string, or a list mixing strings and token ids.
    """
    from app.api.errors import BadRequest

    if stop is None:
        return Stop(tokens=eos)
    items = [stop] if isinstance(stop, str) else list(stop)
    if not items:
        return Stop()  # Tinker: [] disables every stop token, EOS included
    if all(isinstance(i, str) for i in items):
        if any(not i for i in items):
            raise BadRequest("sampling_params.stop holds an empty string")
        return Stop(tokens=eos, strings=tuple(dict.fromkeys(items)))
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return Stop(tokens=eos | frozenset(items))
    raise BadRequest("sampling_params.stop: strings or token ids, not both")


def check_request(req: Any, base_dir: str, config: Any, vocab: int) -> Stop:
    """The :class:`Stop` of a ``SampleRequest`` to the base model in ``base_dir`` (``config``: its configuration).

    Raises:
        BadRequest: a bad stop (:func:`stop_of`), stop strings and no tokenizer in ``base_dir`` to match them with,
            ``topk_prompt_logprobs`` over :data:`MAX_TOPK`, or a field this sampler does not serve.
    """
    from app.api.errors import BadRequest

    tok = tokenizer_of(base_dir)
    stop = stop_of(req.sampling_params.stop, eos_ids(config, tok, vocab))
    if stop.strings and tok is None:
        raise BadRequest("the served base model has no tokenizer to match stop strings with: send token ids")
    if not 0 <= req.topk_prompt_logprobs <= MAX_TOPK:
        raise BadRequest(f"topk_prompt_logprobs must be 0..{MAX_TOPK}")
    unserved = [f for f in ("topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k",
                            "prompt_logprobs_last_n") if getattr(req, f)]
    if unserved:
        raise BadRequest(f"{', '.join(unserved)}: not served")
    return stop


def generate(model: Any, prompt: list[int], *, max_tokens: int, temperature: float, top_k: int, top_p: float,
             stop: Stop, decode: Callable[[list[int]], str], generator: Any,
             device: str) -> tuple[list[int], list[float], bool]:
    """(tokens, logprobs, stopped): up to ``max_tokens`` tokens after ``prompt`` (KV cache); ``decode`` turns the
    sampled tokens into the text stop strings are looked for in."""
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
        if tok in stop.tokens or (stop.strings and any(x in decode(tokens) for x in stop.strings)):
            return tokens, logprobs, True  # the first occurrence: the text before this token held none
        # the position named: Unsloth's one-token decode step needs it (transformers derives the same from the cache)
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=out.past_key_values,
                    position_ids=torch.tensor([[len(prompt) + len(tokens) - 1]], device=device), use_cache=True)
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


def score_prompt(model: Any, prompt: list[int], device: str, topk: int = 0) -> tuple[list[float], Any]:
    """log p(prompt[i] | prompt[:i]) for every position, NaN at position 0 (no context); and with ``topk`` > 0 the
    ``topk`` most probable (token ids, logprobs) per position, most probable first, as two ``(len(prompt), k)``
    arrays (position 0: token 0 and ``MASK_LOGPROB``, the SDK's mark of a position without them), else None."""
    import numpy as np
    import torch

    logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0].float()
    all_lp = torch.log_softmax(logits[:-1], dim=-1)
    lp = all_lp.gather(1, torch.tensor(prompt[1:], device=device)[:, None])[:, 0]
    top = None
    if topk > 0:
        k = min(topk, all_lp.shape[-1])
        values, ids = torch.topk(all_lp, k, dim=-1)
        top = (np.concatenate([np.zeros((1, k), np.int32), ids.cpu().numpy().astype(np.int32)]),
               np.concatenate([np.full((1, k), MASK_LOGPROB, np.float32), values.cpu().numpy().astype(np.float32)]))
    return [math.nan, *lp.cpu().tolist()], top


def run(model: Any, prompt: list[int], *, num_samples: int, max_tokens: int, temperature: float, top_k: int,
        top_p: float, seed: int | None, stop: Stop, prompt_logprobs: bool, topk_prompt_logprobs: int = 0,
        decode: Callable[[list[int]], str], device: str) -> bytes:
    """The ``SampleResponse`` protobuf of ``num_samples`` sequences drawn one after another from one generator
    seeded with ``seed`` (None: a random seed), so the same request with the same seed to the same server gets the
    same tokens; with the prompt's logprobs and their top ``topk_prompt_logprobs`` when asked."""
    import torch

    from app.api import wire

    gen = torch.Generator(device="cpu").manual_seed(seed if seed is not None else secrets.randbelow(MAX_SEED))
    with torch.no_grad():
        seqs = [generate(model, prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         stop=stop, decode=decode, generator=gen, device=device) for _ in range(num_samples)]
        plp, top = score_prompt(model, prompt, device, topk_prompt_logprobs) \
            if prompt_logprobs or topk_prompt_logprobs else (None, None)
    return wire.sample_response(seqs, plp if prompt_logprobs else None, top)


@functools.lru_cache(maxsize=4)
def tokenizer_of(base_dir: str) -> Any:
    """The tokenizer in a base model directory (loaded once), or None when the directory has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(base_dir)
    except (OSError, ValueError):  # no tokenizer files there
        return None


def eos_ids(config: Any, tokenizer: Any, vocab: int) -> frozenset[int]:
    """The end-of-sequence token ids of a model: its configuration's, and its tokenizer's when it has one."""
    ids = getattr(config, "eos_token_id", None)
    out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in out if 0 <= int(i) < vocab)
