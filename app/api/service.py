"""What the API's routes do: sessions, models, futures, checkpoints and sampling sessions, each owned by the API
key (its SHA-256) that created it; another key gets 404, as if it did not exist.

Every operation becomes a row in the state database (:mod:`app.api.proof.store`) and a job on the engine's one worker
(:mod:`app.api.engine.engine`); its future resolves to the job's result. Saves seal the adapter (and optimizer) under
``api/checkpoints/`` (:mod:`app.api.proof.vault`: built in RAM, never plaintext on the volume) and write an attested export
bundle under ``exports/`` (:mod:`app.api.proof.bundle`; sampler saves when asked, expiry, quota: ``vault.Storage``); loads
and samples decrypt a saved state into RAM for the engine. Listing, TTL, deletion and external weights (the stock
``tinker checkpoint`` commands) are :mod:`app.api.proof.checkpoints`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import uuid
from pathlib import Path
from typing import Any

from tinker import types

from attestation.io.hashing import sha256_file
from attestation.outputs import op_chain

from app.api import wire
from app.api.completions import Completions
from app.api.engine import dp as dpsgd
from app.api.engine.admission import admit
from app.api.engine.engine import Engine, Model
from app.api.engine.history import check_adam, load_record
from app.api.engine.loading import saved_dp
from app.api.engine.sample_batch import request_item
from app.api.engine.worker import run_job
from app.api.errors import BadRequest, NotFound, NotServed, TooMany
from app.api.proof.bundle import Exporter
from app.api.proof.checkpoints import Checkpoints, live
from app.api.proof.external import check_name
from app.api.proof.store import Checkpoint, Store
from app.api.proof.vault import Storage, Vault, size_of
from app.audit import utc_now
from app.config.api import ApiSettings
from app.fsutil import withdraw_dir

JSON = "application/json"
PROTO = "application/x-protobuf"


class Service:
    def __init__(self, *, out: Path, engine: Engine, store: Store, exporter: Exporter | None, base_name: str,
                 limits: ApiSettings, vault: Vault, agent: Any = None, collateral: Any = None) -> None:
        self.out, self.engine, self.store, self.exporter = Path(out), engine, store, exporter
        self.vault = vault  # saved states: sealed under the app's key, plaintext only in RAM
        self.agent, self.collateral = agent, collateral  # app.run.stages.Agent; quote -> collateral JSON or None
        self.tls: Any = None  # app.api.http.tls.TlsIdentity once serving TLS
        self.base_name, self.limits = base_name, limits
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.samplers: dict[str, tuple[str, str | None]] = {}  # sampling session id -> (owner, checkpoint path)
        self.sampler_session: dict[str, str] = {}  # sampling session id -> the session it belongs to (ended with it)
        self.custom_losses: dict[tuple[str, str], dict[str, Any]] = {}  # (owner, session) -> loss id -> custom_loss.Loss
        # long polls: (loop, event, box) per future; its finish puts (content type, body) in the box, then sets it
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event, list[tuple[str, bytes]]]]] = {}
        self._waiters_lock = threading.Lock()
        self.completions = Completions(limits.long_poll_s)  # retrieve_futures: finished samples per session
        self.storage = Storage(store, vault, exporter, limits)  # what saved states take: exports, expiry, quota
        self.store.fail_interrupted()
        self.storage.sweep()
        self.checkpoints = Checkpoints(self)  # list, info, TTL, delete, external weights (app.api.proof.checkpoints)

    # --- sessions and ownership --------------------------------------------------------------------

    def create_session(self, owner: str) -> str:
        sid = uuid.uuid4().hex
        self.sessions[sid] = owner
        return sid

    def finish_session(self, owner: str, sid: str) -> None:
        """The SDK's ``ServiceClient.close``: the session takes no new models; its models and checkpoints stay.
        Answered alike for an unknown session, another key's and one finished before (nothing to tell apart)."""
        if self.sessions.get(sid) == owner:
            del self.sessions[sid]
            for sampler in [s for s, session in self.sampler_session.items() if session == sid]:
                self.samplers.pop(sampler, None)  # its sampling sessions end with it (a key's cap counts live ones)
                del self.sampler_session[sampler]

    def _session(self, owner: str, sid: str) -> None:
        if self.sessions.get(sid) != owner:
            raise NotFound(f"session {sid} not found")

    def _model(self, owner: str, model_id: str) -> Model:
        if self.store.model_owner(model_id) != owner:
            raise NotFound(f"model {model_id} not found")
        return self.engine.get(model_id)

    def _checkpoint(self, owner: str, path: str) -> Checkpoint:
        c = self.store.checkpoint(path)
        if c is None or c.owner != owner:
            raise NotFound(f"checkpoint {path} not found")
        return live(self.storage, c)  # an external export, or deleted or expired: refused

    def _enqueue(self, owner: str, session: str, model_id: str | None, kind: str, fn: Any,
                 samples: int = 0, sampler: tuple[str, int | None] | None = None, op: Any = None,
                 sample: Any = None) -> dict[str, Any]:
        if self.store.pending(session) >= self.limits.max_queued_futures:
            raise TooMany(f"session has {self.limits.max_queued_futures} operations queued; wait for results")
        fid = uuid.uuid4().hex
        self.store.add_future(fid, owner=owner, session_id=session, model_id=model_id, kind=kind)
        def finish(ok: bool, ctype: str, body: bytes) -> None:
            m = self.engine.models.get(model_id) if model_id else None  # its chain head, in the same commit
            self.store.finish(fid, ok=ok, content_type=ctype, result=body,
                              head=(m.id, m.op_head, m.ops) if m else None)  # committed before anyone is told
            with self._waiters_lock:
                waiting = self._waiters.pop(fid, [])
            for loop, event, box in waiting:
                box.append((ctype, body))
                loop.call_soon_threadsafe(event.set)
            if sampler is not None:  # (sampling session, seq id): its poller learns of it by retrieve_futures
                self.completions.finished(sampler[0], sampler[1], fid, ok)

        self.engine.submit(run_job(fn, finish), model_id, op,  # op: a forward_backward that may share a pass
                           ahead=kind == "optim_step", sample=sample)  # sample: a request that may share a batch
        ids = [f"{fid}:{i}" for i in range(samples)] if samples else None
        return types.UntypedAPIFuture(request_id=fid, model_id=model_id, sample_sequence_ids=ids).model_dump(
            mode="json", exclude_none=True)

    @staticmethod
    def _ok(model: Any) -> tuple[bool, str, bytes]:
        return True, JSON, json.dumps(model.model_dump(mode="json", exclude_none=True)).encode()

    # --- models ------------------------------------------------------------------------------------

    def create_model(self, owner: str, req: types.CreateModelRequest) -> dict[str, Any]:
        self._session(owner, req.session_id)
        if req.base_model != self.base_name:
            raise BadRequest(f"base model {req.base_model!r} is not served (this server trains {self.base_name!r})")
        dp = dpsgd.options(req.user_metadata)  # DP-SGD for this model, when user_metadata asks for it
        if req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {req.optimizer_config.type!r} is not served (adamw only)")
        lora = (req.lora_config or types.LoraConfig(rank=32)).model_dump(mode="json")
        if not 1 <= lora["rank"] <= self.limits.max_lora_rank:
            raise BadRequest(f"LoRA rank {lora['rank']} is outside 1..{self.limits.max_lora_rank}")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if self.store.model_owner(model_id) is not None:
            raise BadRequest(f"model {model_id} exists already")
        self.engine.lora_config(lora)  # refuses a LoRA that targets nothing, before anything is recorded
        admit(self.engine, lora, self.limits.max_models, dp is not None)  # 503 at capacity, nothing recorded
        self.store.add_model(model_id, owner=owner, session_id=req.session_id, base_model=self.base_name, lora=lora,
                             dp=dp, op_head="0" * 64, ops=0)

        def run() -> tuple[bool, str, bytes]:
            admit(self.engine, lora, self.limits.max_models, dp is not None)  # again: others may have come first
            self.engine.create(model_id, lora, dp)
            return self._ok(types.CreateModelResponse(model_id=model_id))

        return self._enqueue(owner, req.session_id, model_id, "create_model", run)

    def get_info(self, owner: str, model_id: str) -> types.GetInfoResponse:
        if self.store.model_owner(model_id) != owner:
            raise NotFound(f"model {model_id} not found")
        m = self.engine.models.get(model_id)
        rank = m.lora["rank"] if m else None
        return types.GetInfoResponse(model_id=model_id, model_data=types.ModelData(
            arch=self.engine.arch, model_name=self.base_name, tokenizer_id=self.base_name), is_lora=True, lora_rank=rank,
            model_name=self.base_name)

    # --- training ----------------------------------------------------------------------------------

    def forward_backward(self, owner: str, raw: bytes) -> dict[str, Any]:
        op = wire.decode_forward_backward(raw, vocab=self.engine.vocab, max_seq_len=self.limits.max_seq_len,
                                          max_tokens=self.limits.max_tokens_per_request,
                                          model=lambda model_id: self._model(owner, model_id))
        session = op.model_id.split(":", 1)[0]
        if op.loss_fn == "custom":  # a loss this session created: rebuilt, checked, named by its hash
            from app.api.engine.custom_loss import lookup

            op.extra["custom"] = lookup(self.custom_losses.get((owner, session), {}), session, op)

        def run() -> tuple[bool, str, bytes]:
            outputs, metrics = self.engine.forward_backward(op)
            return True, PROTO, wire.forward_backward_output(outputs, metrics)

        return self._enqueue(owner, session, op.model_id, "forward" if op.forward_only else "forward_backward", run,
                             op=op)

    def create_custom_loss(self, owner: str, req: types.CreateCustomLossRequest) -> dict[str, Any]:
        """Rebuild the loss from its allow-listed operations and keep it for the session under its id
        (:mod:`app.api.engine.custom_loss`); the future answers the id."""
        from app.api.engine.custom_loss import create

        self._session(owner, req.session_id)
        loss = create(req, self.custom_losses.setdefault((owner, req.session_id), {}))
        return self._enqueue(owner, req.session_id, None, "create_custom_loss",
                             lambda: self._ok(types.CreateCustomLossResponse(loss_id=loss.id)))

    def optim_step(self, owner: str, req: types.OptimStepRequest) -> dict[str, Any]:
        self._model(owner, req.model_id)
        if not isinstance(req.optim_params, types.AdamParams):
            raise BadRequest("only Adam parameters (adam_params) are served")
        adam = req.optim_params.model_dump(mode="json")
        check_adam(adam)  # refused here, with the reason, before it is queued (and again by the engine)

        def run() -> tuple[bool, str, bytes]:
            metrics = self.engine.optim_step(req.model_id, adam)
            return self._ok(types.OptimStepResponse(metrics=metrics))

        return self._enqueue(owner, req.model_id.split(":", 1)[0], req.model_id, "optim_step", run)

    # --- checkpoints -------------------------------------------------------------------------------

    def save(self, owner: str, req: Any, kind: str) -> dict[str, Any]:
        self._model(owner, req.model_id)
        name = req.path or f"sampler-{req.sampling_session_seq_id}-{uuid.uuid4().hex[:8]}"
        check_name(name)
        segment = "weights" if kind == "training" else "sampler_weights"
        path = f"tinker://{req.model_id}/{segment}/{name}"
        if self.store.checkpoint(path) is not None:
            raise BadRequest(f"checkpoint {path} exists already; save under another name")
        anonymous = kind == "sampler" and req.path is None
        export, ttl = self.storage.options(req, kind)

        def run() -> tuple[bool, str, bytes]:
            self.storage.sweep()  # expired states go before this one is counted
            m = self.engine.models[req.model_id]
            c = Checkpoint(path, owner, req.model_id, kind, name, str(self.vault.root / uuid.uuid4().hex), None,
                           m.op_head, m.ops, m.lora, utc_now(), None if ttl is None else self.storage.now(ttl))
            with self.vault.plain() as ram:  # plaintext in RAM only; sealed onto the volume, then removed
                self.engine.save(m, ram, optimizer=kind == "training")
                self.storage.prepare(m, ram, export, path)  # refused past the quota: nothing written
                self.vault.seal(ram, c)
                c = dataclasses.replace(c, state_bytes=size_of(Path(c.dir)))
                bundle = None
                try:
                    bundle = self.storage.export(c, ram) if export else None
                    self.store.add_checkpoint(dataclasses.replace(c, bundle=str(bundle) if bundle else None,
                                                                  bundle_bytes=size_of(bundle) if bundle else 0))
                except BaseException:
                    self.vault.remove(c)  # not recorded: neither kept nor published
                    if bundle is not None:
                        withdraw_dir(bundle)
                    raise
            if kind == "training":
                return self._ok(types.SaveWeightsResponse(path=path))
            sid = self.create_sampling_session(owner, path, None, req.model_id.split(":", 1)[0]) if anonymous else None
            return self._ok(types.SaveWeightsForSamplerResponseInternal(path=None if anonymous else path,
                                                                       sampling_session_id=sid))

        return self._enqueue(owner, req.model_id.split(":", 1)[0], req.model_id, f"save_{kind}", run)

    def export(self, owner: str, path: str) -> dict[str, Any]:
        """The export bundle of a saved state, made now if its save made none, as its save would have made it (its
        head, op count and progress at the save); the future's result: ``{"path", "bundle"}``."""
        session = self._checkpoint(owner, path).model_id.split(":", 1)[0]
        if self.exporter is None:
            raise NotServed("this server makes no export bundles")

        def run() -> tuple[bool, str, bytes]:  # checked again when it runs: it may have expired since
            return True, JSON, json.dumps(self.storage.export_saved(self._checkpoint(owner, path))).encode()

        return self._enqueue(owner, session, None, "export", run)

    def load(self, owner: str, req: types.LoadWeightsRequest) -> dict[str, Any]:
        c = self._checkpoint(owner, req.path)
        if req.optimizer and c.kind != "training":
            raise BadRequest(f"{req.path} is sampler weights: it has no optimizer state")
        if req.session_id is not None:
            self._session(owner, req.session_id)
            model_id, session = f"{req.session_id}:train:{req.model_seq_id or 0}", req.session_id
            if self.store.model_owner(model_id) is not None:
                raise BadRequest(f"model {model_id} exists already")
            admit(self.engine, c.lora, self.limits.max_models)
            self.store.add_model(model_id, owner=owner, session_id=session, base_model=self.base_name, lora=c.lora,
                                 dp=None, op_head=c.op_head, ops=c.ops)
            new = True
        elif req.model_id is not None:
            m = self._model(owner, req.model_id)
            if m.lora["rank"] != c.lora["rank"] or any(m.lora[k] != c.lora[k] for k in
                                                        ("train_attn", "train_mlp", "train_unembed")):
                raise BadRequest(f"{req.path} has a different LoRA configuration than model {req.model_id}")
            model_id, session, new = req.model_id, req.model_id.split(":", 1)[0], False
        else:
            raise BadRequest("load_weights needs model_id, or session_id and model_seq_id")

        def run() -> tuple[bool, str, bytes]:
            try:
                with self.vault.opened(c) as src:  # decrypted and checked in RAM before the model is touched
                    if new:
                        admit(self.engine, c.lora, self.limits.max_models, saved_dp(src) is not None)
                    m = self.engine.create(model_id, c.lora, saved_dp(src)) if new else self.engine.models[model_id]
                    record = load_record(c, sha256_file(src / "adapter_model.safetensors"), req.optimizer,
                                         op_chain.GENESIS if new else m.op_head)
                    self.engine.load(m, src, optimizer=req.optimizer, record=record)  # linked into its chain
                    m.lora = dict(c.lora)  # the LoRA (seed) its history started from, which a replay starts from
            except BaseException:
                if new:
                    self.engine.discard(model_id)  # refused or failed: no model, and no record of it, stays
                    self.store.drop_model(model_id)
                raise
            return self._ok(types.LoadWeightsResponse(path=req.path, model_id=model_id))

        return self._enqueue(owner, session, model_id, "load_weights", run)

    def unload_model(self, owner: str, model_id: str) -> dict[str, Any]:
        """``UnloadModelRequest``: the model leaves memory after the operations queued before it; its checkpoints
        stay. Later operations on it get 404."""
        self._model(owner, model_id)

        def run() -> tuple[bool, str, bytes]:
            self.engine.discard(model_id)
            return self._ok(types.UnloadModelResponse(model_id=model_id, type="unload_model"))

        return self._enqueue(owner, model_id.split(":", 1)[0], model_id, "unload_model", run)

    # --- sampling ----------------------------------------------------------------------------------

    def create_sampling_session(self, owner: str, model_path: str | None, base_model: str | None,
                                session: str | None = None) -> str:
        """A sampling session of ``owner`` (ended with ``session``, when it names one of the owner's)."""
        if model_path is not None:
            self._checkpoint(owner, model_path)
        elif base_model != self.base_name:
            raise BadRequest(f"base model {base_model!r} is not served (this server samples {self.base_name!r})")
        sid = uuid.uuid4().hex
        self.samplers[sid] = (owner, model_path)
        if session is not None and self.sessions.get(session) == owner:
            self.sampler_session[sid] = session
        return sid

    def sampler(self, owner: str, sid: str) -> types.GetSamplerResponse:
        got = self.samplers.get(sid)
        if got is None or got[0] != owner:
            raise NotFound(f"sampling session {sid} not found")
        return types.GetSamplerResponse(sampler_id=sid, base_model=self.base_name, model_path=got[1])

    def sample(self, owner: str, req: types.SampleRequest) -> dict[str, Any]:
        if req.sampling_session_id is not None:
            got = self.samplers.get(req.sampling_session_id)
            if got is None or got[0] != owner:
                raise NotFound(f"sampling session {req.sampling_session_id} not found")
            path, session = got[1], req.sampling_session_id
        else:
            path, session = req.model_path, f"sample:{owner[:16]}"
            if path is None and req.base_model != self.base_name:
                raise BadRequest(f"base model {req.base_model!r} is not served")
        c = self._checkpoint(owner, path) if path else None
        item = request_item(req, self.engine, self.limits, lambda: self._sampler(c), f"{owner}/{session}")  # checked

        def run() -> tuple[bool, str, bytes]:
            return True, PROTO, self.engine.sample_request(item)

        return self._enqueue(owner, session, None, "sample", run, samples=req.num_samples,
                             sampler=(session, req.seq_id) if req.sampling_session_id is not None else None,
                             sample=item)

    def _sampler(self, c: Checkpoint | None) -> Any:
        """The checkpoint's RAM path for Engine.sample (its sampler cache is keyed by that path), or None (base)."""
        if c is None:
            return contextlib.nullcontext(None)
        return self.vault.sampler(c, lambda key: key in self.engine.samplers)

    # --- futures -----------------------------------------------------------------------------------

    async def retrieve(self, owner: str, fid: str) -> tuple[int, str, bytes]:
        """A future's result, a pending one waited for up to the long poll (then ``try_again``); registered before the
        read, so a result committed after it wakes the poll with the result itself (one store read a poll)."""
        event, box = asyncio.Event(), list[tuple[str, bytes]]()
        waiter = (asyncio.get_running_loop(), event, box)
        with self._waiters_lock:
            self._waiters.setdefault(fid, []).append(waiter)
        try:
            f = self.store.future(fid)
            if f is None or f.owner != owner:
                raise NotFound(f"future {fid} not found")
            if f.status == "pending":
                try:
                    async with asyncio.timeout(self.limits.long_poll_s):
                        await event.wait()
                except TimeoutError:
                    pass
                if box:
                    ctype, body = box[0]
                    return 200, ctype or JSON, body
                f = self.store.future(fid)  # the wait ran out: finished since, or still pending
        finally:
            with self._waiters_lock:
                if left := [w for w in self._waiters.pop(fid, []) if w is not waiter]:
                    self._waiters[fid] = left
        if f is None or f.status == "pending":
            return 200, JSON, json.dumps({"type": "try_again", "request_id": fid, "queue_state": "active"}).encode()
        return 200, f.content_type or JSON, f.result or b""

    async def retrieve_futures(self, owner: str, req: types.FuturesRetrieveRequest) -> types.FuturesRetrieveResponse:
        got = self.samplers.get(req.target.sampling_session_id)
        if got is None or got[0] != owner:
            raise NotFound(f"sampling session {req.target.sampling_session_id} not found")
        return await self.completions.poll(req)
