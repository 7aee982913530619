"""``cvm-tune verify --ops --replay`` on hostile bundles (issue 46, items 2 and 3): a bundle is re-executed only once
every other check passed, under the server's own limits and a time budget; whatever the server would refuse, or
what fails, is exit 1 (REJECTED) with the reason, never exit 70, and the JSON verdict says the same as the exit code.

The hostile bundles are made by the server's own exporter (simulator quote, signed, every other check passing) over
a real model's adapter, with a hostile ``op_chain`` (LoRA, determinism, custom losses) and ops that hash to its
head: what a compromised or buggy server, or a forger with a test CA, could publish.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from attestation.outputs import op_chain

from tests.api_inproc import Client, fb_record, service, verify, write_ops

NEG_LL = {"name": "neg_ll", "inputs": [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}], "graph": {
    "format": 1, "nodes": [
        {"args": [], "kwargs": {}, "name": "logprobs", "op": "placeholder", "target": "logprobs"},
        {"args": [], "kwargs": {}, "name": "weights", "op": "placeholder", "target": "weights"},
        {"args": [{"ref": "logprobs"}, {"ref": "weights"}], "kwargs": {}, "name": "mul", "op": "call_function",
         "target": "operator.mul"},
        {"args": [{"ref": "mul"}], "kwargs": {}, "name": "sum_1", "op": "call_method", "target": "sum"},
        {"args": [{"ref": "sum_1"}], "kwargs": {}, "name": "neg", "op": "call_function", "target": "operator.neg"},
        {"args": [{"tuple": [{"ref": "neg"}, {"dict": {"custom/neg_ll:sum": {"ref": "neg"}}}]}], "kwargs": {},
         "name": "output", "op": "output", "target": "output"}]}}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("r5-replay")) as s:
        yield s


@pytest.fixture(scope="module")
def policy(svc: Any) -> Path:
    return svc.out / "simulator-test-policy.yaml"


@pytest.fixture(scope="module")
def saved(svc: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A real model's saved adapter (in a directory of its own) and its LoRA."""
    c = Client(svc)
    m = c.create(rank=2, seed=0)
    model = svc.engine.models[m]
    dest = tmp_path_factory.mktemp("r5-adapter") / "state"
    svc.engine.save(model, dest, optimizer=False)
    return dest, dict(model.lora)


def _forge(svc: Any, saved: tuple[Path, dict[str, Any]], tmp: Path, ops: list[dict[str, Any]], *,
           lora: dict[str, Any] | None = None, custom: dict[str, Any] | None = None,
           determinism: dict[str, Any] | None = None, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(bundle, ops file): a bundle the server's exporter signs, whose op chain is ``ops``' (and the hostile rest)."""
    from app.api.proof import bundle as api_bundle

    if determinism is not None:
        real = api_bundle._determinism()
        monkeypatch.setattr(api_bundle, "_determinism", lambda: {**real, **determinism})
    src, real_lora = saved
    m = SimpleNamespace(lora=real_lora if lora is None else lora, op_head=op_chain.head(ops), ops=len(ops), steps=0,
                        last_adam=None, dp=None, custom_losses=custom or {}, losses=[], tokens_seen=0)
    bundle = svc.exporter.export(m, src, f"tinker://forged:train:0/weights/{tmp.name[:40]}")
    return bundle, write_ops(tmp / "ops.jsonl", ops)


def _custom(doc: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(custom_losses, ops): one custom op with ``doc``."""
    loss_id = op_chain.custom_loss_id(doc)
    op = fb_record([[1, 5, 9, 14]], "custom", {"loss_id": loss_id})
    return {loss_id: doc}, [op]


def _with_node(node: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(NEG_LL)
    doc["graph"]["nodes"].insert(2, node)
    return doc


def _datum(tokens: list[int], targets: list[int] | None = None, **inputs: Any) -> dict[str, Any]:
    return {"model_input": tokens, "loss_fn_inputs": {"target_tokens": targets if targets is not None else tokens,
                                                      **inputs}}


FB = fb_record([[1, 5, 9, 14, 3]])
REFUSED_NODE = {"args": [], "kwargs": {}, "name": "evil", "op": "call_function", "target": "os.system"}
POW = {"args": [10, 10**8], "kwargs": {}, "name": "big", "op": "call_function", "target": "operator.pow"}
RESHAPE = {"args": [{"ref": "logprobs"}, 7], "kwargs": {}, "name": "bad", "op": "call_method", "target": "reshape"}
REF_LIST, REF_OBJ = copy.deepcopy(NEG_LL), copy.deepcopy(NEG_LL)
REF_LIST["graph"]["nodes"][2]["args"][0] = {"ref": ["logprobs"]}
REF_OBJ["graph"]["nodes"][2]["args"][0] = {"ref": {}}
LORA = {"rank": 2, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}

# (id, forge keywords, ops, a phrase of the reason)
CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], str]] = [
    ("a loss the server refuses", {"custom": _custom(_with_node(REFUSED_NODE))[0]}, _custom(_with_node(
        REFUSED_NODE))[1], "not an allowed operation"),
    ("ref of a list", {"custom": _custom(REF_LIST)[0]}, _custom(REF_LIST)[1], "not an earlier node"),
    ("ref of an object", {"custom": _custom(REF_OBJ)[0]}, _custom(REF_OBJ)[1], "not an earlier node"),
    ("a runtime error of an allowed graph", {"custom": _custom(_with_node(RESHAPE))[0]},
     _custom(_with_node(RESHAPE))[1], "node bad (reshape) failed: RuntimeError"),
    ("pow(10, 10**8)", {"custom": _custom(_with_node(POW))[0]}, _custom(_with_node(POW))[1], "more than 64 bits"),
    ("LoRA rank 0", {"lora": {**LORA, "rank": 0}}, [FB], "rank 1 to 64"),
    ("LoRA rank 10^7", {"lora": {**LORA, "rank": 10**7}}, [FB], "rank 1 to 64"),
    ("no targets", {"lora": {**LORA, "train_attn": False, "train_mlp": False, "train_unembed": False}}, [FB],
     "targets no layer"),
    ("seed 2^70", {"lora": {**LORA, "seed": 2**70}}, [FB], "not a seed torch takes"),
    ("torch_threads 5000", {"determinism": {"torch_threads": 5000}}, [FB], "not a thread count"),
    ("a token id out of range", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        _datum([1, 2, 100_000])]}], "outside the vocabulary"),
    ("a target token out of range", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        _datum([1, 2, 3], [2, 3, 2**40])]}], "outside the vocabulary"),
    ("an unknown loss_fn", {}, [{**FB, "loss_fn": "no_such_loss"}], "is not served"),
    ("a length mismatch", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        _datum([1, 2, 3], [2, 3])]}], "has 2 values for 3 input tokens"),
    ("an empty datum", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [_datum([])]}],
     "has 0 tokens"),
    ("no data", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": []}], "with no data"),
    ("a datum past max_seq_len", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        _datum([3] * 3000)]}], "1 to 2048 allowed"),
    ("an op past max_tokens_per_request", {}, [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        _datum([3] * 2000) for _ in range(33)]}], "at most 65536 per request"),
    ("a loss_fn_config the loss does not take", {}, [{**FB, "loss_fn_config": {"beta": 1.0}}],
     "is not a setting of loss cross_entropy"),
    ("Adam parameters out of range", {}, [FB, {"op": "optim_step", "adam_params": {
        "learning_rate": 1.0, "beta1": 2.0, "beta2": 0.9, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}}],
     "adam_params.beta1"),
]


@pytest.mark.parametrize(("forge", "ops", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_verified_bundle_is_rejected_with_the_reason(svc: Any, policy: Path, saved: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, forge: dict[str, Any],
                                                               ops: list[dict[str, Any]], reason: str) -> None:
    bundle, ops_file = _forge(svc, saved, tmp_path, ops, monkeypatch=monkeypatch, **forge)
    code, doc = verify(bundle, policy, ops_file, "--replay")
    checks = {c["name"]: c for c in doc["checks"]}
    others = [n for n, c in checks.items() if c["status"] == "fail" and n != "op_chain.replay"]
    assert others == [], others  # the bundle verified: only the replay can reject it
    replay = checks["op_chain.replay"]
    assert (code, doc["verdict"], replay["status"]) == (1, "rejected", "fail"), (code, replay)
    assert reason in replay["reason"], replay["reason"]


def test_the_human_verdict_says_why_and_exits_1(svc: Any, policy: Path, saved: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    from app.cli import main

    bundle, ops_file = _forge(svc, saved, tmp_path, [FB], lora={**LORA, "rank": 0}, monkeypatch=monkeypatch)
    code = main(["verify", str(bundle), "--policy", str(policy), "--ops", str(ops_file), "--replay"])
    out = capsys.readouterr().out
    assert code == 1 and "REJECTED" in out and "replay: FAIL:" in out and "rank 1 to 64" in out, out


def test_a_bundle_that_failed_a_check_is_not_re_executed(svc: Any, policy: Path, saved: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsigned or tampered bundle never runs its graph or ops here: no engine is even made."""
    from app.api.engine import engine

    docs, ops = _custom(_with_node(POW))
    bundle, ops_file = _forge(svc, saved, tmp_path, ops, custom=docs, monkeypatch=monkeypatch)
    (bundle / "adapter" / "model.sig").unlink()  # unsigned: the signature check fails (so does the file list)

    def made(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the replay made an engine for a bundle that failed its checks")

    monkeypatch.setattr(engine.Engine, "__init__", made)
    code, doc = verify(bundle, policy, ops_file, "--replay")
    replay = next(c for c in doc["checks"] if c["name"] == "op_chain.replay")
    assert (code, doc["verdict"], replay["status"]) == (1, "rejected", "fail")
    assert replay["reason"].startswith("not replayed: the bundle failed ") and "verified" in replay["reason"]


def test_a_replay_past_its_time_budget_stops_with_the_reason(svc: Any, policy: Path, saved: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from app.api.proof import replay

    bundle, ops_file = _forge(svc, saved, tmp_path, [FB, FB], monkeypatch=monkeypatch)
    monkeypatch.setattr(replay, "OP_S", 0.0)
    code, doc = verify(bundle, policy, ops_file, "--replay")
    check = next(c for c in doc["checks"] if c["name"] == "op_chain.replay")
    assert code == 1 and check["status"] == "fail" and "past the replay's budget of 0 s an op" in check["reason"]
    monkeypatch.setattr(replay, "OP_S", 300.0)
    monkeypatch.setattr(replay, "TOTAL_S", -1.0)
    code, doc = verify(bundle, policy, ops_file, "--replay")
    check = next(c for c in doc["checks"] if c["name"] == "op_chain.replay")
    assert code == 1 and "passed its time budget" in check["reason"] and "before op 1 of 2" in check["reason"]


def test_a_custom_loss_replays_within_its_bounds(svc: Any, policy: Path, saved: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds refuse nothing a loss on tensors does: the neg_ll vector's bundle still replays (its weights are
    the untrained adapter's, which no op here changes: forward_backward alone leaves a gradient pending)."""
    docs, ops = _custom(NEG_LL)
    bundle, ops_file = _forge(svc, saved, tmp_path, ops, custom=docs, monkeypatch=monkeypatch)
    code, doc = verify(bundle, policy, ops_file, "--replay")
    check = next(c for c in doc["checks"] if c["name"] == "op_chain.replay")
    assert (code, check["status"]) == (0, "pass"), check
    assert json.loads((bundle / "manifest.json").read_text())["op_chain"]["custom_losses"] == docs
