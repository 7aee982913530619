"""One tenant cannot stall or break the training API (issue 46, items 1, 4, 5, 6).

1. A custom loss's Python numbers, strings and sequences are bounded before any node computes (``10 ** 30000000``
   held every route for 67 s; ``"a" * 8000000000`` held 8 GB): refused at once with the reason, category user,
   nothing applied; ``/healthz`` answers while an allowed but slow op runs.
4. A loss that fails with ``MemoryError`` in a shared pass fails its own op only: the pass budget stays, passes keep
   packing; a real out-of-memory pass lowers the budget to no less than a floor, and it climbs back.
5. Custom-loss mistakes are 400 / category user: ``{"ref": [...]}`` in ``create_custom_loss``, a runtime error of an
   allowed graph (in a shared pass and alone).
6. A download URL whose ``expires`` gains a leading zero is 403; a deleted export's genuine URL is 410.

The service runs in this process behind uvicorn on loopback (HTTP, as ``api serve --plain-http``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.api_inproc import BASE, Client, fb_body, fb_record, service, wait
from tests.test_hardening_r5_replay import NEG_LL

KEY = "tml-r5-key"
OWNER = hashlib.sha256(KEY.encode()).hexdigest()


@contextlib.contextmanager
def serving(svc: Any, keys: tuple[str, ...]) -> Iterator[str]:
    """``svc`` behind uvicorn on a free loopback port (as ``api serve --plain-http``); yields its URL."""
    import uvicorn

    from app.api.http.server import create_app

    app = create_app(svc, frozenset(hashlib.sha256(k.encode()).hexdigest() for k in keys))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("r5-api")) as svc, serving(svc, (KEY,)) as url:
        yield SimpleNamespace(svc=svc, url=url)


def _post(api: Any, route: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{api.url}/api/v1/{route}", headers={"X-API-Key": KEY}, timeout=120, **kw)


def _futures(svc: Any) -> int:
    return svc.store._all("SELECT COUNT(*) FROM api_futures")[0][0]


def _with_node(*nodes: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(NEG_LL)
    doc["graph"]["nodes"][2:2] = nodes
    return doc


def _node(target: str, *args: Any, op: str = "call_function") -> dict[str, Any]:
    return {"args": list(args), "kwargs": {}, "name": "hostile", "op": op, "target": target}


def _create_loss(api: Any, c: Client, doc: dict[str, Any]) -> httpx.Response:
    return _post(api, "create_custom_loss", json={"session_id": c.session, "custom_loss_seq_id": 1, **doc})


def _loss_id(api: Any, c: Client, doc: dict[str, Any]) -> str:
    r = _create_loss(api, c, doc)
    assert r.status_code == 200, r.text
    ok, body = wait(api.svc, r.json())
    assert ok, body
    return json.loads(body)["loss_id"]


def _state(svc: Any, model_id: str) -> tuple[Any, ...]:
    """What an op may change: weights, gradients, chain head and count, pending ops."""
    m = svc.engine.models[model_id]
    params = svc.engine._params(m.adapter)
    return ([p.detach().clone() for p in params], [None if p.grad is None else p.grad.clone() for p in params],
            m.op_head, m.ops, m.pending)


def _unchanged(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    import torch

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, list):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y))
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return all(same(x, y) for x, y in zip(a, b))


def _user_failure(body: bytes, reason: str) -> None:
    doc = json.loads(body)
    assert doc["category"] == "user" and reason in doc["error"], doc


# --- 1. bounded Python values ---------------------------------------------------------------------------------------

BOMBS = [
    ("pow(10, 30000000)", _node("operator.pow", 10, 30_000_000), "is an integer of more than 64 bits"),
    ("'a' * 8000000000", _node("operator.mul", "a", 8_000_000_000), "operator.mul of a string"),
    ("'a' * 2**62 (MemoryError)", _node("operator.mul", "a", 2**62), "operator.mul of a string"),
    ("'%0999999999d' % 1", _node("operator.mod", "%0999999999d", 1), "operator.mod of a string"),
    ("(1,) * 10**9", _node("operator.mul", {"tuple": [1]}, 10**9), "repeated 1000000000 times"),
    ("cat of 64 copies of 64 copies", [dict(_node("torch.cat", [{"ref": "logprobs"}] * 64), name="c0"),
                                        _node("torch.cat", [{"ref": "c0"}] * 64)], "a tensor of 1224704 elements"),
    ("an outer product of 300 tokens twice", [
        dict(_node("unsqueeze", {"ref": "logprobs"}, 0, op="call_method"), name="row"),
        dict(_node("unsqueeze", {"ref": "logprobs"}, 1, op="call_method"), name="col"),
        dict(_node("operator.mul", {"ref": "row"}, {"ref": "col"}), name="outer"),
        _node("operator.mul", {"ref": "outer"}, {"ref": "outer"})], "a tensor of 89401 elements"),
]


@pytest.mark.parametrize(("node", "reason"), [b[1:] for b in BOMBS], ids=[b[0] for b in BOMBS])
def test_a_python_value_bomb_is_refused_at_once_and_changes_nothing(api: Any, node: Any, reason: str) -> None:
    c = Client(api.svc, OWNER)
    m = c.create(rank=2)
    loss_id = _loss_id(api, c, _with_node(*(node if isinstance(node, list) else [node])))
    before, start = _state(api.svc, m), time.monotonic()
    record = fb_record([[1, 5, 9, 14, 3] * 60], "custom", {"loss_id": loss_id})  # 300 tokens: cat 64x passes the budget
    ok, body = c.forward_backward(m, record)
    assert not ok and time.monotonic() - start < 5
    _user_failure(body, reason)
    assert _unchanged(before, _state(api.svc, m))


def test_healthz_answers_while_a_stalling_loss_is_sent(api: Any) -> None:
    """A loss that squares 10 ** 3,000,000 held the interpreter, so every route and /healthz, for seconds (one
    multiplication of huge integers never lets another thread run); it is refused at once, and /healthz answers."""
    c = Client(api.svc, OWNER)
    m = c.create(rank=2)
    loss_id = _loss_id(api, c, _with_node(dict(_node("operator.pow", 10, 3_000_000), name="big"),
                                          _node("operator.mul", {"ref": "big"}, {"ref": "big"})))
    fut = api.svc.forward_backward(OWNER, fb_body(m, fb_record([[1, 5, 9]], "custom", {"loss_id": loss_id})))
    worst = _healthz_while(api, lambda: api.svc.store.future(fut["request_id"]).status != "pending", 10)
    ok, body = wait(api.svc, fut)
    assert not ok and worst < 1.0, worst
    _user_failure(body, "more than 64 bits")


def _healthz_while(api: Any, done: Any, at_most: float) -> float:
    """The longest wait for a /healthz answer while ``done()`` is false (at least one, at most ``at_most`` seconds):
    the longest time between the start of a probe and the end of the next one. The probes run in this process, so
    anything that holds the interpreter stalls them too and is counted."""
    worst, deadline = 0.0, time.monotonic() + at_most
    with httpx.Client(base_url=api.url, timeout=120) as http:
        while True:
            start = time.monotonic()
            assert http.get("/api/v1/healthz").status_code == 200
            finished = done()
            worst = max(worst, time.monotonic() - start)
            if finished or time.monotonic() > deadline:
                return worst
            time.sleep(0.02)


def test_healthz_answers_while_a_slow_allowed_op_runs(api: Any) -> None:
    """A forward_backward of 16 datums of 2,048 tokens (the longest a datum may be) keeps the engine busy for seconds;
    the HTTP edge keeps answering: the engine's kernels release the GIL, and no Python operation of a loss runs
    unbounded."""
    c = Client(api.svc, OWNER)
    m = c.create(rank=8)
    big = fb_record([[(7 * k) % 500 + 3 for k in range(2048)] for _ in range(16)])
    fut = api.svc.forward_backward(OWNER, fb_body(m, big))
    start = time.monotonic()
    worst = _healthz_while(api, lambda: api.svc.store.future(fut["request_id"]).status != "pending", 120)
    busy = time.monotonic() - start
    ok, body = wait(api.svc, fut)
    assert ok, body
    print(f"slow op: {busy:.2f} s; slowest /healthz meanwhile {worst * 1000:.0f} ms")
    assert worst < 0.5, (worst, busy)


# --- 4. a tenant's MemoryError in a shared pass ----------------------------------------------------------------------

def _packed_round(api: Any, ops: list[tuple[Client, str, dict[str, Any]]]) -> list[tuple[bool, bytes]]:
    """``ops`` queued together behind a busy worker (so they share one pass); their outcomes."""
    gate = threading.Event()
    api.svc.engine.submit(lambda: gate.wait(30))
    futs = [api.svc.forward_backward(c.owner, fb_body(m, record)) for c, m, record in ops]
    gate.set()
    return [wait(api.svc, f) for f in futs]


def test_a_tenants_memory_error_in_a_shared_pass_fails_its_op_only(api: Any) -> None:
    engine = api.svc.engine
    assert engine.packed
    alice, bob = Client(api.svc, OWNER), Client(api.svc, OWNER)
    a, b = alice.create(rank=2), bob.create(rank=2)
    bomb = _loss_id(api, alice, _with_node(_node("operator.mul", "a", 2**62)))  # Python's MemoryError on round 4
    budget, passes = engine.pass_budget, engine.batching["passes"]
    before_a = _state(api.svc, a)
    (ok_a, body_a), (ok_b, body_b) = _packed_round(api, [
        (alice, a, fb_record([[1, 5, 9, 14]], "custom", {"loss_id": bomb})), (bob, b, fb_record([[2, 11, 4, 8]]))])
    assert engine.batching["passes"] == passes + 1  # they shared a pass
    assert not ok_a and ok_b, (body_a, body_b)
    _user_failure(body_a, "operator.mul of a string")
    assert _unchanged(before_a, _state(api.svc, a))
    assert engine.pass_budget == budget  # not taken for the pass running out of memory
    results = _packed_round(api, [(alice, a, fb_record([[1, 5, 9, 14]])), (bob, b, fb_record([[2, 11, 4, 8]]))])
    assert all(ok for ok, _b in results) and engine.batching["passes"] == passes + 2  # still packing


def test_a_real_out_of_memory_pass_lowers_the_budget_to_a_floor_and_it_recovers(api: Any,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from app.api.engine import packed
    from app.api.engine.worker import FLOOR_FRACTION

    engine = api.svc.engine
    w = engine._worker
    real = packed.forward_backward
    calls = []

    def oom(eng: Any, items: list[Any]) -> Any:
        calls.append(len(items))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(eng, items)

    monkeypatch.setattr(packed, "forward_backward", oom)
    alice, bob = Client(api.svc, OWNER), Client(api.svc, OWNER)
    a, b = alice.create(rank=2), bob.create(rank=2)
    initial = w.initial
    results = _packed_round(api, [(alice, a, fb_record([[1, 5, 9, 14]])), (bob, b, fb_record([[2, 11, 4, 8]]))])
    assert all(ok for ok, _b in results)  # they ran alone after the pass failed
    assert w.budget == initial // FLOOR_FRACTION > 0  # half of a tiny pass would be 0 MiB: the floor holds
    for _ in range(FLOOR_FRACTION):
        results = _packed_round(api, [(alice, a, fb_record([[1, 5, 9]])), (bob, b, fb_record([[2, 11, 4]]))])
        assert all(ok for ok, _b in results)
    assert w.budget == initial  # climbed back, a step a pass


# --- 5. custom-loss mistakes are the user's -------------------------------------------------------------------------

@pytest.mark.parametrize("ref", [["logprobs"], {}, 5, None], ids=["list", "object", "number", "null"])
def test_a_malformed_ref_is_a_400_of_category_user_and_records_nothing(api: Any, ref: Any) -> None:
    c = Client(api.svc, OWNER)
    doc = copy.deepcopy(NEG_LL)
    doc["graph"]["nodes"][2]["args"][0] = {"ref": ref}
    held, futures = dict(api.svc.custom_losses.get((OWNER, c.session), {})), _futures(api.svc)
    r = _create_loss(api, c, doc)
    assert r.status_code == 400 and r.json()["category"] == "user", r.text
    assert "not an earlier node" in r.json()["detail"]
    assert api.svc.custom_losses.get((OWNER, c.session), {}) == held and _futures(api.svc) == futures


RUNTIME = [
    ("a shape mismatch", _node("reshape", {"ref": "logprobs"}, 7, op="call_method"),
     "node hostile (reshape) failed: RuntimeError"),
    ("a wrong type", _node("torch.exp", "not a tensor"), "node hostile (torch.exp) failed: TypeError"),
    ("a division of integers by zero", _node("operator.floordiv", 1, 0), "failed: ZeroDivisionError"),
]


@pytest.mark.parametrize("alone", [False, True], ids=["shared pass", "alone"])
@pytest.mark.parametrize(("node", "reason"), [r[1:] for r in RUNTIME], ids=[r[0] for r in RUNTIME])
def test_a_runtime_error_of_an_allowed_graph_fails_with_category_user(api: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      node: dict[str, Any], reason: str,
                                                                      alone: bool) -> None:
    if alone:  # the engine's path for ops that do not pack (the Unsloth backend, DP-SGD, very long ops)
        monkeypatch.setattr(api.svc.engine, "packed", False)
    c = Client(api.svc, OWNER)
    m = c.create(rank=2)
    loss_id = _loss_id(api, c, _with_node(node))
    before = _state(api.svc, m)
    ok, body = c.forward_backward(m, fb_record([[1, 5, 9, 14]], "custom", {"loss_id": loss_id}))
    assert not ok
    _user_failure(body, reason)
    assert _unchanged(before, _state(api.svc, m))


@pytest.mark.parametrize("alone", [False, True], ids=["shared pass", "alone"])
def test_a_loss_without_a_gradient_is_the_users_mistake(api: Any, monkeypatch: pytest.MonkeyPatch,
                                                        alone: bool) -> None:
    if alone:
        monkeypatch.setattr(api.svc.engine, "packed", False)
    doc = copy.deepcopy(NEG_LL)
    doc["graph"]["nodes"][2]["args"][0] = {"ref": "weights"}  # weights * weights: no logprobs
    c = Client(api.svc, OWNER)
    m = c.create(rank=2)
    ok, body = c.forward_backward(m, fb_record([[1, 5, 9, 14]], "custom", {"loss_id": _loss_id(api, c, doc)}))
    assert not ok
    _user_failure(body, "does not depend on logprobs")


def test_a_lora_seed_torch_does_not_take_is_a_400_and_records_nothing(api: Any) -> None:
    """Seed 2^70 (which a replay also refuses) failed the future as a server error after the model was recorded."""
    c = Client(api.svc, OWNER)
    models = api.svc.store._all("SELECT COUNT(*) FROM api_models")[0][0]
    r = _post(api, "create_model", json={"session_id": c.session, "model_seq_id": 99, "base_model": BASE,
                                         "lora_config": {"rank": 2, "seed": 2**70}})
    assert r.status_code == 400 and r.json()["category"] == "user" and "not one torch takes" in r.json()["detail"]
    assert api.svc.store._all("SELECT COUNT(*) FROM api_models")[0][0] == models


# --- 6. download URLs -----------------------------------------------------------------------------------------------

def _export(api: Any, name: str) -> tuple[str, dict[str, str]]:
    """An external-weights export of a fresh model, and its signed URLs."""
    from tinker import types

    c = Client(api.svc, OWNER)
    m = c.create(rank=2)
    ok, body = wait(api.svc, api.svc.checkpoints.external.save(OWNER, types.SaveWeightsExternalRequest(
        model_id=m, path=name)))
    assert ok, body
    path = json.loads(body)["path"]
    model, cid = path.removeprefix("tinker://").split("/", 1)
    r = httpx.get(f"{api.url}/api/v1/training_runs/{model}/checkpoints/{cid}/external_weights_urls",
                  headers={"X-API-Key": KEY})
    assert r.status_code == 200, r.text
    return path, r.json()["urls"]


def _volume(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for d in ("api", "exports") for p in (out / d).rglob("*"))


def test_an_expires_with_a_leading_zero_is_403(api: Any) -> None:
    _path, urls = _export(api, "r5-zero")
    url = next(u for f, u in urls.items() if f.endswith("manifest.json"))
    assert httpx.get(url).status_code == 200
    files = _volume(api.svc.out)
    for changed in (url.replace("expires=", "expires=0"), url.replace("expires=", "expires=00")):
        r = httpx.get(changed)
        assert r.status_code == 403 and "this download URL is not valid" in r.json()["detail"], r.text
    assert _volume(api.svc.out) == files


def test_a_deleted_exports_url_is_410_and_a_changed_one_still_403(api: Any) -> None:
    path, urls = _export(api, "r5-deleted")
    url = next(u for f, u in urls.items() if f.endswith("manifest.json"))
    model, cid = path.removeprefix("tinker://").split("/", 1)
    r = httpx.delete(f"{api.url}/api/v1/training_runs/{model}/checkpoints/{cid}", headers={"X-API-Key": KEY})
    assert r.status_code == 200, r.text
    assert api.svc.store.checkpoint(path) is None  # an export leaves no record
    files = _volume(api.svc.out)
    r = httpx.get(url)
    assert r.status_code == 410 and "was deleted" in r.json()["detail"], r.text
    r = httpx.get(url.replace("expires=", "expires=0"))
    assert r.status_code == 403, r.text
    sig = url.rsplit("signature=", 1)[1][:64]
    r = httpx.get(url.replace(sig, ("0" if sig[0] != "0" else "1") + sig[1:]))
    assert r.status_code == 403, r.text
    assert _volume(api.svc.out) == files

