"""Several sample requests decoded as one batch (``app.api.engine.sampling.generate_many``): prompts of different lengths,
each row through its own LoRA adapter (or none), each request with its own settings, stops and generator. Each
request gets what it gets decoded alone: the same greedy tokens and the same sampled tokens from the same seed, with
log-probabilities equal to float tolerance (the batch's padding changes the last bits, never the tokens here); a
request that stops early leaves the others going; and ``num_samples`` rows of one request decode as one batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

PROMPTS = {"a": [5, 17, 42, 9, 3], "b": [7, 1, 300, 44, 12, 9, 18, 250, 3], "base": [100, 2]}


def _with_adapters(tiny_model: Path, configs: dict[str, dict[str, Any]], seed: int) -> Any:
    """The tiny base with LoRA adapters ``{name: LoraConfig keywords}`` of random, non-zero weights (a fresh LoRA is
    zero), in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    (first, kw), *rest = configs.items()
    net = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model)), LoraConfig(**kw), adapter_name=first)
    for name, kw in rest:
        net.add_adapter(name, LoraConfig(**kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return net.eval()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    """Two LoRA adapters ``ta`` and ``tb``."""
    same = {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    return _with_adapters(tiny_model, {"ta": same, "tb": same}, seed=0)


def _draw(name: str, seed: int, **kw: Any) -> Any:
    import torch

    from app.api.engine.sampling import Draw, Stop

    settings = {"num_samples": 2, "max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "stop": Stop(),
                **kw}
    return Draw(PROMPTS[name], decode=str, generator=torch.Generator().manual_seed(seed),
                adapter=None if name == "base" else f"t{name}", **settings)


def _alone(model: Any, draw: Any) -> list[Any]:
    """The draw decoded by itself, through its adapter (the base: adapters off)."""
    import contextlib

    import torch

    from app.api.engine.sampling import generate_many

    with torch.no_grad():
        if draw.adapter is None:
            with model.disable_adapter():
                return generate_many(model, [draw], "cpu")[0]
        model.set_adapter(draw.adapter)
        with contextlib.nullcontext():
            return generate_many(model, [draw], "cpu")[0]


def _together(model: Any, draws: list[Any]) -> list[list[Any]]:
    import torch

    from app.api.engine.sampling import generate_many

    with torch.no_grad():
        return generate_many(model, draws, "cpu")


def _same(batched: list[Any], alone: list[Any]) -> None:
    assert [(t, stopped) for t, _lp, stopped in batched] == [(t, stopped) for t, _lp, stopped in alone]
    for (_t, lp_b, _s), (_t2, lp_a, _s2) in zip(batched, alone, strict=True):
        assert lp_b == pytest.approx(lp_a, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_request_in_a_batch_gets_what_it_gets_alone(model: Any, temperature: float) -> None:
    names = ("a", "b", "base")
    batched = _together(model, [_draw(n, seed=i, temperature=temperature) for i, n in enumerate(names)])
    for i, n in enumerate(names):
        _same(batched[i], _alone(model, _draw(n, seed=i, temperature=temperature)))
    assert batched[0] != batched[1]  # the adapters differ, and so do their tokens


def test_a_request_that_stops_early_leaves_the_others_going(model: Any) -> None:
    from app.api.engine.sampling import Stop

    greedy_a = _alone(model, _draw("a", seed=0, temperature=0.0, num_samples=1))[0][0]
    stop_a = Stop(tokens=frozenset({greedy_a[2]}))  # a's third greedy token ends a at once
    draws = [_draw("a", seed=0, temperature=0.0, num_samples=1, stop=stop_a),
             _draw("b", seed=1, temperature=0.0, num_samples=1, max_tokens=9),
             _draw("base", seed=2, temperature=1.0, top_k=5, top_p=0.9)]
    batched = _together(model, draws)
    stopped_at = greedy_a.index(greedy_a[2]) + 1
    assert batched[0] == [(greedy_a[:stopped_at], batched[0][0][1], True)]
    assert len(batched[1][0][0]) == 9 and batched[1][0][2] is False
    for got, draw in zip(batched[1:], draws[1:], strict=True):
        _same(got, _alone(model, _draw(("b", "base")[draws.index(draw) - 1], seed=draws.index(draw),
                                       temperature=draw.temperature, num_samples=draw.num_samples,
                                       max_tokens=draw.max_tokens, top_k=draw.top_k, top_p=draw.top_p)))


def test_the_samples_of_one_request_are_one_batch_and_reproduce(model: Any) -> None:
    model.set_adapter("ta")
    one = _together(model, [_draw("a", seed=7, num_samples=8)])[0]
    again = _together(model, [_draw("a", seed=7, num_samples=8)])[0]
    assert one == again and len({tuple(t) for t, _lp, _s in one}) > 1  # same seed, same tokens; rows differ


# ---- the server: waiting requests without a seed decode together; a seeded one decodes alone -------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The in-process service with two trained checkpoints of one key (their adapters differ from the base's)."""
    from tests.api_inproc import Client, fb_record, service

    with service(tmp_path_factory.mktemp("sampling-batch"), "api:\n  max_sample_tokens: 16\n") as svc:
        client = Client(svc)
        paths = []
        for seed in (1, 2):
            model = client.create(rank=4, seed=seed)
            assert client.forward_backward(model, fb_record([[5, 17, 42, 9, 3, 8]]))[0]
            assert client.optim_step(model, {"learning_rate": 0.05})[0]
            paths.append(client.save(model, f"m{seed}")[0])
        yield svc, paths


def _queue(svc: Any, model_path: str | None, seed: int | None) -> dict[str, Any]:
    from tinker import types

    from tests.api_inproc import BASE, OWNER

    req = types.SampleRequest(prompt=types.ModelInput.from_ints(PROMPTS["b"] if model_path else PROMPTS["a"]),
                              num_samples=2, base_model=BASE if model_path is None else None, model_path=model_path,
                              sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0, stop=[], seed=seed))
    return svc.sample(OWNER, req)


def _tokens(svc: Any, fut: dict[str, Any]) -> list[list[int]]:
    from tinker.proto.response_conv import deserialize_sample_response

    from tests.api_inproc import wait

    ok, body = wait(svc, fut)
    assert ok, body
    return [list(s.tokens) for s in deserialize_sample_response(body).sequences]


def _behind_a_busy_engine(svc: Any, submit: Any) -> list[dict[str, Any]]:
    """Queue requests while the engine is busy, so that they are all waiting when it takes the next job."""
    import threading

    go = threading.Event()
    svc.engine.submit(lambda: go.wait(30))
    try:
        return submit()
    finally:
        go.set()


def test_waiting_requests_without_a_seed_decode_as_one_batch_each_through_its_adapter(served: Any) -> None:
    svc, (m1, m2) = served
    alone = {path: _tokens(svc, _queue(svc, path, seed=0)) for path in (m1, m2, None)}  # seeded: decoded alone
    before = dict(svc.engine.batching)
    futs = _behind_a_busy_engine(svc, lambda: [_queue(svc, path, seed=None) for path in (m1, m2, None)])
    got = {path: _tokens(svc, fut) for path, fut in zip((m1, m2, None), futs, strict=True)}
    after = svc.engine.batching
    assert after["sample_batches"] == before["sample_batches"] + 1
    assert after["batched_samples"] == before["batched_samples"] + 3
    assert got == alone  # greedy: each request's tokens are its own adapter's
    assert alone[m1] != alone[m2] != alone[None]


def test_a_request_with_a_seed_decodes_alone(served: Any) -> None:
    svc, (m1, m2) = served
    before = dict(svc.engine.batching)
    futs = _behind_a_busy_engine(svc, lambda: [_queue(svc, path, seed=3) for path in (m1, m2, None)])
    for fut in futs:
        assert len(_tokens(svc, fut)) == 2
    assert svc.engine.batching["sample_batches"] == before["sample_batches"]


@pytest.fixture(scope="module")
def mixed(tiny_model: Path) -> Any:
    """Adapters of other ranks and targets, one with a LoRA bias (decoded by the per-segment path)."""
    return _with_adapters(tiny_model, {"ta": {"r": 2, "target_modules": ["q_proj", "v_proj"]},
                                       "tb": {"r": 8, "target_modules": ["q_proj", "down_proj", "up_proj"]},
                                       "tc": {"r": 4, "target_modules": ["v_proj"], "lora_bias": True}}, seed=1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_row_router_gives_each_row_its_own_adapter(mixed: Any, temperature: float) -> None:
    """``packed.RowRouter`` (the engine's decode batches): every adapter in two products a layer, ranks and targets
    mixed, a row without an adapter, and a layer with a LoRA bias: each draw gets what it gets alone."""
    import torch

    from app.api.engine import packed
    from app.api.engine.sampling import generate_many

    def draw(adapter: str | None, seed: int) -> Any:
        d = _draw("b" if adapter else "base", seed, temperature=temperature)
        d.adapter = adapter
        return d

    adapters = ["ta", "tb", None, "tc", "ta"]
    router = packed.RowRouter(packed.lora_layers(mixed))
    with torch.no_grad():
        batched = generate_many(mixed, [draw(a, i) for i, a in enumerate(adapters)], "cpu", route=router.route)
    for i, a in enumerate(adapters):
        _same(batched[i], _alone(mixed, draw(a, i)))
    assert batched[0] != batched[1] != batched[3]
    assert any(getattr(p, "func", None) is packed._routed_forward
               for plan in router._plans.values() for p in plan)  # tc's LoRA bias: that layer per segment
