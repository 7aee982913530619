"""The op chain (attestation.outputs.op_chain): the documented test vector, and that any change to what was sent changes
the head; ops with no canonical form are refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attestation.outputs import op_chain

ROOT = Path(__file__).resolve().parent.parent
FB = {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
    {"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.5]}}]}
OPT = {"op": "optim_step", "adam_params": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                                           "weight_decay": 0.0, "grad_clip_norm": 0.0}}
HEAD_1 = "3f70537f721b8cd2ce4b8c655c529232c694e2bef75e6fd07d045184bdf6d1ac"
HEAD_2 = "0ef187b77b83a44dfa94abb8ede14d56c5bbfac336e467c63e4788b6231f9f31"


def test_the_documented_test_vector() -> None:
    assert op_chain.canonical(FB) == (
        b'{"data":[{"loss_fn_inputs":{"target_tokens":"020000000000000003000000000000000400000000000000",'
        b'"weights":"0000803f0000803f0000003f"},"model_input":"010000000200000003000000"}],'
        b'"loss_fn":"cross_entropy","loss_fn_config":null,"op":"forward_backward"}')
    assert op_chain.head([]) == op_chain.GENESIS
    assert op_chain.head([FB]) == HEAD_1 and op_chain.head([FB, OPT]) == HEAD_2


def test_the_spec_vector_recomputed_from_the_spec_alone() -> None:
    """An independent implementation of section 15 (hashlib, struct, json only) over the spec's own vector."""
    import hashlib
    import re
    import struct

    text = (ROOT / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    block = re.search(r"^```op-chain-vectors\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "section 15 has no op-chain-vectors block"
    v = dict(line.split(" = ", 1) for line in block.group(1).splitlines())

    def canon(op: dict) -> bytes:
        if op["op"] == "optim_step":
            doc = {"op": "optim_step", "adam_params": {k: struct.pack("<d", x).hex() for k, x in op["adam_params"].items()}}
        else:
            doc = {"op": op["op"], "loss_fn": op["loss_fn"], "loss_fn_config": op.get("loss_fn_config"), "data": [
                {"model_input": struct.pack(f"<{len(d['model_input'])}i", *d["model_input"]).hex(),
                 "loss_fn_inputs": {k: struct.pack(f"<{len(x)}{'q' if k == 'target_tokens' else 'f'}", *x).hex()
                                    for k, x in d["loss_fn_inputs"].items()}} for d in op["data"]]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    ops = [json.loads(v["op_1"]), json.loads(v["op_2"])]
    assert canon(ops[0]) == v["canonical_1"].encode() == op_chain.canonical(ops[0])
    h = bytes(32)
    for i, op in enumerate(ops, start=1):
        h = hashlib.sha256(b"cvm-tune-op-chain-v1:" + h + hashlib.sha256(canon(op)).digest()).digest()
        assert h.hex() == v[f"head_{i}"] == op_chain.head(ops[:i])
    assert ops == [FB, OPT] and v["head_2"] == HEAD_2


def test_plain_json_numbers_hash_as_the_sdk_sends_them() -> None:
    as_ints = json.loads(json.dumps(FB).replace("1.0, 1.0", "1, 1"))  # weights 1 and 1.0 are the same float32
    assert op_chain.head([as_ints, OPT]) == HEAD_2
    near = json.loads(json.dumps(FB))
    near["data"][0]["loss_fn_inputs"]["weights"][2] = 0.5000000001  # the same float32 as 0.5
    assert op_chain.head([near]) == HEAD_1


@pytest.mark.parametrize("change", ["token", "target", "weight", "loss", "lr", "order", "drop", "add"])
def test_every_change_changes_the_head(change: str) -> None:
    fb, opt = json.loads(json.dumps(FB)), json.loads(json.dumps(OPT))
    ops = [fb, opt]
    if change == "token":
        fb["data"][0]["model_input"][0] = 9
    elif change == "target":
        fb["data"][0]["loss_fn_inputs"]["target_tokens"][2] = 5
    elif change == "weight":
        fb["data"][0]["loss_fn_inputs"]["weights"][0] = 0.9
    elif change == "loss":
        fb["loss_fn"] = "importance_sampling"
    elif change == "lr":
        opt["adam_params"]["learning_rate"] = 0.002
    elif change == "order":
        ops = [opt, fb]
    elif change == "drop":
        ops = [fb]
    else:
        ops = [fb, opt, opt]
    assert op_chain.head(ops) != HEAD_2


@pytest.mark.parametrize("op, reason", [
    ({"op": "sample"}, "op must be one of"),
    ({"op": "optim_step"}, "needs adam_params"),
    ({"op": "forward_backward", "loss_fn": "cross_entropy", "data": [{"model_input": [1.5]}]}, "not a list of integers"),
    ({"op": "forward_backward", "loss_fn": "cross_entropy", "data": [{"model_input": [2**31]}]}, "in range"),
    ({"op": "forward_backward", "loss_fn": "cross_entropy",
      "data": [{"model_input": [1], "loss_fn_inputs": {"weights": [float("nan")]}}]}, "finite numbers"),
    ({"op": "optim_step", "adam_params": {"learning_rate": True}}, "finite numbers"),
])
def test_ops_without_a_canonical_form_are_refused(op: dict, reason: str) -> None:
    with pytest.raises(op_chain.OpChainError, match=reason):
        op_chain.canonical(op)


def test_read_ops_names_the_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "ops.jsonl"
    f.write_text(json.dumps(FB) + "\n\n" + json.dumps(OPT) + "\n")
    assert op_chain.head(op_chain.read_ops(f)) == HEAD_2
    f.write_text(json.dumps(FB) + "\n[1, 2]\n")
    with pytest.raises(op_chain.OpChainError, match="line 2: not a JSON object"):
        op_chain.read_ops(f)


def test_the_load_vector_recomputed_from_the_spec_alone() -> None:
    """Section 15's load line: canonical form (the object's JSON, sorted keys, no spaces) and the head after op_1,
    op_2 and it, recomputed with hashlib and json only."""
    import hashlib
    import re

    text = (ROOT / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    base = dict(line.split(" = ", 1) for line in re.search(
        r"^```op-chain-vectors\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines())
    v = dict(line.split(" = ", 1) for line in re.search(
        r"^```op-chain-load-vector\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines())
    op = json.loads(v["op_3"])
    canon = json.dumps(op, sort_keys=True, separators=(",", ":"))
    assert canon == v["canonical_3"] and op_chain.canonical(op) == canon.encode()
    h = bytes.fromhex(base["head_2"])
    assert op["checkpoint_head"] == base["head_2"] and op["checkpoint_ops"] == 2
    h = hashlib.sha256(b"cvm-tune-op-chain-v1:" + h + hashlib.sha256(canon.encode()).digest()).hexdigest()
    assert h == v["head_3"] == op_chain.head([json.loads(base["op_1"]), json.loads(base["op_2"]), op])


@pytest.mark.parametrize("change, reason", [
    ({"checkpoint_ops": 1}, "the 2 ops before it hash to"),
    ({"checkpoint_head": "1" * 64}, "the 2 ops before it hash to"),
    ({"weights_sha256": "AB" * 32}, "lower-case hex"),
    ({"optimizer": 1}, "true or false"),
    ({"extra": 1}, "unknown field"),
    ({"checkpoint": ""}, "checkpoint must be"),
    ({"checkpoint_ops": True}, "an integer"),
])
def test_a_load_line_out_of_place_or_malformed_has_no_chain(change: dict, reason: str) -> None:
    load = {"op": "load", "checkpoint": "tinker://s:train:0/weights/w", "checkpoint_head": HEAD_2, "checkpoint_ops": 2,
            "weights_sha256": "5e" * 32, "optimizer": True, "model_head": "0" * 64}
    op_chain.head([FB, OPT, load])
    with pytest.raises(op_chain.OpChainError, match=reason):
        op_chain.head([FB, OPT, {**load, **change}])


@pytest.mark.parametrize("value", [3.5e38, 10 ** 40, float("inf")])
def test_a_float32_field_beyond_its_range_has_no_canonical_form(value: float) -> None:
    op = json.loads(json.dumps(FB))
    op["data"][0]["loss_fn_inputs"]["weights"][0] = value
    with pytest.raises(op_chain.OpChainError, match="op 1: data\\[0\\].loss_fn_inputs.weights"):
        op_chain.head([op])


def test_the_custom_loss_vector_recomputed_from_the_spec_alone() -> None:
    """Section 15's custom-loss id: SHA-256 of the document's JSON, sorted keys, no spaces."""
    import hashlib
    import re

    text = (ROOT / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    v = dict(line.split(" = ", 1) for line in re.search(
        r"^```custom-loss-vector\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines())
    doc = json.loads(v["document"])
    assert json.dumps(doc, sort_keys=True, separators=(",", ":")) == v["document"]
    assert hashlib.sha256(v["document"].encode()).hexdigest() == v["loss_id"] == op_chain.custom_loss_id(doc)
