"""A key's checkpoints as the SDK's ``RestClient`` and the stock ``tinker checkpoint`` CLI manage them: the list of a
training run and of the key, a training run's info, ``weights_info``, the TTL, deletion and external weights
(:mod:`app.api.proof.external`). Publishing is not served: a checkpoint is its key's alone. Another key's checkpoint or
training run, and one that does not exist, get the same 404.

Deleting never removes evidence. A saved state with an export bundle loses its sealed state; its bundle (what
``cvm-tune verify`` checks) and its record stay (the bundle still counts against ``api.max_saved_bytes``, and its
name stays taken: the bundle's op chain names it); the answer says so. A state without a bundle, and an external
export (a temporary bundle made to be downloaded), leave nothing: their record goes too. The removal runs in the
engine's order, after the operations queued before it; one queued after it that names the state is told it was
deleted (410).
"""

from __future__ import annotations

import json
from typing import Any

from tinker import types

from app.api.errors import ApiError, BadRequest, NotFound
from app.api.proof.external import External
from app.api.proof.store import Checkpoint
from app.api.proof.vault import TTL_S, Expired, Storage
from app.fsutil import withdraw_dir

SEGMENTS = ("weights", "sampler_weights", "external_weights")  # of tinker://<model>/<segment>/<name>
PAGE = (1, 1000)  # list_user_checkpoints: limit


class Failed(ApiError):
    status = 500


def live(storage: Storage, c: Checkpoint) -> Checkpoint:
    """``c`` to load, sample or export from; refused when it is an external export (files to download, 400), was
    deleted or expired (410)."""
    if c.kind == "external":
        raise BadRequest(f"{c.path} is an export to download (get_external_weights_urls, `tinker checkpoint "
                         "download`), not a saved state: load or sample the checkpoint it was saved from")
    if c.removed_at is not None and (c.expires_at is None or c.expires_at > c.removed_at):
        raise Expired(_deleted(c, c.removed_at))
    return storage.live(c)


def _deleted(c: Checkpoint, when: str) -> str:
    kept = f"; its export bundle {c.bundle} stays" if c.bundle else ""
    return f"checkpoint {c.path} was deleted at {when}: its saved state was removed{kept}"


def entry(c: Checkpoint) -> types.Checkpoint:
    """``c`` as the SDK lists it; ``user_metadata`` names its export bundle and op chain."""
    return types.Checkpoint(checkpoint_id=c.path.split("/", 3)[-1], checkpoint_type=c.kind, time=c.created_at,
                            tinker_path=c.path, size_bytes=c.state_bytes + c.bundle_bytes, expires_at=c.expires_at,
                            user_metadata={"bundle": c.bundle or "", "op_chain_head": c.op_head,
                                           "op_chain_ops": str(c.ops)})


class Checkpoints:
    """``svc``: the :class:`app.api.service.Service` whose store, storage, vault and queue these use."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc
        self.external = External(svc)

    # --- reading -----------------------------------------------------------------------------------

    def list_run(self, owner: str, model_id: str) -> types.CheckpointsListResponse:
        """``RestClient.list_checkpoints``: a training run's checkpoints still there."""
        self._run(owner, model_id)
        return types.CheckpointsListResponse(checkpoints=[
            entry(c) for c in self.svc.store.checkpoints(model_id) if c.removed_at is None])

    def list_key(self, owner: str, query: dict[str, str]) -> types.CheckpointsListResponse:
        """``RestClient.list_user_checkpoints``: one page of the key's checkpoints, newest first."""
        try:
            limit, offset = int(query.get("limit", "100")), int(query.get("offset", "0"))
        except ValueError:
            raise BadRequest("limit and offset must be integers") from None
        if not PAGE[0] <= limit <= PAGE[1] or offset < 0:
            raise BadRequest(f"limit must be {PAGE[0]}..{PAGE[1]} and offset at least 0")
        found, total = self.svc.store.owned_checkpoints(owner, limit, offset)
        return types.CheckpointsListResponse(checkpoints=[entry(c) for c in found],
                                             cursor=types.Cursor(offset=offset, limit=limit, total_count=total))

    def training_run(self, owner: str, model_id: str) -> types.TrainingRun:
        """``RestClient.get_training_run`` (``tinker checkpoint info``): the model, its LoRA, its last checkpoints."""
        rec = self._run(owner, model_id)
        there = [c for c in self.svc.store.checkpoints(model_id) if c.removed_at is None]
        last = {kind: max((c for c in there if c.kind == kind), key=lambda c: c.created_at, default=None)
                for kind in ("training", "sampler")}
        return types.TrainingRun(
            training_run_id=model_id, base_model=rec["base_model"], model_owner=f"api key sha256:{owner[:16]}",
            is_lora=True, lora_rank=rec["lora"]["rank"], last_request_time=rec["last_request"],
            last_checkpoint=entry(last["training"]) if last["training"] else None,
            last_sampler_checkpoint=entry(last["sampler"]) if last["sampler"] else None)

    def weights_info(self, owner: str, path: str) -> types.WeightsInfoResponse:
        """``RestClient.get_weights_info_by_tinker_path``: the base model and LoRA configuration of a checkpoint."""
        c = self._present(self._owned(owner, path))
        return types.WeightsInfoResponse(base_model=self.svc.base_name, is_lora=True, lora_rank=c.lora["rank"],
                                         train_unembed=c.lora.get("train_unembed"), train_mlp=c.lora.get("train_mlp"),
                                         train_attn=c.lora.get("train_attn"))

    def urls(self, owner: str, model_id: str, checkpoint_id: str, origin: str) -> types.ExternalWeightsUrlsResponse:
        """``RestClient.get_external_weights_urls``: signed URLs, on ``origin``, for an external checkpoint's files."""
        c = self.owned(owner, model_id, checkpoint_id)
        if c.kind != "external":
            raise BadRequest(f"{c.path} is not external weights: only tinker://<model>/external_weights/<name> has "
                             "files to download (save_weights_external makes one)")
        return self.external.urls(c, origin)

    # --- changing ----------------------------------------------------------------------------------

    def set_ttl(self, owner: str, model_id: str, checkpoint_id: str, ttl: int | None) -> None:
        """``RestClient.set_checkpoint_ttl_from_tinker_path``: expire ``ttl`` seconds from now (None: never)."""
        c = self._present(self.owned(owner, model_id, checkpoint_id))
        if ttl is not None and not TTL_S[0] <= ttl <= TTL_S[1]:
            raise BadRequest(f"ttl_seconds {ttl} is outside {TTL_S[0]}..{TTL_S[1]} (1 hour to 10 years)")
        self.svc.store.set_expiry(c.path, None if ttl is None else self.svc.storage.now(ttl))

    def refuse_publish(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        self.owned(owner, model_id, checkpoint_id)
        raise BadRequest("publishing checkpoints is not served: a checkpoint is its API key's alone (another key "
                         "gets 404); share its export bundle, or download it with `tinker checkpoint download`")

    async def delete(self, owner: str, model_id: str, checkpoint_id: str) -> dict[str, str]:
        """``RestClient.delete_checkpoint_from_tinker_path``, once the operations queued before it ran; what was
        removed and what stays (module docstring)."""
        c = self._present(self.owned(owner, model_id, checkpoint_id))
        fut = self.svc._enqueue(owner, f"rest:{owner[:16]}", None, "delete_checkpoint", lambda: self._remove(c.path))
        while True:  # the queue's own long poll: woken when the removal is committed
            _status, _ctype, body = await self.svc.retrieve(owner, fut["request_id"])
            doc = json.loads(body)
            if doc.get("type") != "try_again":
                break
        if "error" in doc:
            raise (Expired if doc.get("category") == "user" else Failed)(doc["error"])
        return doc

    def _remove(self, path: str) -> tuple[bool, str, bytes]:
        svc = self.svc
        c = svc.store.checkpoint(path)
        if c is None:
            raise Expired(f"checkpoint {path} was deleted meanwhile")
        c = self._present(c)  # swept meanwhile: says so
        now = svc.storage.now()
        if c.kind == "external":
            withdraw_dir(c.dir)
            svc.store.forget(c.path)
            self.external.deleted(c)  # its URLs answer 410
            done = {"deleted": c.path, "detail": f"the export {c.path} and its files were removed"}
        else:
            svc.vault.expire(c, _deleted(c, now))  # an operation queued since that names it is told why
            if c.bundle is None:
                svc.store.forget(c.path)
                done = {"deleted": c.path, "detail": f"the saved state of {c.path} was removed"}
            else:
                svc.store.mark_removed(c.path, now)
                done = {"deleted": c.path, "bundle": c.bundle, "detail": (
                    f"the saved state of {c.path} was removed; its export bundle {c.bundle} stays (evidence for "
                    "cvm-tune verify: nothing in it or in the audit chain needs the state)")}
        return True, "application/json", json.dumps(done).encode()

    # --- lookup ------------------------------------------------------------------------------------

    def owned(self, owner: str, model_id: str, checkpoint_id: str) -> Checkpoint:
        """The checkpoint ``tinker://<model_id>/<checkpoint_id>`` of ``owner`` (404 for anyone else's)."""
        if checkpoint_id.split("/", 1)[0] not in SEGMENTS:
            raise NotFound(f"checkpoint tinker://{model_id}/{checkpoint_id} not found")
        return self._owned(owner, f"tinker://{model_id}/{checkpoint_id}")

    def _owned(self, owner: str, path: str) -> Checkpoint:
        c = self.svc.store.checkpoint(path)
        if c is None or c.owner != owner:
            raise NotFound(f"checkpoint {path} not found")
        return c

    def _present(self, c: Checkpoint) -> Checkpoint:
        """``c`` unless it was deleted or expired (410)."""
        if c.kind == "external":
            self.external.present(c)
            return c
        return live(self.svc.storage, c)

    def _run(self, owner: str, model_id: str) -> dict[str, Any]:
        rec = self.svc.store.model(model_id)
        if rec is None or rec["owner"] != owner:
            raise NotFound(f"training run {model_id} not found")
        return rec
