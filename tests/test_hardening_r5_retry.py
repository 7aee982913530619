"""A retried request is applied once (issue 46, item 7): the unmodified tinker SDK sends a ``forward_backward`` and
an ``optim_step`` whose answers are lost after the server committed them (the connection drops before the
response); the SDK sends each again with the same ``seq_id``, gets the same future, and the model changes once: its
op chain holds each op once (``verify --ops`` with the client's record of two ops accepts the bundle) and the replay
of those two ops gives its weights bit for bit.

The service runs in this process behind uvicorn; a proxy in front of it drops the first answer of each route.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_inproc import BASE, Client, fb_body, fb_record, service, verify, wait, write_ops
from tests.test_hardening_r5_api import serving

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
KEY = "tml-r5-retry"
OWNER = hashlib.sha256(KEY.encode()).hexdigest()
DROP = ("/api/v1/forward_backward", "/api/v1/optim_step")


@contextlib.contextmanager
def dropping_proxy(upstream: str) -> Iterator[Any]:
    """A loopback HTTP proxy to ``upstream`` that, for the first request to each route of :data:`DROP`, forwards it,
    reads the server's whole answer (the operation is committed) and closes the connection without a response."""
    seen: dict[str, int] = {}
    dropped: list[str] = []
    http = httpx.Client(base_url=upstream, timeout=120)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length",
                                                                                  "connection")}
            r = http.request(self.command, self.path, content=body, headers=headers)
            seen[self.path] = seen.get(self.path, 0) + 1
            if self.path in DROP and seen[self.path] == 1:
                dropped.append(self.path)
                self.close_connection = True  # the answer is lost: no status line, the socket closes
                return
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        do_GET = do_POST = do_PUT = do_DELETE = _any  # noqa: N815

        def log_message(self, *_a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield type("Proxy", (), {"url": f"http://127.0.0.1:{httpd.server_address[1]}", "seen": seen,
                                 "dropped": dropped})()
    finally:
        httpd.shutdown()
        httpd.server_close()
        http.close()


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("r5-retry")) as s:
        yield s


def _kinds(svc: Any, model_id: str) -> list[str]:
    return [r[0] for r in svc.store._all("SELECT kind FROM api_futures WHERE model_id = ? ORDER BY created_at",
                                         (model_id,))]


def test_a_request_whose_answer_was_lost_is_applied_once(svc: Any, tmp_path: Path) -> None:
    import tinker
    from tinker import types

    tokens = [1, 5, 9, 14, 3, 7, 2, 11]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    adam = types.AdamParams(learning_rate=0.01)
    with serving(svc, (KEY,)) as url, dropping_proxy(url) as proxy:
        sc = tinker.ServiceClient(base_url=proxy.url, api_key=KEY)
        try:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            fb = tc.forward_backward([datum], "cross_entropy").result(timeout=120)
            tc.optim_step(adam).result(timeout=120)
            path = tc.save_state("once").result(timeout=120).path
        finally:
            sc.close("success").result(timeout=60)
    assert proxy.dropped == list(DROP), proxy.dropped  # each answer was lost once ...
    assert all(proxy.seen[p] == 2 for p in DROP), proxy.seen  # ... and the SDK sent the request again
    assert fb.metrics["loss:sum"] > 0
    model = path.removeprefix("tinker://").split("/", 1)[0]
    assert _kinds(svc, model).count("forward_backward") == 1 and _kinds(svc, model).count("optim_step") == 1
    m = svc.engine.models[model]
    assert (m.ops, m.steps) == (2, 1)
    record = [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:],
                                                         "weights": [1.0] * (len(tokens) - 1)}}]},
              {"op": "optim_step", "adam_params": adam.model_dump(mode="json")}]
    bundle = Path(svc.store.checkpoint(path).bundle)
    code, doc = verify(bundle, svc.out / "simulator-test-policy.yaml", write_ops(tmp_path / "ops.jsonl", record),
                       "--replay")
    checks = {c["name"]: c for c in doc["checks"]}
    assert code == 0 and checks["op_chain.ops"]["status"] == "pass", checks.get("op_chain.ops")
    assert json.loads((bundle / "manifest.json").read_text())["op_chain"]["ops"] == 2
    assert checks["op_chain.replay"]["status"] == "pass" and "bit-identical" in checks["op_chain.replay"]["reason"]


def _numbered(model_id: str, record: dict[str, Any], seq_id: int) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(fb_body(model_id, record))
    msg.seq_id = seq_id
    return msg.SerializeToString()


def test_a_seq_id_sent_again_answers_the_same_future_and_another_body_is_refused(svc: Any) -> None:
    c = Client(svc, OWNER)
    m = c.create(rank=2)
    fb, other = fb_record([[1, 5, 9, 14]]), fb_record([[2, 11, 4, 8]])
    adam = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    with serving(svc, (KEY,)) as url, httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60) as http:
        def post_fb(body: bytes) -> httpx.Response:
            return http.post("/api/v1/forward_backward", content=body,
                             headers={"Content-Type": "application/x-protobuf"})

        def post_step(seq: int, **changes: Any) -> httpx.Response:
            return http.post("/api/v1/optim_step", json={"model_id": m, "seq_id": seq, "type": "optim_step",
                                                         "adam_params": {**adam, **changes}})

        first = post_fb(_numbered(m, fb, 7))
        assert first.status_code == 200 and post_fb(_numbered(m, fb, 7)).json() == first.json()  # one future
        assert wait(svc, first.json())[0]
        before = (svc.engine.models[m].ops, len(_kinds(svc, m)))
        for r in (post_fb(_numbered(m, other, 7)), post_step(7)):  # another request under a taken seq_id
            assert r.status_code == 400 and r.json()["category"] == "user", r.text
            assert f"seq_id 7 of model {m} was taken by another request (forward_backward)" in r.json()["detail"]
        assert (svc.engine.models[m].ops, len(_kinds(svc, m))) == before  # nothing queued, nothing applied
        step = post_step(8)
        assert step.status_code == 200 and post_step(8).json() == step.json() and wait(svc, step.json())[0]
        assert post_step(8, learning_rate=0.02).status_code == 400  # the same seq_id, other parameters
        unnumbered = [post_fb(_numbered(m, fb, 0)) for _ in range(2)]  # no seq_id: each is its own request
        assert all(wait(svc, r.json())[0] for r in unnumbered)
    assert svc.engine.models[m].ops == before[0] + 3  # the step once, the two unnumbered ops each
