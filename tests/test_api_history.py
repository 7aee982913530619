"""A checkpoint's proof never lies: every change of a model's trainable state is one recorded op, applied atomically,
so each saved bundle verifies against exactly the ops that made it (``verify --ops``) and replays to the same weights
(``verify --ops --replay``). The four ways a hostile client once changed weights outside the chain are tested here,
each refused before anything changed; loads are ops; the verdict's JSON and exit code agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_inproc import ADAM, TOKENS, Client, fb_record, service, verify, write_ops

DP = {"dp.noise_multiplier": "1.0", "dp.max_grad_norm": "1.0", "dp.dataset_size": "100", "dp.batch_size": "2"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("history")) as s:
        yield s


@pytest.fixture(scope="module")
def policy(svc: Any) -> Path:
    return svc.out / "simulator-test-policy.yaml"


def _state(svc: Any, model_id: str) -> dict[str, Any]:
    """Everything an op may change: weights, pending gradient, DP sums, optimizer state, chain head and count."""
    import copy

    m = svc.engine.models[model_id]
    params = svc.engine._params(m.adapter)
    return {"weights": [p.detach().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
            "sums": None if m.dp_sums is None else [s.clone() for s in m.dp_sums],
            "optimizer": copy.deepcopy(m.optimizer.state_dict()["state"]), "head": m.op_head, "ops": m.ops,
            "steps": m.steps, "pending": m.pending, "dp": copy.deepcopy(m.dp)}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _user_error(body: bytes) -> str:
    doc = json.loads(body)
    assert doc["category"] == "user", doc
    return doc["error"]


def _verified(svc: Any, policy: Path, c: Client, model_id: str, name: str, tmp: Path, replay: bool = True) -> Path:
    """Save, then verify against the client's record (and replay it): accepted, exit 0, check by check."""
    _path, bundle, ops = c.save(model_id, name)
    code, doc = verify(bundle, policy, write_ops(tmp / f"{name}.jsonl", ops), *(["--replay"] if replay else []))
    checks = {ch["name"]: ch for ch in doc["checks"]}
    assert (code, doc["verdict"]) == (0, "accepted"), [ch for ch in doc["checks"] if ch["status"] == "fail"]
    assert checks["op_chain.ops"]["status"] == "pass"
    if replay:
        assert checks["op_chain.replay"]["status"] == "pass" and "bit-identical" in checks["op_chain.replay"]["reason"]
    return bundle


def _ppo(config: dict[str, Any]) -> dict[str, Any]:
    rec = fb_record([list(TOKENS[0])], loss_fn="ppo", config=config)
    n = len(TOKENS[0]) - 1
    rec["data"][0]["loss_fn_inputs"] = {"target_tokens": TOKENS[0][1:], "logprobs": [-2.0] * n, "advantages": [1.0] * n}
    return rec


# --- the four attacks -------------------------------------------------------------------------------------------

def test_a_forward_backward_with_a_nan_loss_config_is_refused_and_leaves_no_gradient(svc: Any, policy: Path,
                                                                                     tmp_path: Path) -> None:
    c = Client(svc)
    m = c.create(seed=1)
    assert c.forward_backward(m, fb_record([list(t) for t in TOKENS]))[0]
    before = _state(svc, m)
    for bad in ({"clip_low_threshold": math.nan}, {"clip_high_threshold": math.inf}, {"kl_coeff": 0.1}):
        ok, body = c.forward_backward(m, _ppo(bad))
        assert not ok and "loss_fn_config" in _user_error(body)
        assert _same(_state(svc, m), before)  # the pending gradient is exactly the recorded op's
    assert c.optim_step(m)[0]
    _verified(svc, policy, c, m, "nan-config", tmp_path)


def test_an_optim_step_with_a_nan_parameter_is_refused_before_anything_changes(svc: Any, policy: Path,
                                                                               tmp_path: Path) -> None:
    from app.api.errors import BadRequest

    c = Client(svc)
    m = c.create(seed=2)
    assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0]
    before = _state(svc, m)
    for name, value in (("grad_clip_norm", math.nan), ("weight_decay", math.inf), ("grad_clip_norm", -1.0),
                        ("learning_rate", math.nan), ("eps", 0.0), ("learning_rate", 1e300)):  # 1e300: beyond float32
        ok, body = c.optim_step(m, {**ADAM, name: value})  # the route refuses it with the reason (400)
        assert not ok and f"adam_params.{name}" in _user_error(body) and json.loads(body)["status"] == 400
        with pytest.raises(BadRequest, match=f"adam_params.{name}"):
            svc.engine.optim_step(m, {**ADAM, name: value})  # and so would the engine, whoever called it
        assert _same(_state(svc, m), before)
    ok, body = c.optim_step(m, {**ADAM, "weight_decay": 1e300})  # in range, but it would make the weights -inf
    assert not ok and "non-finite" in _user_error(body)
    assert _same(_state(svc, m), before)  # weights, optimizer and the pending gradient as they were
    assert c.optim_step(m, {**ADAM, "grad_clip_norm": 1.0})[0]
    _verified(svc, policy, c, m, "nan-clip", tmp_path)


def test_a_load_into_a_model_with_a_pending_gradient_is_refused(svc: Any, policy: Path, tmp_path: Path) -> None:
    c = Client(svc)
    m = c.create(seed=3)
    assert c.forward_backward(m, fb_record([list(TOKENS[1])]))[0] and c.optim_step(m)[0]
    path, _bundle, _ops = c.save(m, "pending-base")
    assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0]
    before = _state(svc, m)
    ok, body, _ = c.load(path, model_id=m)
    assert not ok and "not yet applied" in _user_error(body)
    assert _same(_state(svc, m), before)
    assert c.optim_step(m)[0]  # the gradient it kept is the recorded op's: applied and in the chain
    _verified(svc, policy, c, m, "pending-after", tmp_path)


def test_loading_a_non_dp_state_into_a_dp_model_is_refused_before_the_weights_change(svc: Any, policy: Path,
                                                                                    tmp_path: Path) -> None:
    c = Client(svc)
    plain = c.create(seed=4)
    assert c.forward_backward(plain, fb_record([list(TOKENS[0])]))[0] and c.optim_step(plain)[0]
    path, _bundle, _ops = c.save(plain, "not-private")
    private = c.create(seed=4, user_metadata=DP)
    before = _state(svc, private)
    ok, body, _ = c.load(path, model_id=private)
    assert not ok and "DP-SGD" in _user_error(body)
    assert _same(_state(svc, private), before)
    _p, bundle, ops = c.save(private, "private-untouched")
    assert ops == []
    code, doc = verify(bundle, policy, write_ops(tmp_path / "empty.jsonl", []))
    assert (code, doc["verdict"]) == (0, "accepted")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["op_chain"]["ops"] == 0 and manifest["op_chain"]["dp"]["epsilon"] == 0.0
    # the weights are the DP model's own initial weights, not the loaded ones: they differ from the plain state's
    plain_m = json.loads((Path(svc.store.checkpoint(path).bundle) / "manifest.json").read_text())
    assert manifest["files"]["adapter/adapter_model.safetensors"] != plain_m["files"]["adapter/adapter_model.safetensors"]


# --- loads are ops: the record of a model is its whole history ------------------------------------------------------

@pytest.mark.parametrize("optimizer", [True, False])
def test_a_model_loaded_from_a_state_continues_its_chain_and_replays(svc: Any, policy: Path, tmp_path: Path,
                                                                     optimizer: bool) -> None:
    c = Client(svc)
    a = c.create(seed=5)
    for _ in range(2):
        assert c.forward_backward(a, fb_record([list(t) for t in TOKENS]))[0] and c.optim_step(a)[0]
    path, _bundle, first = c.save(a, f"first-{optimizer}")
    ok, body, b = c.load(path, optimizer=optimizer)
    assert ok, body
    assert c.ops[b][:len(first)] == first and c.ops[b][len(first)]["op"] == "load"
    for _ in range(2):
        assert c.forward_backward(b, fb_record([list(TOKENS[1])]))[0] and c.optim_step(b)[0]
    bundle = _verified(svc, policy, c, b, f"second-{optimizer}", tmp_path)
    # the load line is bound: dropping it, or naming another state's weights, is rejected
    ops = c.ops[b]
    i = len(first)
    for bad in (ops[:i] + ops[i + 1:], ops[:i] + [{**ops[i], "weights_sha256": "0" * 64}] + ops[i + 1:],
                ops[:i] + [{**ops[i], "optimizer": not optimizer}] + ops[i + 1:], ops[i:]):
        code, doc = verify(bundle, policy, write_ops(tmp_path / "bad.jsonl", bad))
        assert (code, doc["verdict"]) == (1, "rejected")
    # into an existing model (its own earlier history is replaced, and the load says which head it replaced)
    ok, body, _ = c.load(path, model_id=a, optimizer=optimizer)
    assert ok, body
    assert c.forward_backward(a, fb_record([list(TOKENS[0])]))[0] and c.optim_step(a)[0]
    _verified(svc, policy, c, a, f"reloaded-{optimizer}", tmp_path)


def test_a_state_saved_with_a_gradient_pending_loads_and_replays(svc: Any, policy: Path, tmp_path: Path) -> None:
    """A save keeps weights and optimizer, not a pending gradient: a model created from that state starts without
    it, and the replay drops it at the load as the server did (it refused the load as one with a gradient pending)."""
    c = Client(svc)
    a = c.create(seed=2)
    assert c.forward_backward(a, fb_record([list(t) for t in TOKENS]))[0] and c.optim_step(a)[0]
    assert c.forward_backward(a, fb_record([list(TOKENS[0])]))[0]  # pending at the save
    path, _bundle, _ops = c.save(a, "pending")
    ok, body, b = c.load(path, optimizer=True)
    assert ok, body
    assert c.forward_backward(b, fb_record([list(TOKENS[1])]))[0] and c.optim_step(b)[0]
    _verified(svc, policy, c, b, "after-pending", tmp_path)


def test_a_state_loaded_into_a_model_of_another_seed_replays(svc: Any, policy: Path, tmp_path: Path) -> None:
    """A load into an existing model of the same shape but another LoRA seed: the model's history is the saved
    state's, which started from the saved model's seed, so its bundle records that seed and replays."""
    c = Client(svc)
    a, b = c.create(seed=1), c.create(seed=4)
    for m in (a, b):
        assert c.forward_backward(m, fb_record([list(t) for t in TOKENS]))[0] and c.optim_step(m)[0]
    path, _bundle, _ops = c.save(a, "seed-1")
    ok, body, _ = c.load(path, model_id=b, optimizer=False)
    assert ok, body
    assert c.forward_backward(b, fb_record([list(TOKENS[1])]))[0] and c.optim_step(b)[0]
    bundle = _verified(svc, policy, c, b, "seed-4-loaded", tmp_path)
    assert json.loads((bundle / "manifest.json").read_text())["op_chain"]["lora"]["seed"] == 1


def test_replay_catches_weights_changed_outside_the_chain(svc: Any, policy: Path, tmp_path: Path) -> None:
    import torch

    c = Client(svc)
    m = c.create(seed=6)
    assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0] and c.optim_step(m)[0]
    with torch.no_grad():  # a server that applies something the chain does not record
        svc.engine._params(svc.engine.models[m].adapter)[0].add_(1e-3)
    _path, bundle, ops = c.save(m, "tampered-server")
    ops_file = write_ops(tmp_path / "ops.jsonl", ops)
    code, doc = verify(bundle, policy, ops_file)
    assert (code, doc["verdict"]) == (0, "accepted")  # the chain alone cannot see it
    code, doc = verify(bundle, policy, ops_file, "--replay")
    replay = next(ch for ch in doc["checks"] if ch["name"] == "op_chain.replay")
    assert (code, doc["verdict"], replay["status"]) == (1, "rejected", "fail")
    assert "sha256" in replay["reason"] and "the bundle's are" in replay["reason"]


def test_a_dp_model_is_not_replayable_and_says_why(svc: Any, policy: Path, tmp_path: Path) -> None:
    c = Client(svc)
    m = c.create(seed=7, user_metadata=DP)
    assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0] and c.optim_step(m)[0]
    _path, bundle, ops = c.save(m, "dp-replay")
    code, doc = verify(bundle, policy, write_ops(tmp_path / "dp.jsonl", ops), "--replay")
    checks = {ch["name"]: ch for ch in doc["checks"]}
    assert (code, doc["verdict"]) == (1, "rejected")
    assert checks["op_chain.ops"]["status"] == "pass" and checks["privacy.dp"]["status"] == "pass"
    assert checks["op_chain.replay"]["status"] == "fail" and "CSPRNG" in checks["op_chain.replay"]["reason"]


# --- the verdict: JSON and exit code agree on every --ops path ------------------------------------------------------

@pytest.fixture(scope="module")
def trained(svc: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    c = Client(svc)
    m = c.create(seed=8)
    for _ in range(2):
        assert c.forward_backward(m, fb_record([list(t) for t in TOKENS])) and c.optim_step(m)[0]
    _path, bundle, ops = c.save(m, "json-vs-exit")
    return bundle, ops


def _changed(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = json.loads(json.dumps(ops))
    out[0]["data"][0]["model_input"][0] += 1
    return out


@pytest.mark.parametrize("case", ["honest", "one more", "one less", "one changed", "not an object", "float32 overflow",
                                  "huge float in weights", "int64 overflow", "int32 overflow", "infinite adam",
                                  "huge integer adam", "huge integer epsilon", "float token"])
def test_the_json_verdict_and_the_exit_code_agree(svc: Any, policy: Path, trained: tuple[Path, list[dict[str, Any]]],
                                                  tmp_path: Path, case: str) -> None:
    bundle, ops = trained
    ops = json.loads(json.dumps(ops))
    fb = ops[0]["data"][0]
    text = None
    if case == "one more":
        ops.append(ops[-1])
    elif case == "one less":
        ops.pop()
    elif case == "one changed":
        ops = _changed(ops)
    elif case == "float32 overflow":
        fb["loss_fn_inputs"]["weights"][0] = 3.5e38
    elif case == "huge float in weights":
        fb["loss_fn_inputs"]["weights"][0] = 10 ** 400
    elif case == "int64 overflow":
        fb["loss_fn_inputs"]["target_tokens"][0] = 2 ** 63
    elif case == "int32 overflow":
        fb["model_input"][0] = 2 ** 31
    elif case == "infinite adam":
        text = json.dumps(ops[1]).replace('"learning_rate": 0.01', '"learning_rate": 1e400')
    elif case == "huge integer adam":
        ops[1]["adam_params"]["learning_rate"] = 10 ** 400
    elif case == "huge integer epsilon":
        ops[1]["dp_epsilon"] = 10 ** 400
    elif case == "float token":
        fb["model_input"][0] = 1.0
    lines = [json.dumps(op) for op in ops]
    if text is not None:
        lines[1] = text
    if case == "not an object":
        lines[1] = "[1, 2]"
    f = tmp_path / "ops.jsonl"
    f.write_text("\n".join(lines) + "\n")
    code, doc = verify(bundle, policy, f)
    check = next(ch for ch in doc["checks"] if ch["name"] == "op_chain.ops")
    if case == "honest":
        assert (code, doc["verdict"], check["status"]) == (0, "accepted", "pass")
    else:
        assert (code, doc["verdict"], check["status"]) == (1, "rejected", "fail"), check


def test_ops_against_a_bundle_without_an_op_chain_is_rejected(policy: Path, tmp_path: Path) -> None:
    root = Path(__file__).parent / "data"
    code, doc = verify(root / "bundle", root / "bundle-policy.yaml", write_ops(tmp_path / "o.jsonl", []))
    check = next(ch for ch in doc["checks"] if ch["name"] == "op_chain.ops")
    assert (code, doc["verdict"], check["status"]) == (1, "rejected", "fail")
    assert "records no op chain" in check["reason"]


@pytest.mark.parametrize("extra", [["--chain", "."], ["--parent", "."], []])
def test_ops_usage_errors_exit_2(trained: tuple[Path, list[dict[str, Any]]], policy: Path, tmp_path: Path,
                                 extra: list[str]) -> None:
    from app.cli import main

    bundle, _ops = trained
    if extra:
        argv = ["verify", *(["--chain", str(bundle.parent)] if extra[0] == "--chain" else
                            [str(bundle), "--parent", str(bundle)]), "--ops", str(tmp_path / "x.jsonl"), "--json"]
    else:  # an ops file that cannot be read at all, and a dataset key without a run to replay
        assert main(["verify", str(bundle), "--policy", str(policy), "--key-file", str(tmp_path / "k")]) == 2
        argv = ["verify", str(bundle), "--policy", str(policy), "--ops", str(tmp_path), "--json"]
    assert main(argv) == 2


def test_a_checkpoint_replayed_as_a_run_says_to_pass_its_ops(trained: tuple[Path, list[dict[str, Any]]],
                                                            policy: Path) -> None:
    code, doc = verify(trained[0], policy, None, "--replay")
    check = next(c for c in doc["checks"] if c["name"] == "training.replay")
    assert (code, doc["verdict"], check["status"]) == (1, "rejected", "fail") and "--ops" in check["reason"]


def test_a_finished_session_ends_its_sampling_sessions(svc: Any) -> None:
    """Sampling sessions end with the session that made them, so a key's cap counts live ones only."""
    c = Client(svc)
    made = [svc.create_sampling_session(c.owner, None, "cvm-tune/tiny-llama", c.session) for _ in range(3)]
    other = Client(svc)
    kept = svc.create_sampling_session(other.owner, None, "cvm-tune/tiny-llama", other.session)
    assert all(s in svc.samplers for s in [*made, kept])
    svc.finish_session("b" * 64, c.session)  # another key cannot end it
    assert all(s in svc.samplers for s in made)
    svc.finish_session(c.owner, c.session)
    assert not any(s in svc.samplers for s in made) and kept in svc.samplers
