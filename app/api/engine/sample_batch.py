"""Sample requests decoded on the engine's thread: one alone, or several waiting ones (other prompts, other sampler
checkpoints, other tenants) as one batch (:func:`app.api.engine.sampling.generate_many`), each row through its own LoRA
adapter (the packed pass's routed LoRA layers, :func:`app.api.engine.packed.routed`, each draw's rows a segment).

A request without a seed may join a batch (the service marks it ``joins``); one with a seed decodes alone, so the
same request with the same seed to the same server gets the same tokens whatever else is waiting: in a batch its
logits would depend, in their last bits, on the rows it shares. Only the transformers + PEFT backend batches (PEFT's
mixed-adapter forward); Unsloth decodes each request alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.api.engine import packed, sampling

MAX_SAMPLERS = 8  # sampler checkpoints kept loaded as adapters (app.api.engine.worker.SAMPLE_JOBS: one batch fits)


@dataclass(eq=False)
class SampleItem:
    """One sample request as the engine decodes it."""

    checkpoint: Callable[[], AbstractContextManager[Path | None]]  # its sampler checkpoint while it decodes (None: base)
    prompt: list[int]
    params: dict[str, Any] = field(default_factory=dict)  # num_samples, max_tokens, temperature, top_k, top_p, seed,
    # stop, prompt_logprobs, topk_prompt_logprobs (app.api.engine.sampling.run's keywords)
    joins: bool = False  # may decode in a batch with other waiting requests (no seed)
    who: str = ""  # the sampler it comes from (a tenant's sampling session): a batch waits briefly for active ones


def request_item(req: Any, engine: Any, limits: Any, checkpoint: Callable[[], Any], who: str = "") -> SampleItem:
    """A ``SampleRequest`` (from sampler ``who``) checked against the server's limits and the base model, as the
    engine decodes it.

    Raises:
        BadRequest: a non-token prompt chunk, ``max_tokens``, the prompt's length or ``num_samples`` out of range, a
            token id outside the vocabulary, or sampling settings the sampler cannot honour.
    """
    from app.api.errors import BadRequest

    if any(getattr(chunk, "tokens", None) is None for chunk in req.prompt.chunks):
        raise BadRequest("only token (encoded_text) prompt chunks are served")
    prompt = [t for chunk in req.prompt.chunks for t in chunk.tokens]
    p = req.sampling_params
    max_tokens = p.max_tokens if p.max_tokens is not None else 16
    if not 1 <= max_tokens <= limits.max_sample_tokens:
        raise BadRequest(f"max_tokens {max_tokens} is outside 1..{limits.max_sample_tokens}")
    if not 1 <= len(prompt) <= limits.max_seq_len - max_tokens:
        raise BadRequest(f"prompt of {len(prompt)} tokens (+ max_tokens) exceeds {limits.max_seq_len}")
    if any(not 0 <= t < engine.vocab for t in prompt):
        raise BadRequest(f"a prompt token id is outside the vocabulary (0..{engine.vocab - 1})")
    if not 1 <= req.num_samples <= 16:
        raise BadRequest("num_samples must be 1..16")
    stop = sampling.check_request(req, str(engine.base_dir), engine.model.config, engine.vocab)
    return SampleItem(checkpoint, prompt, dict(
        num_samples=req.num_samples, max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        seed=p.seed, stop=stop, prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs), joins=p.seed is None, who=who)  # a seed: decoded alone


def adapter_of(engine: Any, src: Path, keep: set[str]) -> str:
    """The adapter of the sampler checkpoint at ``src``, loaded once; a full cache evicts its oldest adapter that is
    not in ``keep`` (the adapters of the batch being assembled)."""
    adapter = engine.samplers.get(str(src))
    if adapter is not None:
        return adapter
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    if len(engine.samplers) >= MAX_SAMPLERS:
        oldest = next(path for path, name in engine.samplers.items() if name not in keep)
        engine.model.delete_adapter(engine.samplers.pop(oldest))
        engine._changed()
    adapter = f"s{next(engine._names)}"
    engine.model.add_adapter(adapter, LoraConfig.from_pretrained(str(src)))
    engine._changed()
    set_peft_model_state_dict(engine.model, load_file(str(src / "adapter_model.safetensors")), adapter_name=adapter)
    engine.samplers[str(src)] = adapter
    return adapter


def _decode_of(engine: Any, params: dict[str, Any]) -> Callable[[list[int]], str]:
    """What stop strings are matched on: the base model's tokenizer (checked to exist when the request came in)."""
    return sampling.tokenizer_of(str(engine.base_dir)).decode if params["stop"].strings else str


def decode_alone(engine: Any, src: Path | None, prompt: list[int], params: dict[str, Any]) -> bytes:
    """:func:`app.api.engine.sampling.run` on the base, or through the sampler checkpoint at ``src``."""
    adapter = adapter_of(engine, src, set()) if src is not None else None
    engine._activate(adapter or engine.placeholder, False)
    return sampling.run(engine.net, prompt, decode=_decode_of(engine, params), device=engine.device, **params)


def decode_together(engine: Any, items: list[SampleItem]) -> None:
    """Decode ``items`` as one batch; each one's ``SampleResponse`` (or its refusal) is kept in ``engine._ready``
    for its job. Raises only what fails the batch as a whole (its jobs then decode alone)."""
    draws, adapters = [], []
    with contextlib.ExitStack() as stack:
        for item in items:
            src = stack.enter_context(item.checkpoint())
            adapter = adapter_of(engine, src, set(filter(None, adapters))) if src is not None else None
            adapters.append(adapter)
            keys = ("num_samples", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop")
            draws.append(sampling.draw_of(item.prompt, decode=_decode_of(engine, item.params), adapter=adapter,
                                          **{k: item.params[k] for k in keys}))
        engine._mode(False)
        import torch

        route = packed.RowRouter(engine.lora_layers()).route if engine.packed else None
        with torch.no_grad():
            seqs = sampling.generate_many(engine.net, draws, engine.device, route=route)
        for item, adapter, got in zip(items, adapters, seqs, strict=True):
            if item.params["prompt_logprobs"] or item.params.get("topk_prompt_logprobs", 0):
                engine._activate(adapter or engine.placeholder, False)  # the prompt is scored through its adapter
            engine._ready[id(item)] = sampling.respond(
                engine.net, item.prompt, got, prompt_logprobs=item.params["prompt_logprobs"],
                topk_prompt_logprobs=item.params.get("topk_prompt_logprobs", 0), device=engine.device)
