"""Many tenants, one base model: forward_backward ops of different models that wait together run as one packed
base-model pass (app/api/engine/packed.py, app/api/engine/worker.py). A model trains exactly as it would alone (bit for bit on a
CPU, so ``verify --ops --replay`` of one client's ops, alone, reaches the server's weights), no tenant's tokens or
gradients reach another's model, a refused op in a pass changes nothing, and each model's ops keep their order.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api_inproc import ADAM, OWNER, Client, fb_body, fb_record, service, verify, wait, write_ops

LORA = {"rank": 8, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Any]:
    from app.api.engine.engine import Engine

    e = Engine(tiny_model)
    yield e
    e.stop()


def _op(model_id: str, lengths: list[int], seed: int, loss: str = "cross_entropy", weight: float = 1.0,
        forward_only: bool = False) -> Any:
    from app.api import wire

    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        t = rng.integers(3, 700, n + 1).tolist()
        data.append(wire.Datum(t[:-1], {"target_tokens": np.asarray(t[1:], dtype="int64"),
                                        "weights": np.full(n, weight, dtype="float32")}))
    return wire.Op(model_id, loss, forward_only, data)


def _as(op: Any, model_id: str) -> Any:
    from app.api import wire

    return wire.Op(model_id, op.loss_fn, op.forward_only, op.data, op.loss_fn_config)


def _weights(engine: Any, model_id: str) -> list[Any]:
    return [p.detach().clone() for p in engine._params(engine.models[model_id].adapter)]


def _grads(engine: Any, model_id: str) -> list[Any]:
    return [None if p.grad is None else p.grad.clone() for p in engine._params(engine.models[model_id].adapter)]


def _run(engine: Any, ops: list[Any]) -> list[Any]:
    """The ops as one packed pass (as the worker runs them): each op's result, or the exception that refused it."""
    engine._batch(ops)
    out = []
    for op in ops:
        try:
            out.append(engine.forward_backward(op))
        except Exception as exc:  # noqa: BLE001 - the refusal is the result under test
            out.append(exc)
    return out


def test_a_model_packed_with_others_trains_bit_for_bit_as_alone(engine: Any) -> None:
    import torch

    assert engine.packed
    alone, twin = engine.create("alone", LORA), engine.create("twin", LORA)
    others = [engine.create(f"other{i}", dict(LORA, rank=4 + 4 * i, train_mlp=bool(i % 2), seed=i)) for i in range(3)]
    before = engine.batching["passes"]
    for step in range(3):
        mine = _op("alone", [17, 40, 5], seed=step)  # three datums of three lengths
        (r_alone,) = _run(engine, [mine])
        ops = [_op("other0", [33, 9], 10 + step), _as(mine, "twin"), _op("other1", [50], 20 + step),
               _op("other2", [8, 8, 8], 30 + step)]
        results = _run(engine, ops)
        assert all(not isinstance(r, BaseException) for r in results), results
        r_twin = results[1]
        for a, b in zip(r_alone[0], r_twin[0]):  # the same logprobs, bit for bit
            assert np.array_equal(a["logprobs"], b["logprobs"])
        assert r_alone[1] == r_twin[1]
        assert all(torch.equal(a, b) for a, b in zip(_grads(engine, "alone"), _grads(engine, "twin")))
        for m in ("alone", "twin", *(o.id for o in others)):
            engine.optim_step(m, ADAM)
    assert all(torch.equal(a, b) for a, b in zip(_weights(engine, "alone"), _weights(engine, "twin")))
    assert (alone.op_head, alone.ops, alone.tokens_seen) == (twin.op_head, twin.ops, twin.tokens_seen)
    assert engine.batching["passes"] == before  # _run calls the engine directly; the worker made no pass


def test_the_packed_pass_computes_what_one_datum_at_a_time_does(engine: Any) -> None:
    """The pass against the engine's per-datum path (DP models and the Unsloth backend use it): the same weights
    within float32 rounding."""
    engine.create("per-datum", LORA)
    engine.create("packed", LORA)
    for step in range(3):
        op = _op("per-datum", [17, 40, 5], seed=100 + step)
        engine.packed = False
        try:
            engine.forward_backward(op)
        finally:
            engine.packed = True
        engine.forward_backward(_as(op, "packed"))
        engine.optim_step("per-datum", ADAM)
        engine.optim_step("packed", ADAM)
    diff = max(float((a - b).abs().max()) for a, b in zip(_weights(engine, "per-datum"), _weights(engine, "packed")))
    assert 0 <= diff < 1e-5


def test_no_tenant_reaches_another_and_a_refused_op_changes_nothing(engine: Any) -> None:
    import torch

    for name in ("a", "b", "bad", "unrecordable", "fwd", "idle"):
        engine.create(name, LORA)
    idle_weights = _weights(engine, "idle")
    bad = engine.models["bad"]
    head, ops = bad.op_head, bad.ops
    results = _run(engine, [_op("a", [20], 1), _op("bad", [12], 2, weight=3e38), _op("b", [30], 3),
                            _op("fwd", [25], 4, forward_only=True), _op("unrecordable", [9], 5, weight=float("inf"))])
    from app.api.errors import BadRequest

    assert isinstance(results[1], BadRequest) and "not finite" in str(results[1])  # its loss overflowed
    assert isinstance(results[4], BadRequest) and "cannot be recorded" in str(results[4])
    assert engine.models["unrecordable"].ops == 0 and all(g is None for g in _grads(engine, "unrecordable"))
    assert (bad.op_head, bad.ops, bad.pending) == (head, ops, 0)
    assert all(g is None for g in _grads(engine, "bad"))  # its rows were in the pass; no gradient reached it
    assert all(g is None for g in _grads(engine, "fwd")) and engine.models["fwd"].ops == 0
    assert all(g is None for g in _grads(engine, "idle"))
    assert all(torch.equal(a, b) for a, b in zip(idle_weights, _weights(engine, "idle")))
    # a's and b's gradients are exactly what each gets alone: nothing of the others' tokens reached them
    for name, op in (("a", _op("a", [20], 1)), ("b", _op("b", [30], 3))):
        got = _grads(engine, name)
        engine.create(f"{name}-alone", LORA)
        _run(engine, [_as(op, f"{name}-alone")])
        assert all(torch.equal(x, y) for x, y in zip(got, _grads(engine, f"{name}-alone")))


def test_dp_models_and_oversized_ops_never_join_a_pass(engine: Any) -> None:
    from app.api.engine import packed

    engine.create("dp", LORA, {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "dataset_size": 100, "batch_size": 2,
                               "delta": 1e-5, "steps": 0, "accountant": "rdp"})
    engine.create("plain1", LORA)
    engine.create("plain2", LORA)
    ops = [_op("dp", [10], 1), _op("plain1", [10], 2), _op("plain2", [10], 3)]
    engine._batch(ops)
    assert id(ops[0]) not in engine._ready and id(ops[1]) in engine._ready and id(ops[2]) in engine._ready
    for op in ops[1:]:
        engine.forward_backward(op)
    big = packed.PASS_BYTES // (4 * engine.vocab) + 1
    assert not engine._packs(_op("plain1", [big], 4), engine.models["plain1"])


def test_a_pass_that_runs_out_of_memory_changes_nothing_and_halves_the_pass_budget(engine: Any, monkeypatch:
                                                                                    pytest.MonkeyPatch) -> None:
    """A packed pass the allocator cannot hold (a GPU's CUDA out-of-memory error): no model's gradient or chain
    changed, its ops then run alone as if nothing had happened, and later passes hold at most half of what failed
    (never under a sixteenth of the start budget)."""
    import torch

    from app.api.engine import packed

    for name in ("oom-a", "oom-b", "oom-c", "oom-a-alone"):
        engine.create(name, LORA)
    ops = [_op("oom-a", [20, 7], 1), _op("oom-b", [30], 2), _op("oom-c", [11], 3)]
    real = packed.forward_backward

    def short_of_memory(e: Any, items: list[Any]) -> list[Any]:
        if len(items) > 1:  # a pass of several ops allocates its activations, then the allocator gives up
            e.net(input_ids=torch.tensor([[5, 6, 7]]))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(e, items)

    monkeypatch.setattr(packed, "forward_backward", short_of_memory)
    budget = engine.pass_budget
    heads = [(engine.models[op.model_id].op_head, engine.models[op.model_id].ops) for op in ops]
    try:
        with pytest.raises(torch.OutOfMemoryError):
            engine._batch(ops)
        assert not engine._ready
        assert [(engine.models[op.model_id].op_head, engine.models[op.model_id].ops) for op in ops] == heads
        assert all(g is None for op in ops for g in _grads(engine, op.model_id))
        held = (27 + 30 + 11) * engine.token_bytes
        from app.api.engine.worker import FLOOR_FRACTION

        floor = engine._worker.initial // FLOOR_FRACTION  # never under it (issue 46: it fell to 0 MiB)
        assert engine.pass_budget == max(floor, min(budget, held // 2)) < budget
        results = [engine.forward_backward(op) for op in ops]  # what the worker does next: each op alone
        assert all(engine.models[op.model_id].ops == 1 for op in ops) and len(results) == 3
        engine.forward_backward(_as(ops[0], "oom-a-alone"))
        assert all(torch.equal(a, b) for a, b in zip(_grads(engine, "oom-a"), _grads(engine, "oom-a-alone")))
    finally:
        engine._worker.budget = budget


def test_the_pass_budget_is_half_the_free_memory_and_a_tokens_estimate_covers_what_its_backward_keeps(
        engine: Any) -> None:
    """``token_bytes`` against what a packed pass really keeps for its backward (every tensor autograd saves that is
    not a parameter, each storage once): never less, and not more than twice."""
    import torch

    from app.api.engine import packed

    assert packed.budget(None) == packed.PASS_BYTES and packed.budget(8 << 30) == 4 << 30
    for i in range(4):
        engine.create(f"kept{i}", LORA)
    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ops = [_op(f"kept{i}", [64, 32], 40 + i) for i in range(4)]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        _run(engine, ops)
    per_token = sum(kept.values()) / sum(op.n_tokens for op in ops)
    assert per_token <= engine.token_bytes <= 2 * per_token, (per_token, engine.token_bytes)


# --- the worker's queue ---------------------------------------------------------------------------------------------


def _queued(specs: list[tuple[str, str | None, bool, int, bool]]) -> tuple[list[list[str]], list[str], Any]:
    """Jobs (name, model, a pass op?, cost, ahead?) queued while the worker is held, so that they all wait together,
    then run to the end: the passes made, the order the jobs ran in, and the worker."""
    from app.api.engine.worker import Job, Worker

    passes: list[list[str]] = []
    ran: list[str] = []
    gate, done = threading.Event(), threading.Event()
    w = Worker(lambda ops: passes.append(list(ops)), budget=100)
    w.submit(Job(lambda: gate.wait(10)))
    for name, model, op, cost, ahead in specs:
        w.submit(Job(lambda name=name: ran.append(name), model, name if op else None, cost, ahead))  # type: ignore[misc]
    gate.set()
    w.submit(Job(done.set))
    assert done.wait(10)
    w.stop()
    return passes, ran, w


def test_the_worker_keeps_each_models_order_and_packs_only_first_jobs() -> None:
    passes, ran, w = _queued([("a1", "A", True, 10, False), ("a2", "A", True, 10, False),
                              ("b-save", "B", False, 0, False), ("b1", "B", True, 10, False),
                              ("c1", "C", True, 10, False), ("sample", None, False, 0, False),
                              ("d1", "D", True, 85, False), ("e1", "E", True, 5, False)])
    # a1 takes c1 and e1 along (b1 waits behind B's save, a2 behind a1, d1 would pass the budget)
    assert passes[0] == ["a1", "c1", "e1"]
    assert ran.index("a2") > ran.index("a1") and ran.index("b1") > ran.index("b-save")
    assert sorted(ran) == sorted(["a1", "a2", "b-save", "b1", "c1", "sample", "d1", "e1"])
    assert all(len({op[0] for op in p}) == len(p) for p in passes)  # no model twice in a pass
    assert w.stats["largest"] == 3


def test_an_optimizer_step_goes_before_a_waiting_pass_but_never_before_its_own_models_jobs() -> None:
    passes, ran, _w = _queued([("a1", "A", True, 10, False), ("a-step", "A", False, 0, True),
                               ("b-step", "B", False, 0, True), ("c1", "C", True, 10, False),
                               ("x-save", "X", False, 0, False), ("d-step", "D", False, 0, True)])
    # B's step overtakes the waiting pass; A's waits behind a1; D's never passes X's save (neither pass nor step)
    assert ran == ["b-step", "a1", "c1", "a-step", "x-save", "d-step"]
    assert passes == [["a1", "c1"]]


class _Timeline:
    """Jobs that note when they ran, and clients that submit their next job a while after an answer."""

    def __init__(self) -> None:
        self.ran: dict[str, float] = {}
        self.submitted: dict[str, float] = {}
        self.worker: Any = None

    def job(self, name: str, then: Callable[[], None] = lambda: None, **fields: Any) -> Any:
        import time

        from app.api.engine.worker import Job

        def run() -> None:
            self.ran[name] = time.monotonic()
            then()
        return Job(run, **fields)

    def later(self, delay: float, job: Any, name: str) -> Callable[[], None]:
        import time

        def go() -> None:
            time.sleep(delay)
            self.submitted[name] = time.monotonic()
            self.worker.submit(job)
        return lambda: threading.Thread(target=go, daemon=True).start()

    def until(self, name: str) -> None:
        import time

        deadline = time.monotonic() + 30
        while name not in self.ran and time.monotonic() < deadline:
            time.sleep(0.05)
        self.worker.stop()


def test_the_gather_window_waits_for_models_between_steps_and_never_for_a_lone_one() -> None:
    import time

    from app.api.engine.worker import ACTIVE_S, Job, Worker

    passes: list[list[str]] = []
    gate = threading.Event()
    t = _Timeline()
    t.worker = w = Worker(lambda ops: (passes.append(list(ops)), time.sleep(1.0)), budget=100, wait_s=5.0)  # 1 s pass
    w.submit(Job(lambda: gate.wait(10)))

    def job(name: str, model: str, then: Callable[[], None] = lambda: None) -> Job:
        return t.job(name, then, model=model, op=name, cost=10)

    a4 = job("a4", "A")
    a3 = job("a3", "A", t.later(ACTIVE_S + 0.3, a4, "a4"))  # B's last pass is then long over: A alone, no wait
    b2 = job("b2", "B")
    a2 = job("a2", "A", t.later(0.0, a3, "a3"))
    w.submit(job("a1", "A", t.later(0.0, a2, "a2")))
    w.submit(job("b1", "B", t.later(0.3, b2, "b2")))  # B's client answers 0.3 s after its result
    gate.set()
    t.until("a4")
    assert passes[:2] == [["a1", "b1"], ["a2", "b2"]]  # a2 waited for b2 (B was between two steps)
    assert t.ran["a2"] >= t.submitted["b2"]
    assert t.ran["a3"] - t.submitted["a3"] >= 0.9  # B had just trained: waited, at most as long as the last pass took
    assert t.ran["a4"] - t.submitted["a4"] < 0.5  # no other model active: a lone model never waits
    assert len(passes) == 2


def test_a_sample_batch_waits_for_active_samplers_and_never_for_a_lone_one() -> None:
    """The same window for sample requests that may decode together: a batch waits for the samplers whose last decode
    just ended (tenants sampling in turn fall into one batch), at most as long as the last decode took."""
    import time
    from types import SimpleNamespace

    from app.api.engine.worker import ACTIVE_S, Job, Worker

    batches: list[list[str]] = []
    gate = threading.Event()
    t = _Timeline()
    t.worker = w = Worker(lambda ops: None, budget=100, sample_wait_s=5.0,
                          decode=lambda items: (batches.append([i.name for i in items]), time.sleep(0.6)))  # 0.6 s
    w.submit(Job(lambda: gate.wait(10)))

    def job(name: str, who: str, then: Callable[[], None] = lambda: None) -> Job:
        return t.job(name, then, sample=SimpleNamespace(name=name, who=who))

    a3 = job("a3", "A")
    b2 = job("b2", "B")
    a2 = job("a2", "A", t.later(ACTIVE_S + 0.3, a3, "a3"))  # B is then long idle: A alone, no wait
    w.submit(job("a1", "A", t.later(0.0, a2, "a2")))
    w.submit(job("b1", "B", t.later(0.25, b2, "b2")))  # B's client asks again 0.25 s after its answer
    gate.set()
    t.until("a3")
    assert batches == [["a1", "b1"], ["a2", "b2"]]  # a2 waited for b2; a3 decoded alone (no batch of one)
    assert t.ran["a2"] >= t.submitted["b2"]
    assert t.ran["a3"] - t.submitted["a3"] < 0.3  # no other sampler active: a lone one never waits
    assert w.stats["largest_sample_batch"] == 2


# --- through the service: tenants' ops packed, each client's proof still exact ---------------------------------------


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("batching")) as s:
        yield s


def test_tenants_ops_share_passes_and_each_bundle_replays_bit_identically(svc: Any, tmp_path: Path) -> None:
    from tinker import types

    clients = [Client(svc, OWNER), Client(svc, "b" * 64)]
    models = [(c, c.create(rank=r, seed=i, train_mlp=bool(i % 2))) for i, (c, r) in
              enumerate([(clients[0], 4), (clients[1], 8), (clients[0], 8), (clients[1], 2)])]
    before = svc.engine.batching
    for step in range(2):
        gate = threading.Event()
        svc.engine.submit(lambda g=gate: g.wait(30))  # the worker busy: every op below waits in the queue together
        futures = []
        for i, (c, m) in enumerate(models):
            record = fb_record([[(7 * k + i + step) % 600 + 3 for k in range(12 + 5 * i)], [1, 5, 9, 14]] if i < 2
                               else [[(3 * k + i + step) % 600 + 3 for k in range(i)]])  # 1 and 2 tokens: short ops
            futures.append((c, m, record, svc.forward_backward(c.owner, fb_body(m, record))))
        optims = [(c, m, svc.optim_step(c.owner, types.OptimStepRequest(
            model_id=m, optim_params=types.AdamParams(**ADAM)))) for c, m in models]
        gate.set()
        for c, m, record, fut in futures:
            ok, body = wait(svc, fut)
            assert ok, body
            c.ops[m].append(record)
        for c, m, fut in optims:
            ok, body = wait(svc, fut)
            assert ok, body
            c.ops[m].append({"op": "optim_step", "adam_params": dict(ADAM)})
    after = svc.engine.batching
    assert after["passes"] - before["passes"] == 2 and after["largest"] == 4
    policy = svc.out / "simulator-test-policy.yaml"
    for i, (c, m) in enumerate(models):
        _path, bundle, ops = c.save(m, f"tenant-{i}")
        code, doc = verify(bundle, policy, write_ops(tmp_path / f"t{i}.jsonl", ops), "--replay")
        checks = {ch["name"]: ch for ch in doc["checks"]}
        assert (code, doc["verdict"]) == (0, "accepted"), [ch for ch in doc["checks"] if ch["status"] == "fail"]
        assert checks["op_chain.replay"]["status"] == "pass" and "bit-identical" in checks["op_chain.replay"]["reason"]
        assert json.loads(json.dumps(ops))[0]["op"] == "forward_backward"


def test_a_model_more_than_there_is_room_for_is_refused_with_503_never_evicting(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker import types

    from app.api.engine import admission
    from app.api.errors import Unavailable

    with service(tmp_path, "api:\n  max_models: 2\n") as s:
        c = Client(s, OWNER)
        first, second = c.create(), c.create()
        req = types.CreateModelRequest(session_id=c.session, model_seq_id=99, base_model="cvm-tune/tiny-llama",
                                       lora_config=types.LoraConfig(rank=4))
        with pytest.raises(Unavailable, match=r"2 models loaded \(api.max_models\): unload_model") as got:
            s.create_model(OWNER, req)
        assert got.value.status == 503
        assert s.store.model_owner(f"{c.session}:train:99") is None  # nothing recorded of it
        assert set(s.engine.models) == {first, second}  # and nobody evicted
        ok, body = wait(s, s.unload_model(OWNER, first))
        assert ok, body
        monkeypatch.setattr(admission, "free_memory", lambda device: 4096)  # 4 KiB free: too little
        with pytest.raises(Unavailable, match="MiB are free on cpu"):
            s.create_model(OWNER, req)
        monkeypatch.undo()
        ok, body = wait(s, s.create_model(OWNER, req))
        assert ok, body


def test_a_long_poll_is_woken_with_the_result_itself_and_leaves_nothing_behind(svc: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from app.api.errors import NotFound

    client = Client(svc, OWNER)
    model = client.create(rank=2)
    reads: list[str] = []
    real = svc.store.future
    monkeypatch.setattr(svc.store, "future", lambda fid: reads.append(fid) or real(fid))
    gate = threading.Event()
    svc.engine.submit(lambda: gate.wait(30))  # the op below stays pending while the poll registers
    fut = svc.forward_backward(OWNER, fb_body(model, fb_record([[1, 5, 9, 14, 3]])))
    fid = fut["request_id"]

    async def poll() -> tuple[int, str, bytes]:
        task = asyncio.create_task(svc.retrieve(OWNER, fid))
        await asyncio.sleep(0.2)
        assert [w[0] for w in svc._waiters[fid]] == [asyncio.get_running_loop()] and reads == [fid]
        gate.set()
        return await task

    status, ctype, body = asyncio.run(poll())
    stored = real(fid)
    assert (status, ctype, body) == (200, stored.content_type, stored.result) and stored.status == "done" and body
    assert reads == [fid] and fid not in svc._waiters  # woken with the committed result: no second read
    with pytest.raises(NotFound):  # another key's poll: refused, and no waiter of it left
        asyncio.run(svc.retrieve("b" * 64, fid))
    assert fid not in svc._waiters


def test_a_server_stopping_commits_the_op_it_runs_and_runs_no_queued_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown (SIGTERM: the service closed) while an op runs and another waits: the running op's result is
    committed before the database closes (it was logged as a failed job and left pending); the waiting op never
    runs, and the next start fails its future as interrupted."""
    from app.api.proof.store import RESTARTED

    started, release = threading.Event(), threading.Event()
    with service(tmp_path) as svc:
        c = Client(svc)
        m = c.create()
        real = svc.engine.forward_backward

        def slow(op: Any) -> Any:
            started.set()
            assert release.wait(30)
            return real(op)

        monkeypatch.setattr(svc.engine, "forward_backward", slow)
        running = svc.forward_backward(OWNER, fb_body(m, fb_record([[1, 5, 9, 14]])))
        assert started.wait(30)
        queued = svc.forward_backward(OWNER, fb_body(m, fb_record([[2, 11, 4]])))
        threading.Timer(0.5, release.set).start()  # the op finishes while the service is closing
    with service(tmp_path) as svc:
        done, interrupted = svc.store.future(running["request_id"]), svc.store.future(queued["request_id"])
        assert done.status == "done" and done.result  # the op's output (protobuf), as a retrieve answers it
        assert interrupted.status == "failed" and json.loads(interrupted.result)["error"] == RESTARTED
