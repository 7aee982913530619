"""Cross-key isolation on every data route of the training API: another key gets 404 ("not found", as if it did not
exist) for each session, model, checkpoint, sampling session and future it does not own, and nothing of the owner's
changes. The module builds its own state (it depends on no other test).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api_drive import ADAM, KEY, Server
from tests.api_inproc import TOKENS, fb_body, fb_record

BOB = "tml-bob-isolation-key"
BASE = "cvm-tune/tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("isolation"), "api:\n  long_poll_s: 1\n", keys=(KEY, BOB))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _post(srv: Server, route: str, key: str, body: Any, *, proto: bool = False) -> httpx.Response:
    headers = {"X-API-Key": key}
    if proto:
        return httpx.post(f"{srv.url}/api/v1/{route}", headers={**headers, "Content-Type": "application/x-protobuf"},
                          content=body, timeout=60)
    return httpx.post(f"{srv.url}/api/v1/{route}", headers=headers, json=body, timeout=60)


def _result(srv: Server, fid: str, key: str = KEY) -> Any:
    for _ in range(120):
        r = _post(srv, "retrieve_future", key, {"request_id": fid})
        r.raise_for_status()
        doc = r.json() if "json" in r.headers.get("content-type", "") else None
        if doc is None or doc.get("type") != "try_again":
            return doc if doc is not None else r.content
    raise AssertionError(f"future {fid} never completed")


@pytest.fixture(scope="module")
def alice(server: Server) -> dict[str, Any]:
    """Alice's session, model (one step), saved state, sampler weights, sampling session and a sample's future."""
    sid = _post(server, "create_session", KEY, {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    created = _post(server, "create_model", KEY, {"session_id": sid, "model_seq_id": 0, "base_model": BASE,
                                                  "lora_config": {"rank": 2, "seed": 0}}).json()
    model = _result(server, created["request_id"])["model_id"]
    fb = _post(server, "forward_backward", KEY, fb_body(model, fb_record([list(t) for t in TOKENS])), proto=True).json()
    _result(server, fb["request_id"])
    _result(server, _post(server, "optim_step", KEY, {"model_id": model, "adam_params": ADAM}).json()["request_id"])
    path = _result(server, _post(server, "save_weights", KEY, {"model_id": model, "path": "iso"}).json()["request_id"])["path"]
    sampler = _result(server, _post(server, "save_weights_for_sampler", KEY,
                                    {"model_id": model, "path": "iso-s"}).json()["request_id"])["path"]
    ss = _post(server, "create_sampling_session", KEY, {"session_id": sid, "sampling_session_seq_id": 0,
                                                        "model_path": sampler}).json()["sampling_session_id"]
    sample = _post(server, "asample", KEY, {"sampling_session_id": ss, "seq_id": 0, "num_samples": 1,
                                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                                            "sampling_params": {"max_tokens": 2, "temperature": 0}}).json()
    _result(server, sample["request_id"])
    return {"session": sid, "model": model, "path": path, "sampler": sampler, "sampling_session": ss,
            "future": sample["request_id"]}


def _head(srv: Server, model: str) -> tuple[str, str]:
    r = httpx.get(f"{srv.url}/api/v1/training_runs/{model}/checkpoints", headers={"X-API-Key": KEY}, timeout=30)
    r.raise_for_status()
    last = r.json()["checkpoints"][-1]["user_metadata"]
    return last["op_chain_head"], last["op_chain_ops"]


ROUTES = ["create_model", "get_info", "forward_backward", "forward_backward with bad data", "optim_step", "save_weights", "save_weights_for_sampler",
          "load_weights into the model", "load_weights into a new model", "checkpoints", "create_sampling_session",
          "samplers", "asample by path", "asample by session", "retrieve_future", "retrieve_futures"]


@pytest.mark.parametrize("route", ROUTES)
def test_another_key_gets_404_on_every_data_route(server: Server, alice: dict[str, Any], route: str) -> None:
    a = alice
    bob_sid = _post(server, "create_session", BOB, {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    before = _head(server, a["model"])
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    if route == "create_model":
        r = _post(server, route, BOB, {"session_id": a["session"], "model_seq_id": 9, "base_model": BASE})
    elif route == "get_info":
        r = _post(server, route, BOB, {"model_id": a["model"]})
    elif route == "forward_backward":
        r = _post(server, route, BOB, fb_body(a["model"], fb_record([list(TOKENS[0])])), proto=True)
    elif route == "forward_backward with bad data":  # the model is answered for first, whatever else is wrong
        r = _post(server, "forward_backward", BOB, fb_body(a["model"], fb_record([list(TOKENS[0])], weights=math.nan)),
                  proto=True)
    elif route == "optim_step":
        r = _post(server, route, BOB, {"model_id": a["model"], "adam_params": ADAM})
    elif route.startswith("save_weights"):
        r = _post(server, route, BOB, {"model_id": a["model"], "path": "bob-took-it"})
    elif route == "load_weights into the model":
        r = _post(server, "load_weights", BOB, {"model_id": a["model"], "path": a["path"], "optimizer": False})
    elif route == "load_weights into a new model":
        r = _post(server, "load_weights", BOB, {"session_id": bob_sid, "model_seq_id": 1, "path": a["path"],
                                                "optimizer": True})
    elif route == "checkpoints":
        r = httpx.get(f"{server.url}/api/v1/training_runs/{a['model']}/checkpoints", headers={"X-API-Key": BOB})
    elif route == "create_sampling_session":
        r = _post(server, route, BOB, {"session_id": bob_sid, "sampling_session_seq_id": 0, "model_path": a["sampler"]})
    elif route == "samplers":
        r = httpx.get(f"{server.url}/api/v1/samplers/{a['sampling_session']}", headers={"X-API-Key": BOB})
    elif route == "asample by path":
        r = _post(server, "asample", BOB, {"model_path": a["sampler"], "num_samples": 1, "prompt": prompt,
                                           "sampling_params": {"max_tokens": 2}})
    elif route == "asample by session":
        r = _post(server, "asample", BOB, {"sampling_session_id": a["sampling_session"], "seq_id": 1, "num_samples": 1,
                                           "prompt": prompt, "sampling_params": {"max_tokens": 2}})
    elif route == "retrieve_future":
        r = _post(server, route, BOB, {"request_id": a["future"]})
    else:
        r = _post(server, route, BOB, {"target": {"sampling_session_id": a["sampling_session"]}, "timeout": 0.1})
    assert r.status_code == 404 and "not found" in r.text, (route, r.status_code, r.text[:300])
    assert _head(server, a["model"]) == before  # nothing of Alice's changed


def test_finishing_another_keys_session_changes_nothing(server: Server, alice: dict[str, Any]) -> None:
    r = httpx.post(f"{server.url}/api/v1/sessions/{alice['session']}/finish", headers={"X-API-Key": BOB},
                   json={"reason": {"type": "success"}}, timeout=30)
    assert r.status_code == 200 and r.json() == {}  # answered alike for any session: nothing to tell apart
    created = _post(server, "create_model", KEY, {"session_id": alice["session"], "model_seq_id": 5, "base_model": BASE,
                                                  "lora_config": {"rank": 2}})
    assert created.status_code == 200, created.text  # Alice's session still takes models
    assert json.loads(json.dumps(_result(server, created.json()["request_id"])))["model_id"].startswith(alice["session"])


def test_a_sampler_save_is_exported_when_asked_and_only_by_its_key(server: Server, alice: dict[str, Any]) -> None:
    r = _post(server, "cvm_tune/export", BOB, {"tinker_path": alice["sampler"]})
    assert r.status_code == 404 and "not found" in r.text
    r = _post(server, "cvm_tune/export", KEY, {"tinker_path": alice["sampler"]})
    assert r.status_code == 200, r.text
    done = _result(server, r.json()["request_id"])
    from pathlib import Path

    assert done["path"] == alice["sampler"] and (Path(done["bundle"]) / "manifest.json").is_file()
    again = _result(server, _post(server, "cvm_tune/export", KEY, {"tinker_path": alice["sampler"]}).json()["request_id"])
    assert again["bundle"] == done["bundle"]  # made once
