"""The training API driven by the unmodified ``tinker`` SDK over loopback (CPU, the tiny local model).

One server process per module (``cvm-tune api serve``, the real command) on a scratch output volume; the tests run
in order: train and save, verify the bundle against the client's own record of its ops, kill -9 and continue from
the saved state, then isolation between keys and bad input.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from attestation.outputs import op_chain

from tests import api_drive
from tests.api_drive import ADAM, Server, _bundle, _record, _steps
from tests.api_inproc import load_line

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes (load_state, …)
ALICE, BOB = "tml-alice-key", "tml-bob-key"
BASE = "cvm-tune/tiny-llama"
# Small limits, reached by the bad-input test (and a 1 s long poll).
LIMITS = "api:\n  max_tokens_per_request: 512\n  max_seq_len: 128\n  max_sample_tokens: 16\n  long_poll_s: 1\n"


def serving(tmp: Path, config: str = "", *, tls: bool = False) -> Iterator[Server]:
    """A started server on ``tmp/"out"`` with the keys ALICE and BOB and :data:`LIMITS` (``config``: more YAML for
    its configuration file), stopped after."""
    srv = Server(tmp, LIMITS + config, tls=tls, keys=(ALICE, BOB))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def state(server: Server) -> dict[str, Any]:
    """The datums every test trains on, and what the training test saves (:func:`_trained` makes the same when that
    test did not run or failed: no test here depends on another's outcome)."""
    return {"datums": _datums(server)}


def _trained(server: Server, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a model trained 10 steps and saved as a training state (path, ops, bundle, model_id)."""
    if "path" not in state:
        tc = _client(server).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
        ops: list[dict[str, Any]] = []
        losses = _steps(tc, state["datums"], 10, ops)
        path = tc.save_state("own-state").result().path
        state.update(path=path, ops=ops, bundle=_bundle(server, tc.model_id, path), model_id=tc.model_id,
                     first_loss=losses[0])
    return state


_OPEN: list[Any] = []  # the SDK clients the running test created


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    """Close every ``ServiceClient`` a test created when it ends, while its server still runs: an open one keeps a
    heartbeat thread that, once the server stops, logs "Session heartbeat failed" for the rest of the session.
    (Import it with ``_client`` into another module to have it there too.)"""
    yield
    while _OPEN:
        _OPEN.pop().close("success").result(timeout=60)  # POST sessions/<id>/finish, then the SDK's threads stop


def _client(srv: Server, key: str = ALICE) -> Any:
    import tinker

    sc = tinker.ServiceClient(base_url=srv.url, api_key=key)
    _OPEN.append(sc)
    return sc


def _datums(srv: Server) -> list[Any]:
    return api_drive._datums(srv.out / "models" / "tiny-llama")


def _verify(srv: Server, bundle: Path, ops: list[dict[str, Any]], tmp: Path, *extra: str) -> tuple[int, str]:
    """``cvm-tune verify BUNDLE --policy <simulator policy> --ops OPS`` (in this process): (exit code, stdout)."""
    import contextlib
    import io

    from app.cli import main

    ops_file = tmp / f"ops-{len(ops)}-{time.monotonic_ns()}.jsonl"
    ops_file.write_text("".join(json.dumps(op) + "\n" for op in ops))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", str(bundle), "--policy", str(srv.out / "simulator-test-policy.yaml"), "--ops",
                     str(ops_file), *extra])
    return code, out.getvalue()


def test_train_save_sample_and_verify_the_op_chain(server: Server, state: dict[str, Any], tmp_path: Path) -> None:
    import tinker
    from tinker import types

    sc = _client(server)
    assert [m.model_name for m in sc.get_server_capabilities().supported_models] == [BASE]
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    datums, ops = state["datums"], []
    losses = _steps(tc, datums, 10, ops)
    assert losses[-1] < 0.6 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses

    path = tc.save_state("after-10").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-10"
    sampler = tc.save_weights_for_sampler("sampler-10").result().path
    trained = types.ModelInput.from_ints(datums[0].model_input.to_ints())
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    sample = sc.create_sampling_client(model_path=sampler).result().sample(
        prompt=trained, num_samples=2, sampling_params=params, include_prompt_logprobs=True).result()
    base = sc.create_sampling_client(base_model=BASE).result().sample(
        prompt=trained, num_samples=1, sampling_params=params, include_prompt_logprobs=True).result()
    assert len(sample.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) == 8 for s in sample.sequences)
    assert sample.prompt_logprobs[0] is None and all(lp < 0 for lp in sample.prompt_logprobs[1:])
    # the saved weights, not the base model: the trained text is far more likely under them
    assert sum(sample.prompt_logprobs[1:]) > sum(base.prompt_logprobs[1:]) + 20

    # save_state -> load_state: a step after loading equals a step from the saved state
    saved_ops = list(ops)
    before = tc.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]  # forward+backward, no step
    ops.append(_record(datums))
    with pytest.raises(tinker.RequestFailedError, match="not yet applied"):  # it would drop a recorded gradient
        tc.load_state_with_optimizer(path).result()
    tc.optim_step(types.AdamParams(**ADAM)).result()  # the gradient is applied, in the chain
    ops.append({"op": "optim_step", "adam_params": types.AdamParams(**ADAM).model_dump(mode="json")})
    bundle = _bundle(server, tc.model_id, path)
    tc.load_state_with_optimizer(path).result()  # back to the saved weights and optimizer: a load op
    ops = [*saved_ops, load_line(bundle, True, op_chain.head(ops))]
    again = tc.forward(datums, "cross_entropy").result().metrics["loss:sum"]  # forward only: not an op
    assert again == pytest.approx(before, rel=1e-5)

    assert (bundle / "adapter" / "adapter_model.safetensors").is_file() and not (bundle / "adapter" / "optimizer.pt").exists()
    code, out = _verify(server, bundle, saved_ops, tmp_path)
    assert code == 0 and "op chain: pass: 20 ops" in out, out
    changed = json.loads(json.dumps(saved_ops))
    changed[4]["data"][1]["model_input"][2] += 1  # one token of one op
    dropped, added = saved_ops[:-1], [*saved_ops, saved_ops[-1]]
    for bad in (changed, dropped, added):
        code, out = _verify(server, bundle, bad, tmp_path)
        assert code == 1 and "op chain: FAIL" in out and "REJECTED" in out, out  # the verdict says what the chain says
    reloaded = _bundle(server, tc.model_id, tc.save_state("reloaded").result().path)
    code, out = _verify(server, reloaded, ops, tmp_path)  # the saved state's ops, then the load
    assert code == 0 and "op chain: pass: 21 ops" in out, out
    state.update(path=path, ops=saved_ops, bundle=bundle, model_id=tc.model_id, datums=datums, first_loss=losses[0])


def test_kill9_between_steps_then_continue_from_the_saved_state(server: Server, state: dict[str, Any],
                                                                tmp_path: Path) -> None:
    state = _trained(server, state)
    headers = {"X-API-Key": ALICE}
    done = httpx.post(f"{server.url}/api/v1/asample", headers=headers, json={
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}, "num_samples": 1,
        "sampling_params": {"max_tokens": 4, "temperature": 0}, "base_model": BASE}).json()["request_id"]
    first = _retrieve(server, done, ALICE)
    server.kill9()  # between steps: the last op was an optim_step the client already has the result of
    staged = server.out / "exports" / ".tmp-api-killed-mid-export-x1"  # what a save killed mid-export leaves
    staged.mkdir()
    (staged / "manifest.json").write_text("{}")
    server.start()
    assert not staged.exists()  # cleared under the volume's lock at start
    assert _retrieve(server, done, ALICE) == first  # a completed result survives kill -9
    sc = _client(server)
    tc = sc.create_training_client_from_state_with_optimizer(state["path"]).result()
    ops = [*state["ops"], load_line(state["bundle"], True)]  # the state's history, then its load
    losses = _steps(tc, state["datums"], 2, ops)
    assert losses[0] < 0.7 * state["first_loss"]  # continued from the trained weights, not from scratch
    path = tc.save_state("after-kill").result().path
    bundle = _bundle(server, tc.model_id, path)
    code, out = _verify(server, bundle, ops, tmp_path, "--replay")  # the whole history, across the kill, replays
    assert code == 0 and "op chain: pass: 25 ops" in out and "replay: pass: 25 ops" in out, out
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["op_chain"]["optimizer_steps"] == manifest["training"]["global_step"] == 12
    state["model_id"] = tc.model_id


def _retrieve(srv: Server, fid: str, key: str) -> bytes:
    for _ in range(60):
        r = httpx.post(f"{srv.url}/api/v1/retrieve_future", headers={"X-API-Key": key},
                       json={"request_id": fid, "allow_metadata_only": False}, timeout=30)
        r.raise_for_status()
        if b'"try_again"' not in r.content:
            return r.content
    raise AssertionError(f"future {fid} never completed")


def test_a_key_sees_only_its_own_sessions_models_and_checkpoints(server: Server, state: dict[str, Any]) -> None:
    state = _trained(server, state)
    bob = {"X-API-Key": BOB}
    model = state["model_id"]
    for route, body in (("get_info", {"model_id": model}),
                        ("optim_step", {"model_id": model, "adam_params": ADAM}),
                        ("load_weights", {"model_id": model, "path": state["path"], "optimizer": False}),
                        ("create_sampling_session", {"session_id": "x", "sampling_session_seq_id": 0,
                                                     "model_path": state["path"]})):
        r = httpx.post(f"{server.url}/api/v1/{route}", headers=bob, json=body)
        assert r.status_code == 404 and "not found" in r.json()["detail"], (route, r.text)
    assert httpx.get(f"{server.url}/api/v1/training_runs/{model}/checkpoints", headers=bob).status_code == 404
    r = httpx.post(f"{server.url}/api/v1/get_info", headers={"X-API-Key": "tml-nobody"}, json={"model_id": model})
    assert r.status_code == 401


def test_samples_complete_through_retrieve_futures_owner_checked(server: Server,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The client config turns on the SDK's session poller: a sample's completion reaches it by retrieve_futures
    (not by long-polling retrieve_future), its ack drops it from the queue, and only its own key can poll it."""
    from tinker import types
    from tinker.resources.futures import AsyncFuturesResource

    polls: list[tuple[Any, Any]] = []
    real = AsyncFuturesResource.retrieve_multi

    async def spy(self: Any, *, request: Any, **kw: Any) -> Any:
        out = await real(self, request=request, **kw)
        polls.append((request, out))
        return out

    monkeypatch.setattr(AsyncFuturesResource, "retrieve_multi", spy)
    sampler = _client(server).create_sampling_client(base_model=BASE).result()
    assert sampler.holder.get_client_config().sample_use_retrieve_futures
    prompt = types.ModelInput.from_ints([5, 6, 7])
    got = sampler.sample(prompt=prompt, num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(got.sequences) == 2
    session = polls[0][0].target.sampling_session_id
    done = {c.request_id for _r, out in polls for c in out.completions if c.state == "finished"}
    assert len(done) == 1 and all(r.target.sampling_session_id == session for r, _o in polls)
    deadline = time.monotonic() + 10  # the ack goes out on the poller's next (timeout 0) poll
    while not any(done & set(r.retrieved_request_ids) for r, _o in polls):
        assert time.monotonic() < deadline, polls
        time.sleep(0.05)
    ack = next(r for r, _o in polls if done & set(r.retrieved_request_ids))
    assert ack.timeout == 0

    poll = {"target": {"type": "sampling_session", "sampling_session_id": session, "cloned_sampler_id": 0},
            "prev_cursor": 0, "timeout": 0}
    url = f"{server.url}/api/v1/retrieve_futures"
    took = []
    for _ in range(5):  # the fastest of five: one round trip on a loaded machine may take long for other reasons
        started = time.monotonic()
        r = httpx.post(url, headers={"X-API-Key": ALICE}, json=poll)
        took.append(time.monotonic() - started)
        assert r.status_code == 200 and r.json()["completions"] == [] and r.json()["cursor"] >= 1, r.text  # acked
    assert min(took) < 0.9, took  # timeout 0 does not wait out the long poll (1 s here)
    r = httpx.post(url, headers={"X-API-Key": BOB}, json=poll)
    assert r.status_code == 404 and "not found" in r.json()["detail"], r.text
    r = httpx.post(url, headers={"X-API-Key": ALICE}, json={**poll, "target": {**poll["target"],
                                                                                "sampling_session_id": "nope"}})
    assert r.status_code == 404 and "not found" in r.json()["detail"], r.text
    r = httpx.post(url, headers={"X-API-Key": ALICE}, json={**poll, "prev_cursor": 1 << 40})
    assert r.status_code == 400 and "ahead" in r.json()["detail"], r.text
    r = httpx.post(url, headers={"X-API-Key": ALICE}, json={**poll, "timeout": None, "prev_cursor": "x"})
    assert r.status_code == 400 and "malformed FuturesRetrieveRequest" in r.json()["detail"], r.text


def test_bad_input_is_a_4xx_with_its_reason_and_the_server_keeps_serving(server: Server, state: dict[str, Any]) -> None:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    state = _trained(server, state)
    h = {"X-API-Key": ALICE}
    model = state["model_id"]

    def fwdbwd(tokens: list[int], targets: list[int], model_id: str = model) -> httpx.Response:
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[types.Datum(
            model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": targets})],
            loss_fn="cross_entropy"), model_id=model_id)
        return httpx.post(f"{server.url}/api/v1/forward_backward", content=forward_backward_request_to_proto(
            req).SerializeToString(), headers={**h, "Content-Type": "application/x-protobuf"})

    cases = {
        "outside the vocabulary": fwdbwd([1, 2, 100_000], [2, 3, 4]),
        "has 2 values for 3 input tokens": fwdbwd([1, 2, 3], [2, 3]),
        "1 to 128 allowed": fwdbwd(list(range(1, 200)), list(range(2, 201))),
        "not found": fwdbwd([1, 2], [2, 3], model_id="nobody:train:0"),
        "not a ForwardBackwardRequest": httpx.post(f"{server.url}/api/v1/forward_backward", content=b"\xff\x00garbage",
                                                   headers={**h, "Content-Type": "application/x-protobuf"}),
        "malformed OptimStepRequest": httpx.post(f"{server.url}/api/v1/optim_step", headers=h, content=b"{not json"),
        "malformed CreateModelRequest": httpx.post(f"{server.url}/api/v1/create_model", headers=h, json={"rank": "x"}),
        "max_tokens 999": httpx.post(f"{server.url}/api/v1/asample", headers=h, json={
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]}, "base_model": BASE,
            "sampling_params": {"max_tokens": 999}}),
        "is not served": httpx.post(f"{server.url}/api/v1/no_such_route", headers=h, json={}),
    }
    for reason, r in cases.items():
        assert 400 <= r.status_code < 500, (reason, r.status_code, r.text)  # a 5xx: the SDK would retry for minutes
        assert reason in r.json()["detail"], (reason, r.text)
    # 600 tokens in one request: over max_tokens_per_request (512), each datum within max_seq_len
    from tinker.types import Datum, ModelInput

    big = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[Datum(
        model_input=ModelInput.from_ints(list(range(1, 121))), loss_fn_inputs={"target_tokens": list(range(2, 122))})
        for _ in range(5)], loss_fn="cross_entropy"), model_id=model)
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=forward_backward_request_to_proto(big)
                   .SerializeToString(), headers={**h, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "at most 512 per request" in r.json()["detail"]
    # the SDK surfaces a refusal as an error that carries the reason; the model still trains afterwards
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(Exception, match="outside the vocabulary"):
        tc.forward_backward([Datum(model_input=ModelInput.from_ints([1, 99_999]),
                                   loss_fn_inputs={"target_tokens": [2, 3]})], "cross_entropy").result()
    assert tc.forward_backward(state["datums"], "cross_entropy").result().metrics["loss:sum"] > 0
    assert tc.optim_step(types.AdamParams(**ADAM)).result().metrics is not None


def test_importance_sampling_and_ppo_losses(server: Server, state: dict[str, Any]) -> None:
    """With the sampler's logprobs equal to the model's own, the ratio is 1: both losses are -sum(advantages); with
    the sampler's logprobs 1 nat lower, importance sampling weights by e and PPO clips the ratio at 1.2."""
    import math

    from tinker.types import Datum

    tc = _client(server).create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    d = state["datums"][0]
    own = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    adv = [0.5] * len(own)
    for shift, ratio_is, ratio_ppo in ((0.0, 1.0, 1.0), (1.0, math.e, 1.2)):
        rl = Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": (own - shift).tolist(), "advantages": adv})
        for loss_fn, ratio in (("importance_sampling", ratio_is), ("ppo", ratio_ppo)):
            got = tc.forward([rl], loss_fn).result().metrics["loss:sum"]
            assert got == pytest.approx(-ratio * sum(adv), rel=1e-4), (loss_fn, shift, got)


def test_dp_sgd_per_model_reports_epsilon_and_chains_it(server: Server, state: dict[str, Any], tmp_path: Path) -> None:
    from opacus.accountants import RDPAccountant
    from tinker import types

    meta = {"dp.noise_multiplier": "1.1", "dp.max_grad_norm": "1.0", "dp.dataset_size": "1000", "dp.batch_size": "2"}
    with pytest.raises(Exception, match="dp.batch_size"):  # refused before any model exists
        _client(server).create_lora_training_client(base_model=BASE, rank=4, user_metadata={
            k: v for k, v in meta.items() if k != "dp.batch_size"}).result()
    tc = _client(server).create_lora_training_client(base_model=BASE, rank=4, seed=1, user_metadata=meta).result()
    datums, ops, eps = state["datums"], [], []
    for _ in range(3):
        tc.forward_backward(datums, "cross_entropy").result()
        eps.append(tc.optim_step(types.AdamParams(**ADAM)).result().metrics["dp_epsilon"])
        ops += [_record(datums), {"op": "optim_step", "adam_params": types.AdamParams(**ADAM).model_dump(mode="json"),
                                  "dp_epsilon": eps[-1]}]
    acc = RDPAccountant()
    acc.history = [(1.1, 2 / 1000, 3)]
    assert 0 < eps[0] < eps[1] < eps[2] == pytest.approx(acc.get_epsilon(delta=1 / 1000**2), rel=1e-9)
    path = tc.save_state("dp-3").result().path
    bundle = _bundle(server, tc.model_id, path)
    recorded = json.loads((bundle / "manifest.json").read_text())["op_chain"]["dp"]
    assert recorded["epsilon"] == eps[-1] and recorded["steps"] == 3 and recorded["sample_rate"] == 0.002
    code, out = _verify(server, bundle, ops, tmp_path)
    assert code == 0 and "op chain: pass: 6 ops" in out, out
    del ops[-1]["dp_epsilon"]  # the ε is part of what the chain commits to
    assert _verify(server, bundle, ops, tmp_path)[0] == 1


def test_one_volume_one_writer_the_nightly_run_skips_and_a_second_server_is_refused(server: Server,
                                                                                    tmp_path: Path) -> None:
    """The server holds the volume's run lock: a ``cvm-tune run`` on it exits 7 saying who holds it and writes nothing
    (two writers would fork the audit chain), and a second ``api serve`` on it exits 7 before it listens."""
    import subprocess
    import sys

    log = server.out / "state" / "audit.jsonl"
    audit = log.read_bytes() if log.exists() else None
    exports = sorted(p.name for p in (server.out / "exports").iterdir())
    run = subprocess.run([sys.executable, "-m", "app", "run", "--config", str(server.cfg)], env=server.env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 7 and "is in use by another cvm-tune process (pid " in run.stderr, run.stdout + run.stderr
    assert "Export bundle" not in run.stdout
    second = Server(tmp_path, keys=(ALICE,))
    second.cfg.write_text(server.cfg.read_text())  # the same output volume
    proc = subprocess.run(second.cmd, env=second.env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert f"error: the output volume {server.out.resolve()} is in use by another cvm-tune process (pid " in proc.stderr
    assert "listening on" not in proc.stdout + proc.stderr
    assert (log.read_bytes() if log.exists() else None) == audit
    assert sorted(p.name for p in (server.out / "exports").iterdir()) == exports
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}  # the first one keeps serving
