"""Packed passes against ops run alone, over random mixes (Hypothesis): every model of a pass ends exactly where a
twin that ran the same op alone ends — the same outputs and metrics, or the same refusal; the same gradient bits
(NaN included), op-chain head, op count and pending count; after an optimizer step, the same weights. The ops mix
every built-in loss, valid and invalid loss settings, forward-only ops, datums of 1 to 40 tokens, and inputs that
are NaN, infinite or huge, on models of different ranks and targets that already hold a pending gradient.

This is what ``verify --ops --replay`` relies on: it replays one client's ops alone and must reach the weights the
server reached in shared passes, bit for bit on a CPU. One run from a fixed seed, one from a random seed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api_inproc import ADAM

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
VALUES = st.sampled_from([1.0, -0.5, 0.0, 2.0, 1e6, -3e38, 3e38, math.nan, math.inf, -math.inf])
CONFIGS = st.sampled_from([None, {"clip_low_threshold": 0.5}, {"clip_high_threshold": 0.1}, {"beta": 0.3},
                           {"beta": math.nan}, {"surprise": 1.0}])
LORAS = st.sampled_from([{"rank": 8, "train_attn": True, "train_mlp": True, "train_unembed": True},
                         {"rank": 4, "train_attn": True, "train_mlp": False, "train_unembed": False},
                         {"rank": 2, "train_attn": False, "train_mlp": True, "train_unembed": True}])


@st.composite
def op_specs(draw: Any) -> dict[str, Any]:
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    hostile = draw(st.booleans())  # most datums plain; some with one value that is NaN, infinite or huge
    return {"loss": draw(st.sampled_from(LOSSES)), "config": draw(CONFIGS), "forward_only": draw(st.booleans()),
            "lengths": lengths, "seed": draw(st.integers(0, 2 ** 16)), "lora": draw(LORAS),
            "odd": draw(VALUES) if hostile else None, "odd_key": draw(st.sampled_from(["weights", "logprobs",
                                                                                         "advantages"]))}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Any]:
    from app.api.engine.engine import Engine

    e = Engine(tiny_model)
    yield e
    e.stop()


def _op(spec: dict[str, Any], model_id: str) -> Any:
    from app.api import wire

    rng = np.random.default_rng(spec["seed"])
    data = []
    for n in spec["lengths"]:
        t = rng.integers(3, 700, n + 1).tolist()
        inputs = {"target_tokens": np.asarray(t[1:], dtype="int64"),
                  "weights": rng.uniform(0, 1, n).astype("float32"),
                  "logprobs": -rng.uniform(0.1, 8, n).astype("float32"),
                  "advantages": rng.normal(0, 1, n).astype("float32")}
        if spec["odd"] is not None:
            inputs[spec["odd_key"]][rng.integers(0, n)] = spec["odd"]
        data.append(wire.Datum(t[:-1], inputs))
    return wire.Op(model_id, spec["loss"], spec["forward_only"], data, spec["config"])


def _attempt(fn: Any, *args: Any) -> Any:
    """``fn(*args)``'s result, or the exception that refused it (the refusal is the outcome compared)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return exc


def _bits(t: Any) -> Any:
    """A float32 tensor's bits (NaN equals NaN only when the bits do)."""
    import torch

    return None if t is None else t.detach().view(torch.int32).clone()


def _state(engine: Any, model_id: str) -> tuple[Any, ...]:
    m = engine.models[model_id]
    return m.op_head, m.ops, m.pending, m.tokens_seen


def _same_outcome(a: Any, b: Any) -> bool:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a) is type(b) and str(a) == str(b)
    (outs_a, metrics_a), (outs_b, metrics_b) = a, b
    same_metrics = metrics_a.keys() == metrics_b.keys() and all(
        np.array_equal(np.float64(metrics_a[k]), np.float64(metrics_b[k]), equal_nan=True) for k in metrics_a)
    return same_metrics and len(outs_a) == len(outs_b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=True) for k in x)
        for x, y in zip(outs_a, outs_b))


_names = itertools.count()


def _check(engine: Any, specs: list[dict[str, Any]]) -> None:
    import torch

    assert engine.packed
    pairs = []
    for spec in specs:
        n = next(_names)
        lora = dict(spec["lora"], seed=spec["seed"] % 5)
        pairs.append((engine.create(f"packed{n}", lora).id, engine.create(f"alone{n}", lora).id))
    try:
        for i, (packed_id, alone_id) in enumerate(pairs):  # each model already holds a pending gradient
            warm = {"loss": "cross_entropy", "config": None, "forward_only": False, "lengths": [7], "seed": i,
                    "odd": None}
            for mid in (packed_id, alone_id):
                engine.forward_backward(_op(warm, mid))
        ops = [_op(spec, p) for spec, (p, _a) in zip(specs, pairs)]
        engine._batch(ops)  # one packed pass, as the worker runs ops waiting together
        packed = [_attempt(engine.forward_backward, op) for op in ops]
        alone = [_attempt(engine.forward_backward, _op(spec, a)) for spec, (_p, a) in zip(specs, pairs)]
        for spec, (p, a), got, want in zip(specs, pairs, packed, alone):
            assert _same_outcome(got, want), (spec, got, want)
            assert _state(engine, p) == _state(engine, a), spec
            grads = [(_bits(x.grad), _bits(y.grad)) for x, y in zip(engine._params(engine.models[p].adapter),
                                                                       engine._params(engine.models[a].adapter))]
            assert all((x is None) == (y is None) and (x is None or torch.equal(x, y)) for x, y in grads), spec
        for p, a in pairs:
            results = [_attempt(engine.optim_step, mid, ADAM) for mid in (p, a)]  # refused alike
            assert type(results[0]) is type(results[1])
            weights = [(_bits(x), _bits(y)) for x, y in zip(engine._params(engine.models[p].adapter),
                                                             engine._params(engine.models[a].adapter))]
            assert all(torch.equal(x, y) for x, y in weights)
            assert _state(engine, p)[:3] == _state(engine, a)[:3]
    finally:
        for p, a in pairs:
            engine.discard(p)
            engine.discard(a)


SPECS = st.lists(op_specs(), min_size=2, max_size=4)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-seed", "random-seed"])
def test_a_packed_pass_leaves_every_model_where_its_op_alone_does(engine: Any, fixed: bool) -> None:
    @settings(max_examples=30 if fixed else 12, derandomize=fixed, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(SPECS)
    def run(specs: list[dict[str, Any]]) -> None:
        _check(engine, specs)

    run()


def test_rows_min_is_where_this_cpus_matrix_kernels_stop_depending_on_the_row_count() -> None:
    """The premise of the padding, on this machine's kernels: from ``rows_min`` rows on, a row of a linear map has
    the same bits whatever the rows beside it; with one row fewer, it does not (so padding is what makes a short op
    packed with others reach the bits it reaches alone)."""
    import torch
    from torch.nn.functional import linear

    from app.api.engine import packed

    rows = packed.rows_min(torch.get_num_threads())
    assert rows is not None and 1 <= rows <= 128
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g), torch.randn(200, 64, generator=g)
    whole = linear(x, w)
    for n in range(rows, rows + 40):
        for start in (0, 2, 9):
            assert torch.equal(linear(x[start:start + n], w), whole[start:start + n]), (n, start)
    if rows > 1:
        assert any(not torch.equal(linear(x[s:s + rows - 1], w), whole[s:s + rows - 1]) for s in (0, 1, 5))


@pytest.mark.parametrize("value", [True, -1, 129, "4", 10 ** 9, 2.0])
def test_a_replay_refuses_a_pass_rows_that_is_not_a_row_count(value: Any) -> None:
    from app.api.proof import replay

    assert replay.pass_rows({}) is None and replay.pass_rows({"pass_rows": 0}) == 0
    assert replay.pass_rows({"pass_rows": 16}) == 16
    with pytest.raises(replay.ReplayFailed, match="pass_rows .* is not a row count in \\[0, 128\\]"):
        replay.pass_rows({"pass_rows": value})


def test_a_replay_pads_as_far_as_the_bundle_says_and_not_at_all_for_a_bundle_that_does_not_say(
        engine: Any, tiny_model: Path) -> None:
    """A bundle made before passes were padded (no ``pass_rows``) replays unpadded, as its server computed; one that
    records it replays padded: each reaches its own server's weights bit for bit, and on this CPU they differ."""
    import torch

    from attestation.bundle import manifest as B

    from app.api.proof import replay
    from app.api import wire
    from app.config.api import ApiSettings
    from tests.api_inproc import fb_record

    records = [fb_record([[5, 9]]), {"op": "optim_step", "adam_params": dict(ADAM)},
               fb_record([[7, 11, 13], [4, 4]]), {"op": "optim_step", "adam_params": dict(ADAM)}]
    lora = {"rank": 4, "seed": 3, "train_attn": True, "train_mlp": True, "train_unembed": False}
    made = {}
    for rows in (1, engine.pad_rows):
        engine.pad_rows, before = rows, engine.pad_rows
        try:
            m = engine.create(f"old-server-{rows}", lora)
            for r in records:
                if r["op"] == "optim_step":
                    engine.optim_step(m.id, ADAM)
                else:  # the op exactly as a replay parses it, for this model
                    op = replay.server_op(r, {}, engine.vocab, ApiSettings())
                    engine.forward_backward(wire.Op(m.id, op.loss_fn, op.forward_only, op.data, op.loss_fn_config))
            made[rows] = (m.op_head, engine.adapter_bytes(m))
        finally:
            engine.pad_rows = before
    for recorded, rows in ((None, 1), (engine.pad_rows, engine.pad_rows)):
        head, weights = made[rows]
        oc = B.OpChainInfo(head=head, ops=len(records), optimizer_steps=2, checkpoint="tinker://x", lora=lora)
        got, _tensors = replay._run(tiny_model, oc, records, "cvm-tune/tiny-llama", lambda _m: None, recorded)
        assert got == weights, (recorded, rows)
    assert engine.pad_rows == 1 or made[1][1] != made[engine.pad_rows][1]
