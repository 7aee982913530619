"""The training API's service in this process (app.api.open_service: the engine, state database, vault and exporter a
server runs, without HTTP), driven by the SDK's own request types, and the client's record of the ops it sent.

Used by the history tests (tests/test_api_history.py, tests/test_api_history_stateful.py): they send hostile ops the
SDK itself would never send, and check every saved bundle against exactly what was sent.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OWNER = "a" * 64
BASE = "cvm-tune/tiny-llama"
TOKENS = ([1, 5, 9, 14, 3, 7], [2, 11, 4, 8, 6])
ADAM = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@contextlib.contextmanager
def service(tmp: Path, config: str = "") -> Iterator[Any]:
    from app.api import open_service
    from app.config import load_config

    cfg_file = tmp / "api.yaml"
    cfg_file.write_text(f"output:\n  dir: {tmp / 'out'}\n{config}")
    with open_service(load_config(cfg_file)) as svc:
        yield svc


def wait(svc: Any, fut: dict[str, Any], timeout: float = 120) -> tuple[bool, bytes]:
    """(succeeded, result body) of a future once the engine finished it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = svc.store.future(fut["request_id"])
        if f.status != "pending":
            return f.status == "done", f.result or b""
        time.sleep(0.01)
    raise TimeoutError(fut)


def fb_record(tokens: list[list[int]], loss_fn: str = "cross_entropy", config: dict[str, Any] | None = None,
              weights: float = 1.0) -> dict[str, Any]:
    """A forward_backward as the client records it (docs/api.md): next-token targets, one weight for every token."""
    return {"op": "forward_backward", "loss_fn": loss_fn, "loss_fn_config": config, "data": [
        {"model_input": t[:-1], "loss_fn_inputs": {"target_tokens": t[1:], "weights": [weights] * (len(t) - 1)}}
        for t in tokens]}


def fb_body(model_id: str, record: dict[str, Any]) -> bytes:
    """The protobuf body the SDK sends for ``record`` (the SDK's own encoder)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    data = [types.Datum(model_input=types.ModelInput.from_ints(d["model_input"]), loss_fn_inputs={
        k: types.TensorData(data=v, dtype="int64" if k == "target_tokens" else "float32", shape=[len(v)])
        for k, v in d["loss_fn_inputs"].items()}) for d in record["data"]]
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=record["loss_fn"], loss_fn_config=record.get("loss_fn_config")), model_id=model_id, seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


class Client:
    """One API key's session on the in-process service, keeping the record of every op that succeeded, per model."""

    def __init__(self, svc: Any, owner: str = OWNER) -> None:
        self.svc, self.owner = svc, owner
        self.session = svc.create_session(owner)
        self.ops: dict[str, list[dict[str, Any]]] = {}
        self.saved_records: dict[str, list[dict[str, Any]]] = {}  # tinker path -> the record of the ops it holds
        self._seq = 0

    def create(self, rank: int = 4, seed: int = 0, user_metadata: dict[str, Any] | None = None, **lora: bool) -> str:
        """A new model (``lora``: train_attn, train_mlp, train_unembed)."""
        from tinker import types

        req = types.CreateModelRequest(session_id=self.session, model_seq_id=self._next(), base_model=BASE,
                                       lora_config=types.LoraConfig(rank=rank, seed=seed, **lora),
                                       user_metadata=user_metadata)
        ok, body = wait(self.svc, self.svc.create_model(self.owner, req))
        assert ok, body
        model_id = json.loads(body)["model_id"]
        self.ops[model_id] = []
        return model_id

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _call(self, fn: Any, *args: Any) -> tuple[bool, bytes]:
        """Queue an op and wait for it; a refusal before queueing (the route's 4xx) is a failed result alike."""
        from app.api.errors import ApiError

        try:
            fut = fn(self.owner, *args)
        except ApiError as exc:
            return False, json.dumps({"error": str(exc), "category": "user", "status": exc.status}).encode()
        return wait(self.svc, fut)

    def forward_backward(self, model_id: str, record: dict[str, Any]) -> tuple[bool, bytes]:
        ok, body = self._call(self.svc.forward_backward, fb_body(model_id, record))
        if ok:
            self.ops[model_id].append(record)
        return ok, body

    def optim_step(self, model_id: str, adam: dict[str, Any] | None = None) -> tuple[bool, bytes]:
        from tinker import types

        adam = dict(ADAM if adam is None else adam)
        req = types.OptimStepRequest(model_id=model_id, optim_params=types.AdamParams(**adam))
        ok, body = self._call(self.svc.optim_step, req)
        if ok:
            record: dict[str, Any] = {"op": "optim_step", "adam_params": adam}
            eps = json.loads(body).get("metrics", {}).get("dp_epsilon")
            if eps is not None:
                record["dp_epsilon"] = eps
            self.ops[model_id].append(record)
        return ok, body

    def save(self, model_id: str, name: str) -> tuple[str, Path, list[dict[str, Any]]]:
        """(tinker path, bundle directory, the record of the ops that made it)."""
        from tinker import types

        ok, body = wait(self.svc, self.svc.save(self.owner, types.SaveWeightsRequest(model_id=model_id, path=name),
                                                "training"))
        assert ok, body
        path = json.loads(body)["path"]
        c = self.svc.store.checkpoint(path)
        self.saved_records[path] = list(self.ops[model_id])
        return path, Path(c.bundle), list(self.ops[model_id])

    def load(self, path: str, *, model_id: str | None = None, optimizer: bool = True) -> tuple[bool, bytes, str]:
        """Load ``path`` into ``model_id`` (or a new model); on success the model's record is the saved state's
        record, then the ``load`` op (its values from the checkpoint list and the bundle's manifest)."""
        from tinker import types

        c = self.svc.store.checkpoint(path)
        if model_id is None:
            req = types.LoadWeightsRequest(path=path, optimizer=optimizer, session_id=self.session,
                                           model_seq_id=self._next())
            target, before = f"{self.session}:train:{req.model_seq_id}", "0" * 64
        else:
            req = types.LoadWeightsRequest(path=path, optimizer=optimizer, model_id=model_id)
            target, before = model_id, self.svc.engine.models[model_id].op_head
        ok, body = self._call(self.svc.load, req)
        if ok:
            self.ops[target] = [*self.saved_records[path], load_line(Path(c.bundle), optimizer, before)]
        return ok, body, target


def weights_sha256(bundle: Path) -> str:
    """The plaintext SHA-256 of a bundle's adapter weights, as its manifest binds it."""
    m = json.loads((bundle / "manifest.json").read_text())
    conf = m.get("confidentiality")
    if conf:
        return next(v for k, v in conf["plaintext_sha256"].items() if "adapter_model" in k)
    return m["files"]["adapter/adapter_model.safetensors"]


def load_line(bundle: Path, optimizer: bool, model_head: str = "0" * 64) -> dict[str, Any]:
    """The ``load`` op a client records when it loads the state saved with ``bundle`` (docs/api.md): the state's
    path, chain head and op count from the bundle's ``op_chain``, its weights' plaintext hash."""
    chain = json.loads((bundle / "manifest.json").read_text())["op_chain"]
    return {"op": "load", "checkpoint": chain["checkpoint"], "checkpoint_head": chain["head"],
            "checkpoint_ops": chain["ops"], "weights_sha256": weights_sha256(bundle), "optimizer": optimizer,
            "model_head": model_head}


def write_ops(path: Path, ops: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(op) + "\n" for op in ops))
    return path


def verify(bundle: Path, policy: Path, ops: Path | None, *extra: str) -> tuple[int, dict[str, Any]]:
    """``cvm-tune verify BUNDLE --policy POLICY [--ops OPS] --json ...`` in this process: (exit code, the JSON)."""
    import io

    from app.cli import main

    argv = ["verify", str(bundle), "--policy", str(policy), "--json", *(["--ops", str(ops)] if ops else []), *extra]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, json.loads(buf.getvalue()) if buf.getvalue().strip() else {}
