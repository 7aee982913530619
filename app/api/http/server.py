"""The Tinker REST API as SDK 0.38 speaks it (FastAPI), over :class:`app.api.service.Service`.

Bodies are parsed with the SDK's own pydantic types (``tinker.types``) and protobuf module; a malformed body, an
unknown model or a request over the limits is a 4xx whose body says why (the SDK surfaces it). A ``forward_backward``
or ``optim_step`` the SDK sends again (same ``seq_id``, its answer lost) answers its first future: applied once.
Routes not served answer 400 with the reason (``NotServed``: a 5xx would have the SDK retry for minutes). Every route
needs an API key but health, attestation and the signed download URLs of external weights (:mod:`app.api.proof.external`:
the URL is the capability).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from starlette.datastructures import Headers
from tinker import types

from attestation.io.safe_yaml import parse_json

from app.api.engine.sampling import check_params
from app.api.errors import ApiError, BadRequest, NotServed, TooLarge, TooMany, Unauthorized
from app.api.http import tls
from app.api.proof.external import ROUTE as DOWNLOAD
from app.api.service import Service

logger = logging.getLogger(__name__)
MAX_BODY = 64 << 20


class WeightsInfoRequest(BaseModel):
    """What ``RestClient.get_weights_info_by_tinker_path`` posts (SDK 0.38 has no type of its own for it)."""

    model_config = ConfigDict(extra="forbid")
    tinker_path: str


def accepted_keys(key_sha256: tuple[str, ...]) -> frozenset[str]:
    """SHA-256 hashes of the accepted keys: the config's, plus env ``CVM_TUNE_API_KEYS`` (comma-separated)."""
    env = [k.strip() for k in os.environ.get("CVM_TUNE_API_KEYS", "").split(",") if k.strip()]
    return frozenset({*key_sha256, *(hashlib.sha256(k.encode()).hexdigest() for k in env)})


def _json(model: BaseModel | dict[str, Any], status: int = 200) -> JSONResponse:
    body = model if isinstance(model, dict) else model.model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, status_code=status)


def create_app(svc: Service, keys: frozenset[str]) -> FastAPI:
    app = FastAPI(title="cvm-tune training API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _refused(_req: Request, exc: ApiError) -> JSONResponse:
        return _refusal(exc)

    app.add_middleware(_Gate, keys=keys)

    async def body(request: Request, model: type[Any]) -> Any:
        raw = await _read(request)
        try:
            data = parse_json(raw or b"{}", "the body", BadRequest, max_bytes=MAX_BODY)
            return model.model_validate(data)
        except BadRequest as exc:
            raise BadRequest(f"malformed {model.__name__}: {exc}") from None
        except ValidationError as exc:
            raise BadRequest(f"malformed {model.__name__}: {_first(exc)}") from None

    def capped(owner: str, owners: Iterable[str], cap: int, what: str) -> None:
        """Refuse one more ``what`` to ``owner`` when it holds ``cap`` (a client that opens them without end)."""
        if sum(o == owner for o in owners) >= cap:
            raise TooMany(f"this API key has {cap} {what}, the most the server allows (api config); close one or "
                          "reuse it")

    @app.get("/api/v1/healthz")
    async def healthz() -> Any:
        return _json(types.HealthResponse(status="ok"))

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> Any:
        return _json(types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
            model_name=svc.base_name, max_context_length=svc.limits.max_seq_len, trainable=True, sampleable=True)]))

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> Any:
        await body(request, types.ClientConfigRequest)
        return _json(types.ClientConfigResponse(use_pyqwest_transport=False, pjwt_auth_enabled=False,
                                                proto_compress_fwdbwd=False, sample_use_retrieve_futures=True,
                                                custom_loss_server_side=True, sample_join_sampling_session=False,
                                                parallel_fwdbwd_chunks=False))

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> Any:
        await body(request, types.ClientConfigRequest)
        return _json(types.ClientDynamicConfigResponse())

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> Any:
        await _read(request)  # accepted and dropped: nothing about a user's training leaves the CVM
        return _json({"status": "accepted"})

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> Any:
        await body(request, types.CreateSessionRequest)
        capped(request.state.owner, svc.sessions.values(), svc.limits.max_sessions_per_key, "open sessions")
        return _json(types.CreateSessionResponse(session_id=svc.create_session(request.state.owner)))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        await body(request, types.SessionHeartbeatRequest)
        return _json(types.SessionHeartbeatResponse())

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Any:
        await _read(request)  # {"reason": {"type": "success" | "errored" | "interrupted"}, "detail": ...}
        svc.finish_session(request.state.owner, session_id)
        return _json({})

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> Any:
        return _json(svc.create_model(request.state.owner, await body(request, types.CreateModelRequest)))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> Any:
        return _json(svc.get_info(request.state.owner, (await body(request, types.GetInfoRequest)).model_id))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> Any:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise BadRequest("forward_backward takes a protobuf body (Content-Type: application/x-protobuf)")
        raw, owner = await _read(request), request.state.owner
        model_id, seq_id, kind = _numbered(raw)  # a request sent again answers its first future (Store.once)
        return _json(svc.store.once(owner, model_id, seq_id, kind, raw, lambda: svc.forward_backward(owner, raw)))

    @app.post("/api/v1/cvm_tune/export")
    async def export_checkpoint(request: Request) -> Any:  # a saved state's export bundle, made when asked
        return _json(svc.export(request.state.owner, (await body(request, _ExportRequest)).tinker_path))

    @app.post("/api/v1/create_custom_loss")
    async def create_custom_loss(request: Request) -> Any:
        return _json(svc.create_custom_loss(request.state.owner, await body(request, types.CreateCustomLossRequest)))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> Any:
        req, owner = await body(request, types.OptimStepRequest), request.state.owner
        return _json(svc.store.once(owner, req.model_id, req.seq_id, "optim_step", req.model_dump_json().encode(),
                                    lambda: svc.optim_step(owner, req)))  # applied once, whatever the retries

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> Any:
        return _json(svc.save(request.state.owner, await body(request, types.SaveWeightsRequest), "training"))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Any:
        return _json(svc.save(request.state.owner, await body(request, types.SaveWeightsForSamplerRequest), "sampler"))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> Any:
        return _json(svc.load(request.state.owner, await body(request, types.LoadWeightsRequest)))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> Any:
        req = await body(request, WeightsInfoRequest)
        return _json(svc.checkpoints.weights_info(request.state.owner, req.tinker_path))

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request) -> Any:
        return _json(svc.unload_model(request.state.owner, (await body(request, types.UnloadModelRequest)).model_id))

    ckpts, one = svc.checkpoints, "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}"

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request) -> Any:
        return _json(ckpts.list_run(request.state.owner, model_id))

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request) -> Any:  # access_scope: a key sees only its own
        return _json(ckpts.training_run(request.state.owner, model_id))

    @app.get("/api/v1/checkpoints")
    async def user_checkpoints(request: Request) -> Any:
        return _json(ckpts.list_key(request.state.owner, dict(request.query_params)))

    @app.post("/api/v1/save_weights_external")
    async def save_external(request: Request) -> Any:
        req = await body(request, types.SaveWeightsExternalRequest)
        return _json(ckpts.external.save(request.state.owner, req))

    @app.get(one + "/external_weights_urls")
    async def external_urls(model_id: str, checkpoint_id: str, request: Request) -> Any:
        return _json(ckpts.urls(request.state.owner, model_id, checkpoint_id, str(request.base_url)))

    @app.put(one + "/ttl")
    async def checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request) -> Any:
        ttl = (await body(request, _TtlRequest)).ttl_seconds
        ckpts.set_ttl(request.state.owner, model_id, checkpoint_id, ttl)
        return _json({})

    @app.api_route(one + "/publish", methods=["POST", "DELETE"])
    async def publish(model_id: str, checkpoint_id: str, request: Request) -> Any:
        ckpts.refuse_publish(request.state.owner, model_id, checkpoint_id)

    @app.delete(one)
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request) -> Any:
        return _json(await ckpts.delete(request.state.owner, model_id, checkpoint_id))

    @app.get(DOWNLOAD)
    def download(request: Request) -> Any:  # a thread of its own; the file is streamed from the bundle
        return FileResponse(ckpts.external.file(request.query_params.multi_items()),
                            media_type="application/octet-stream", headers={"Cache-Control": "no-store"})

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> Any:
        req = await body(request, types.CreateSamplingSessionRequest)
        capped(request.state.owner, (o for o, _path in svc.samplers.values()), svc.limits.max_sampling_sessions_per_key,
               "sampling sessions")
        return _json(types.CreateSamplingSessionResponse(
            sampling_session_id=svc.create_sampling_session(request.state.owner, req.model_path, req.base_model,
                                                            req.session_id)))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> Any:
        return _json(svc.sampler(request.state.owner, sampler_id))

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> Any:
        req = await body(request, types.SampleRequest)
        check_params(req.sampling_params)  # refused here, with the reason, before it is queued
        return _json(svc.sample(request.state.owner, req))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        req = await body(request, types.FutureRetrieveRequest)
        status, ctype, payload = await svc.retrieve(request.state.owner, req.request_id)
        return Response(payload, status_code=status, media_type=ctype)

    @app.post("/api/v1/retrieve_futures")
    async def retrieve_futures(request: Request) -> Any:
        req = await body(request, types.FuturesRetrieveRequest)
        return _json(await svc.retrieve_futures(request.state.owner, req))

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> Any:
        await _read(request)  # operations run in order and are not cancelled; the result stays retrievable
        return _json({"status": "accepted"})

    @app.get("/api/v1/cvm_tune/attestation")
    def attestation(nonce: str = "") -> Any:  # a thread of its own: the guest agent's quote takes a while
        if svc.agent is None:
            raise NotServed("this server has no guest agent to quote with")
        return _json(tls.attestation(svc.agent, svc.tls, nonce, svc.collateral or (lambda _q: None)))

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def not_served(rest: str) -> Any:
        raise NotServed(f"/api/v1/{rest} is not served by the cvm-tune training API")

    return app


class _Stopped(BaseException):
    """SIGTERM or SIGINT while :func:`run_until_stopped` runs."""


def _stop(_signum: int, _frame: Any) -> None:
    raise _Stopped


def run_until_stopped(server: Any) -> None:
    """Run a ``uvicorn.Server`` until SIGTERM or SIGINT and return (``api serve`` then exits 0). After its graceful
    shutdown uvicorn raises the signal it caught again, under the handler found when it started: Python's defaults
    would end the process by SIGTERM itself, or with KeyboardInterrupt (exit 130). A signal before uvicorn takes
    over ends the run the same way."""
    import signal

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Gate:
    """Every HTTP request's size, encoding and key checks before any route; the key's SHA-256 becomes
    ``request.state.owner``. Plain ASGI: no task and no stream of its own per request (Starlette's
    ``BaseHTTPMiddleware`` took more of the server's CPU than the routes)."""

    def __init__(self, app: Any, keys: frozenset[str]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                if int(headers.get("content-length") or 0) > MAX_BODY:
                    raise TooLarge(f"request body over {MAX_BODY} bytes")
                if headers.get("content-encoding") not in (None, "identity"):
                    raise BadRequest("compressed request bodies are not served (client config proto_compress_fwdbwd "
                                     "is off)")
                if scope["path"] not in ("/api/v1/healthz", "/api/v1/cvm_tune/attestation", DOWNLOAD):
                    owner = hashlib.sha256((headers.get("x-api-key") or "").encode()).hexdigest()
                    if owner not in self.keys:
                        raise Unauthorized("unknown API key (X-API-Key)")
                    scope.setdefault("state", {})["owner"] = owner
            except ApiError as exc:
                await _refusal(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(exc: ApiError) -> JSONResponse:
    """A 4xx with its reason; category ``user``, as a refused operation's future reports it."""
    return JSONResponse({"detail": str(exc), "category": "user"}, status_code=exc.status)


async def _read(request: Request) -> bytes:
    """The request body, refused as soon as it passes :data:`MAX_BODY` (a chunked body announces no length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise TooLarge(f"request body over {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _numbered(raw: bytes) -> tuple[str, int, str]:
    """(model id, seq id, kind) of a forward_backward body, for :meth:`app.api.proof.store.Store.once` (seq id 0: none,
    or a body that does not parse, which the service then refuses with the reason)."""
    from google.protobuf.message import DecodeError
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError:
        return "", 0, ""
    return msg.model_id, msg.seq_id, "forward" if msg.forward_only else "forward_backward"


def _first(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"


class _TtlRequest(BaseModel):
    """``PUT …/checkpoints/<id>/ttl`` (``RestClient.set_checkpoint_ttl_from_tinker_path``): seconds from now, or
    null for none."""

    model_config = ConfigDict(extra="forbid")
    ttl_seconds: StrictInt | None


class _ExportRequest(BaseModel):
    """``POST /api/v1/cvm_tune/export``: the saved state whose export bundle to make (once; asking again answers the
    same bundle)."""

    model_config = ConfigDict(extra="forbid")
    tinker_path: str
