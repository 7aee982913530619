"""Attested server-side custom losses: the SDK's ``create_custom_loss`` uploads a traced loss, the server rebuilds it
from its allow-list (anything else refused with the node named), trains with ``forward_backward_custom(data,
handle)`` in one server-side pass, and the loss's canonical hash is in every op that used it and in the manifest:
the client's record verifies, replays, and proves which loss trained the adapter.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_drive import ADAM, Server, _bundle
from tests.test_api import BASE, _client, _datums, _verify, close_clients, serving  # noqa: F401  (the fixture)


def neg_ll(logprobs, weights):  # noqa: ANN001, ANN201  (traced by torch.fx: plain parameters)
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def clipped_pg(logprobs, sampler, advantages):  # noqa: ANN001, ANN201
    import torch

    ratio = torch.exp(logprobs - sampler)
    loss = -(torch.clamp(ratio, 0.7, 1.3) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


def _doc(handle: Any) -> dict[str, Any]:
    from tinker.lib.public_interfaces.custom_loss import encode_graph

    return {"name": handle.name, "inputs": [i.model_dump(mode="json") for i in handle.inputs],
            "graph": encode_graph(handle).model_dump(mode="json")}


def _graph(fn: Any, ranks: dict[str, int]) -> dict[str, Any]:
    from tinker.lib.public_interfaces.custom_loss import trace_loss

    return _doc(trace_loss(fn, ranks, "s"))


# --- the rebuilt graph --------------------------------------------------------------------------------------------

def test_the_rebuilt_loss_computes_what_the_client_traced() -> None:
    import torch

    from app.api.engine.custom_loss import Loss

    loss = Loss(_graph(clipped_pg, {"logprobs": 1, "sampler": 1, "advantages": 1}))
    lp, q, a = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.5]), torch.tensor([0.5, 1.0, -2.0])
    value, metrics = loss(lp, q, a)
    want, want_metrics = clipped_pg(lp, q, a)
    assert torch.equal(value, want) and torch.equal(metrics["custom/ratio:mean"], want_metrics["custom/ratio:mean"])


@pytest.mark.parametrize(("change", "reason"), [
    (lambda d: d["graph"]["nodes"][2].update(target="os.system"), "calls 'os.system', which is not an allowed"),
    (lambda d: d["graph"]["nodes"][2].update(op="get_attr"), "is a get_attr"),
    (lambda d: d["graph"]["nodes"][2].update(op="call_module", target="evil"), "is a call_module"),
    (lambda d: d["graph"]["nodes"][2].update(op="call_method", target="backward"), "method 'backward'"),
    (lambda d: d["graph"]["nodes"][2]["args"].append({"ref": "later_node"}), "not an earlier node"),
    (lambda d: d["graph"]["nodes"].__setitem__(slice(2, 2), [dict(d["graph"]["nodes"][2], name=f"n{i}")
                                                             for i in range(300)]), "at most 256"),
    (lambda d: d["graph"]["nodes"][2]["args"].append([[[[[[[[[[1]]]]]]]]]]), "nested more than 8"),
    (lambda d: d["inputs"].append({"name": "extra", "rank": 1}), "the graph takes"),
    (lambda d: d["inputs"][1].update(rank=2), "rank 1"),
])
def test_anything_outside_the_allow_list_is_refused_with_the_node_named(change: Any, reason: str) -> None:
    from app.api.engine.custom_loss import Loss
    from app.api.errors import BadRequest

    doc = copy.deepcopy(_graph(neg_ll, {"logprobs": 1, "weights": 1}))
    change(doc)
    with pytest.raises(BadRequest, match=reason):
        Loss(doc)


def test_the_loss_id_is_the_hash_of_the_document_as_sent() -> None:
    from attestation.outputs import op_chain

    from app.api.engine.custom_loss import canonical

    doc = _graph(neg_ll, {"logprobs": 1, "weights": 1})
    loss_id, same = canonical(doc["name"], doc["inputs"], doc["graph"])
    assert same == doc and loss_id == op_chain.custom_loss_id(doc)
    other = copy.deepcopy(doc)
    other["name"] = "neg_ll2"
    assert op_chain.custom_loss_id(other) != loss_id


# --- through the SDK ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("api-custom"))


def test_a_server_side_custom_loss_trains_and_its_hash_is_proved(server: Server, tmp_path: Path) -> None:
    from attestation.outputs import op_chain
    from tinker import types

    sc = _client(server)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    handle = sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id == op_chain.custom_loss_id(_doc(handle))  # the client recomputes what the server named it
    datums = _datums(server)
    ops: list[dict[str, Any]] = []
    losses = []
    for _ in range(3):
        out = tc.forward_backward_custom(datums, handle).result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        losses.append(out.metrics["loss:sum"])
        assert out.metrics["custom/neg_ll:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
        ops += [{"op": "forward_backward", "loss_fn": "custom", "loss_fn_config": {"loss_id": handle.loss_id},
                 "data": [{"model_input": d.model_input.to_ints(),
                           "loss_fn_inputs": {k: v.tolist() for k, v in d.loss_fn_inputs.items()}} for d in datums]},
                {"op": "optim_step", "adam_params": types.AdamParams(**ADAM).model_dump(mode="json")}]
    assert losses[-1] < losses[0]
    path = tc.save_state("custom-3").result().path
    bundle = _bundle(server, tc.model_id, path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["op_chain"]["custom_losses"] == {handle.loss_id: _doc(handle)}
    code, out = _verify(server, bundle, ops, tmp_path, "--replay")
    assert code == 0 and "1 custom loss(es), each hashing to its id" in out and "replay: pass: 6 ops" in out, out
    other = json.loads(json.dumps(ops))
    other[0]["loss_fn_config"]["loss_id"] = "0" * 64  # a record naming another loss
    assert _verify(server, bundle, other, tmp_path)[0] == 1


def test_a_loss_of_another_session_or_key_is_not_found(server: Server) -> None:
    import tinker

    sc = _client(server)
    handle = sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    other = _client(server).create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="was not created in session"):  # refused before it is queued
        other.forward(_datums(server), "custom", {"loss_id": handle.loss_id}).result()


def test_the_spec_vector_is_what_the_sdk_sends() -> None:
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    block = re.search(r"^```custom-loss-vector\n(.*?)^```", text, flags=re.S | re.M).group(1)
    document = json.loads(dict(line.split(" = ", 1) for line in block.splitlines())["document"])
    assert _graph(neg_ll, {"logprobs": 1, "weights": 1}) == document
