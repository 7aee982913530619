"""Hostile requests to the training API: deeply nested JSON, a token chunk that is not whole int32s and sampling
parameters outside their range are refused with a 4xx of category ``user`` (never a 500, never a queued operation
that then fails as a server error); a chunked body is refused as soon as it passes the size limit; sessions and
sampling sessions per API key are capped (429 with the reason); `cvm-tune api serve` exits 0 on SIGTERM.

The app runs in this process over the service a server runs (tests/api_inproc.py), except for the chunked body and
SIGTERM, which need the real command (tests/api_drive.py)."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_inproc import BASE, service

KEY, OTHER = "tml-r4-key", "tml-r4-other"
CAPS = "api:\n  max_sessions_per_key: 2\n  max_sampling_sessions_per_key: 3\n  long_poll_s: 0\n"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from starlette.testclient import TestClient

    from app.api.http.server import create_app

    with service(tmp_path_factory.mktemp("r4-api"), CAPS) as svc:
        keys = frozenset(hashlib.sha256(k.encode()).hexdigest() for k in (KEY, OTHER))
        with TestClient(create_app(svc, keys), raise_server_exceptions=False) as c:
            c.headers["X-API-Key"] = KEY
            c.svc = svc  # type: ignore[attr-defined]
            yield c


def _refused(r: Any, status: int, reason: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    doc = r.json()
    assert doc["category"] == "user" and reason in doc["detail"], doc


DEEP = b'{"tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("route", ["create_session", "create_model", "asample", "retrieve_futures",
                                   "create_sampling_session", "optim_step"])
def test_a_deeply_nested_body_is_a_400(client: Any, route: str) -> None:
    _refused(client.post(f"/api/v1/{route}", content=DEEP, headers={"Content-Type": "application/json"}), 400,
             "nested")


@pytest.mark.parametrize("size", [1, 5, 7])
def test_a_token_chunk_of_partial_int32s_is_a_400(client: Any, size: int) -> None:
    from tinker.proto import tinker_public_pb2 as pb

    from tests.api_inproc import Client

    owner = Client(client.svc, hashlib.sha256(KEY.encode()).hexdigest())  # this key's session
    try:  # a model of this key: the body is checked once its model is known to be there
        msg = pb.ForwardBackwardRequest(model_id=owner.create(rank=2), loss_fn="cross_entropy")
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = bytes(range(1, size + 1))
        r = client.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                        headers={"Content-Type": "application/x-protobuf"})
        _refused(r, 400, "whole int32")
    finally:  # the key's session slot back for the cap's test
        assert client.post(f"/api/v1/sessions/{owner.session}/finish", json={}).status_code == 200


def test_a_token_chunk_of_partial_int32s_is_refused_by_the_decoder() -> None:
    from tinker.proto import tinker_public_pb2 as pb

    from app.api.errors import BadRequest
    from app.api.wire import decode_forward_backward

    msg = pb.ForwardBackwardRequest(model_id="x:0", loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00\x02"
    with pytest.raises(BadRequest, match=r"data\[0\]: a token chunk of 5 bytes is not whole int32s"):
        decode_forward_backward(msg.SerializeToString(), vocab=100, max_seq_len=16, max_tokens=64)


BAD_PARAMS = [({"top_p": -0.1}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
              ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"), ({"temperature": float("inf")}, "temperature")]


def _futures(svc: Any) -> int:
    return svc.store._all("SELECT COUNT(*) FROM api_futures")[0][0]


@pytest.mark.parametrize(("params", "field"), BAD_PARAMS, ids=[str(p) for p, _ in BAD_PARAMS])
def test_sampling_parameters_out_of_range_are_a_400_of_category_user(client: Any, params: dict[str, Any],
                                                                     field: str) -> None:
    body = json.dumps({"base_model": BASE, "prompt": {"chunks": [{"tokens": [1, 5, 9], "type": "encoded_text"}]},
                       "num_samples": 1, "sampling_params": {"max_tokens": 2, **params}})
    body = body.replace("Infinity", "1e400")  # valid JSON for a number no float holds (read as infinity)
    before = _futures(client.svc)
    r = client.post("/api/v1/asample", content=body.encode(), headers={"Content-Type": "application/json"})
    _refused(r, 400, field)
    assert _futures(client.svc) == before  # refused before anything was queued


def test_valid_edge_sampling_parameters_sample(client: Any) -> None:
    """top_p 0 keeps the most probable token; top_k -1 and 0 filter nothing; the largest seed is accepted."""
    from tests.api_inproc import wait

    for params in ({"top_p": 0.0, "temperature": 1.0}, {"top_k": -1, "seed": 2**63 - 1}, {"top_k": 0, "seed": 0}):
        body = {"base_model": BASE, "prompt": {"chunks": [{"tokens": [1, 5, 9], "type": "encoded_text"}]},
                "num_samples": 1, "sampling_params": {"max_tokens": 2, **params}}
        r = client.post("/api/v1/asample", json=body)
        assert r.status_code == 200, r.text
        ok, result = wait(client.svc, r.json())
        assert ok, (params, result)


SESSION = {"tags": [], "user_metadata": None, "sdk_version": "0.38"}


def test_sessions_per_key_are_capped(client: Any) -> None:
    made = [client.post("/api/v1/create_session", json=SESSION).json()["session_id"] for _ in range(2)]
    _refused(client.post("/api/v1/create_session", json=SESSION), 429, "2 open sessions")
    other = client.post("/api/v1/create_session", json=SESSION, headers={"X-API-Key": OTHER})
    assert other.status_code == 200  # another key's cap is its own
    assert client.post(f"/api/v1/sessions/{made[0]}/finish", json={}).status_code == 200
    assert client.post("/api/v1/create_session", json=SESSION).status_code == 200  # a slot freed


def test_sampling_sessions_per_key_are_capped(client: Any) -> None:
    body = {"session_id": "s", "sampling_session_seq_id": 0, "base_model": BASE}
    for _ in range(3):
        assert client.post("/api/v1/create_sampling_session", json=body).status_code == 200
    before = len(client.svc.samplers)
    _refused(client.post("/api/v1/create_sampling_session", json=body), 429, "3 sampling sessions")
    assert len(client.svc.samplers) == before
    assert client.post("/api/v1/create_sampling_session", json=body, headers={"X-API-Key": OTHER}).status_code == 200


# --- the real command: chunked bodies and SIGTERM ---------------------------------------------------------------

LIMIT = 1 << 20
PREAMBLE = f"import app.api.http.server as _server\n_server.MAX_BODY = {LIMIT}\n"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.api_drive import Server

    srv = Server(tmp_path_factory.mktemp("r4-serve"), keys=(KEY,), preamble=PREAMBLE)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ["create_session", "forward_backward", "telemetry"])
def test_a_chunked_body_is_refused_once_it_passes_the_limit(real: Any, route: str) -> None:
    """Chunks past the limit, then nothing more (no final chunk): the 413 comes without the body ever ending."""
    ctype = "application/x-protobuf" if route == "forward_backward" else "application/json"
    with socket.create_connection(("127.0.0.1", real.port), timeout=20) as s:
        s.sendall(f"POST /api/v1/{route} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {KEY}\r\nContent-Type: {ctype}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())
        block = b" " * (64 << 10)
        sent = 0
        while sent <= LIMIT:
            s.sendall(b"%x\r\n%s\r\n" % (len(block), block))
            sent += len(block)
        start = time.monotonic()
        answer = b""
        while b"}" not in answer and (block := s.recv(4096)):  # the JSON reason ends the answer
            answer += block
        assert time.monotonic() - start < 15
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request body over" in answer


@pytest.mark.timeout(120)
def test_sigterm_ends_serve_with_exit_0(real: Any) -> None:
    assert real.proc is not None and real.proc.poll() is None
    real.stop()  # SIGTERM
    assert real.proc.returncode == 0, real.log.read_text()[-3000:]
