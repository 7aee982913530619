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
import itertools
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


Sequence = tuple[list[int], list[float], bool]  # tokens, their logprobs, stopped (else: max_tokens reached)


@dataclass
class Draw:
    """One sample request, as :func:`generate_many` decodes it: ``num_samples`` sequences of up to ``max_tokens``
    tokens after ``prompt``, sampled with its own settings from its own ``generator``; ``adapter``: the LoRA adapter
    its rows run through in a batch of several draws (None: the base model's, ``generate_many``'s ``base``)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: Stop
    decode: Callable[[list[int]], str]  # a sequence's tokens -> the text stop strings are looked for in
    generator: Any
    adapter: str | None = None


Route = Callable[[list[tuple[str, int, int]]], Any]  # (adapter, first row, end row) segments -> a context manager


def generate_many(model: Any, draws: list[Draw], device: str, base: str = "__base__",
                  route: Route | None = None) -> list[list[Sequence]]:
    """Every draw's sequences, decoded as one batch, a row a sequence: each step samples one token for every row
    still going (its draw's temperature and transformers' top-k and top-p warpers; its draw's generator, one draw a
    row in row order), and a row that stops (a stop token or string, or its draw's ``max_tokens``) leaves the batch.

    One draw: its prompt runs once and its KV cache is shared by its rows, through the active adapter. Several: the
    prompts are left-padded to one length (masked), and each row runs through its draw's adapter: ``route(segments)``
    (each draw's rows, a contiguous run, with its adapter) is entered around every forward when given, else PEFT's
    mixed-adapter batches (``adapter_names``); ``base``: the name that stands for no adapter. A draw's tokens depend
    only on its own settings and generator, but its logits on the batch it shares (padding, other rows), so a draw
    that must reproduce exactly is decoded alone.
    """
    import torch

    owner = [(d, i) for d, draw in enumerate(draws) for i in range(draw.num_samples)]  # each row's draw and sample
    seqs: list[list[Sequence]] = [[([], [], False) for _ in range(draw.num_samples)] for draw in draws]
    live = [True] * len(owner)  # a row that stopped stays in a batch whose cache cannot drop rows, unread
    mixed = len(draws) > 1

    def forward(**kw: Any) -> Any:  # each row through its draw's adapter (several draws)
        if not mixed:
            return model(**kw)
        if route is None:
            return model(**kw, adapter_names=[draws[d].adapter or base for d, _ in owner])
        segments, start = [], 0
        for d, rows in itertools.groupby(owner, key=lambda row: row[0]):
            end = start + len(list(rows))
            segments.append((draws[d].adapter or base, start, end))
            start = end
        with route(segments):
            return model(**kw)

    if not mixed:
        prompt, n = draws[0].prompt, draws[0].num_samples
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        cache, logits, mask = out.past_key_values, out.logits[:, -1].float(), None
        if n > 1 and hasattr(cache, "batch_repeat_interleave"):  # transformers' caches: one prefill, copied per row
            cache.batch_repeat_interleave(n)
            logits = logits.expand(n, -1)
        elif n > 1:  # a backend's own cache: the prompt run for every row
            out = model(input_ids=torch.tensor([prompt] * n, device=device), use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        pos = torch.full((n,), len(prompt) - 1, device=device)
    else:
        width = max(len(draw.prompt) for draw in draws)
        pads = [width - len(draws[d].prompt) for d, _ in owner]
        ids = torch.tensor([[0] * pad + draws[d].prompt for pad, (d, _) in zip(pads, owner, strict=True)],
                           device=device)
        mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in pads], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits, pos = out.past_key_values, out.logits[:, -1].float(), positions[:, -1]
    warps = {(d.temperature, d.top_k, d.top_p): _warpers(d.temperature, d.top_k, d.top_p) for d in draws}
    while True:
        tok = torch.empty(len(owner), dtype=torch.long, device=logits.device)
        chosen = torch.empty(len(owner), device=logits.device)
        runs, start = [], 0  # (draw, first row, end row): a draw's rows are contiguous
        for d, rows in itertools.groupby(owner, key=lambda row: row[0]):
            runs.append((d, start, start + len(list(rows))))
            start = runs[-1][2]
        for settings, warp in warps.items():  # the draws that sample alike share one softmax and one warp
            mine = [(d, a, b) for d, a, b in runs if (draws[d].temperature, draws[d].top_k, draws[d].top_p) == settings]
            if not mine:
                continue
            at = torch.cat([torch.arange(a, b, device=logits.device) for _d, a, b in mine])
            temperature = settings[0]
            lp = torch.log_softmax(logits[at] / temperature if temperature > 0 else logits[at], dim=-1)
            if temperature <= 0:  # the distribution sampled from, and the token
                t = lp.argmax(dim=-1)
            else:
                probs, t, first = torch.softmax(warp(lp), dim=-1).cpu(), torch.empty(len(at), dtype=torch.long), 0
                for d, a, b in mine:  # each draw from its own generator, its rows in order
                    t[first:first + b - a] = torch.multinomial(probs[first:first + b - a], 1,
                                                               generator=draws[d].generator)[:, 0]
                    first += b - a
                t = t.to(lp.device)
            tok[at] = t
            chosen[at] = lp.gather(1, t[:, None])[:, 0]
        chosen = chosen.tolist()
        for row, ((d, i), t) in enumerate(zip(owner, tok.tolist(), strict=True)):
            if not live[row]:
                continue
            draw, (tokens, logprobs, _) = draws[d], seqs[d][i]
            tokens.append(t)
            logprobs.append(chosen[row])
            if t in draw.stop.tokens or (draw.stop.strings and any(x in draw.decode(tokens) for x in draw.stop.strings)):
                seqs[d][i], live[row] = (tokens, logprobs, True), False  # the text before this token held none
            elif len(tokens) == draw.max_tokens:
                live[row] = False
        going = [row for row, alive in enumerate(live) if alive]
        if not going:
            return seqs
        if len(going) < len(owner) and hasattr(cache, "batch_select_indices"):  # stopped rows leave the batch
            keep = torch.tensor(going, device=tok.device)
            cache.batch_select_indices(keep)
            tok, pos = tok[keep], pos[keep]
            mask = mask[keep] if mask is not None else None
            owner, live = [owner[row] for row in going], [True] * len(going)
        pos = pos + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((len(owner), 1))], dim=-1)
        # each row names its position: Unsloth's one-token decode step needs it (transformers derives the same)
        out = forward(input_ids=tok[:, None], past_key_values=cache, use_cache=True, position_ids=pos[:, None],
                      **({"attention_mask": mask} if mask is not None else {}))
        cache, logits = out.past_key_values, out.logits[:, -1].float()


def _warpers(temperature: float, top_k: int, top_p: float) -> Callable[[Any], Any]:
    """transformers' top-k then top-p warpers (over log-probabilities already divided by the temperature), called
    in turn (what ``LogitsProcessorList`` does, without its per-call signature inspection)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    warpers = ([TopKLogitsWarper(top_k)] if top_k > 0 else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])

    def warp(scores: Any) -> Any:
        for w in warpers:
            scores = w(None, scores)
        return scores
    return warp


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
    """The ``SampleResponse`` protobuf of one request decoded alone (:func:`draw_of`, :func:`generate_many`,
    :func:`respond`): the same request with the same seed to the same server gets the same tokens."""
    import torch

    draw = draw_of(prompt, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, seed=seed, stop=stop, decode=decode)
    with torch.no_grad():
        seqs = generate_many(model, [draw], device)[0]
    return respond(model, prompt, seqs, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
                   device=device)


def draw_of(prompt: list[int], *, num_samples: int, max_tokens: int, temperature: float, top_k: int, top_p: float,
            seed: int | None, stop: Stop, decode: Callable[[list[int]], str], adapter: str | None = None) -> Draw:
    """A request's :class:`Draw`, its generator seeded with ``seed`` (None: a random seed)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed if seed is not None else secrets.randbelow(MAX_SEED))
    return Draw(prompt, num_samples, max_tokens, temperature, top_k, top_p, stop, decode, gen, adapter)


def respond(model: Any, prompt: list[int], seqs: list[Sequence], *, prompt_logprobs: bool, topk_prompt_logprobs: int,
            device: str) -> bytes:
    """The ``SampleResponse`` protobuf of a request's sequences, with the prompt's logprobs and their top
    ``topk_prompt_logprobs`` when asked (scored through ``model`` as it is: its adapter active)."""
    import torch

    from app.api import wire

    with torch.no_grad():
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
