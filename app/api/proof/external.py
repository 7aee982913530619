"""External weights: a training client's state as an export bundle to download (``save_weights_external``), and the
signed URLs that serve its files (``get_external_weights_urls``), as the stock ``tinker checkpoint download`` fetches
them.

- **What is downloaded.** ``save_weights_external(name)`` saves the model's adapter into RAM, as a save does, and
  publishes its export bundle (:meth:`app.api.proof.vault.Storage.export`: the bundle a save makes, with the model's op
  chain as it is now) as the checkpoint ``tinker://<model>/external_weights/<name>``. Its files are the bundle's,
  under the names the bundle gives them, so the downloaded directory is what ``cvm-tune verify`` checks. Nothing is
  sealed: the record's directory is the bundle itself, so its expiry (``ttl_seconds``, swept as a saved state's) and
  its deletion remove the bundle, and the quota counts it while it is there.
- **The URLs.** One per file, on the origin the request came in on (the server's own listener), valid
  :data:`URL_TTL_S` seconds: ``ROUTE?checkpoint=…&file=…&expires=…&signature=…``. The signature is an HMAC-SHA256,
  under a key drawn when the server starts and held in its memory only (a restarted server signs new URLs), over the
  checkpoint, its bundle, its owner, the file and the expiry. The URL is the capability: no API key. A URL changed in
  any part (``expires`` with a leading zero too: each value has one spelling), signed by another server, or naming
  a checkpoint that does not exist is refused alike (403) before anything is read; a genuine one past its expiry, or
  whose export was deleted or expired since, answers 410. A deleted export leaves no record, so the server keeps,
  in memory as long as its signing key, who owned each export it deleted and its bundle's name: a genuine URL of
  one is told 410. The file is read from the bundle's directory, never through a link, and streamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tinker import types

from attestation.io.hashing import canonical_json

from app.api.errors import ApiError, BadRequest
from app.api.proof.store import Checkpoint
from app.api.proof.vault import TTL_S, Expired, size_of
from app.audit import utc_now
from app.fsutil import withdraw_dir

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # a checkpoint's name
ROUTE = "/api/v1/cvm_tune/external_weights"  # the signed URLs' route: served without an API key
URL_TTL_S = 900  # the CLI signs again when 5 minutes are left
QUERY = ("checkpoint", "expires", "file", "signature")
MAX_DELETED = 4096  # deleted exports remembered (their URLs answer 410)
REFUSED = "this download URL is not valid: it was changed, or signed for another file or by another server"


class Forbidden(ApiError):
    status = 403


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise BadRequest(f"checkpoint name {name!r}: 1-64 letters, digits, '.', '_' or '-'")


def bundle_files(bundle: Path) -> list[str]:
    """The regular files under ``bundle``, as paths relative to it (``/``-separated); links are not followed."""
    found = []
    for root, _dirs, names in os.walk(bundle):  # a link to a directory is listed, never entered
        for n in names:
            p = Path(root) / n
            if p.is_file() and not p.is_symlink():
                found.append(p.relative_to(bundle).as_posix())
    return sorted(found)


class External:
    """``svc``: the :class:`app.api.service.Service` whose models, storage and queue these use."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc
        self._key = secrets.token_bytes(32)  # in memory only: never on the volume
        self._deleted: dict[str, list[tuple[str, str]]] = {}  # path -> (owner, bundle name) of each export deleted

    def deleted(self, c: Checkpoint) -> None:
        """Remember that the export ``c`` was deleted (its record goes): its genuine URLs answer 410, not 403."""
        if c.bundle is not None:
            if len(self._deleted) >= MAX_DELETED:  # the oldest first: their URLs have expired long since
                del self._deleted[next(iter(self._deleted))]
            self._deleted.setdefault(c.path, []).append((c.owner, Path(c.bundle).name))

    def save(self, owner: str, req: types.SaveWeightsExternalRequest) -> dict[str, Any]:
        """Queue the export of the model's state as ``tinker://<model>/external_weights/<req.path>``; refused (400,
        nothing written) for a bad or taken name, a ttl out of range, or age recipients of the request's own."""
        svc = self.svc
        svc._model(owner, req.model_id)
        check_name(req.path)
        path = f"tinker://{req.model_id}/external_weights/{req.path}"
        if svc.store.checkpoint(path) is not None:
            raise BadRequest(f"checkpoint {path} exists already; save under another name")
        if req.age_encryption_recipients:
            raise BadRequest("age_encryption_recipients is not served: an export's weights are encrypted to the "
                             "server's export.recipients and the CVM's key, or not at all (the server's start line "
                             "says which)")
        ttl = req.ttl_seconds
        if ttl is not None and not TTL_S[0] <= ttl <= TTL_S[1]:
            raise BadRequest(f"ttl_seconds {ttl} is outside {TTL_S[0]}..{TTL_S[1]} (1 hour to 10 years)")
        if svc.exporter is None:
            raise BadRequest("this server makes no export bundles")

        def run() -> tuple[bool, str, bytes]:
            svc.storage.sweep()  # expired states and exports go before this one is counted
            m = svc.engine.models[req.model_id]
            c = Checkpoint(path, owner, req.model_id, "external", req.path, "", None, m.op_head, m.ops, m.lora,
                           utc_now(), None if ttl is None else svc.storage.now(ttl))
            with svc.vault.plain() as ram:  # the adapter in RAM only, as for a save
                svc.engine.save(m, ram, optimizer=False)
                svc.storage.prepare(m, ram, False, path)  # the progress the bundle records; refused past the quota
                bundle = svc.storage.export(c, ram)
            try:
                size = size_of(bundle)
                svc.store.add_checkpoint(dataclasses.replace(c, dir=str(bundle), bundle=str(bundle), state_bytes=size))
            except BaseException:
                withdraw_dir(bundle)  # not recorded: not published
                raise
            return svc._ok(types.SaveWeightsExternalResponseInternal(path=path, size_bytes=size))

        return svc._enqueue(owner, req.model_id.split(":", 1)[0], req.model_id, "save_external", run)

    def present(self, c: Checkpoint) -> Path:
        """The bundle of the external checkpoint ``c``; 410 once it was deleted or expired."""
        storage = self.svc.storage
        if c.removed_at is not None or (c.expires_at is not None and c.expires_at <= storage.now()) \
                or c.bundle is None or not Path(c.bundle).is_dir():
            raise Expired(f"the export {c.path} was deleted or expired: its files are gone; save it again")
        return Path(c.bundle)

    def urls(self, c: Checkpoint, origin: str) -> types.ExternalWeightsUrlsResponse:
        """A signed URL on ``origin`` for each file of the external checkpoint ``c``."""
        bundle = self.present(c)
        expires = int(self.svc.storage.clock()) + URL_TTL_S
        urls = {}
        for f in bundle_files(bundle):
            query = {"checkpoint": c.path, "file": f, "expires": str(expires),
                     "signature": self._mac(c.path, c.owner, bundle.name, f, expires)}
            urls[f] = f"{origin.rstrip('/')}{ROUTE}?{urllib.parse.urlencode(query)}"
        return types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc))

    def file(self, query: list[tuple[str, str]]) -> Path:
        """The file a signed URL's ``query`` names (its items, in order).

        Raises:
            Forbidden: not a URL this server signed, as it was signed (a missing checkpoint alike).
            Expired: a genuine URL past its expiry, or its export deleted or expired since.
        """
        got = dict(query)
        if len(query) != len(QUERY) or sorted(got) != list(QUERY) \
                or not re.fullmatch(r"0|[1-9][0-9]{0,11}", got["expires"]):  # one spelling: as signed
            raise Forbidden(REFUSED)
        expires = int(got["expires"])
        c = self.svc.store.checkpoint(got["checkpoint"])
        real = c is not None and c.kind == "external" and c.bundle is not None
        want = self._mac(got["checkpoint"], c.owner if real else "", Path(c.bundle).name if real else "",
                         got["file"], expires)  # computed either way: a missing checkpoint is refused alike
        if not hmac.compare_digest(want.encode(), got["signature"].encode()) or not real:
            for owner, bundle in self._deleted.get(got["checkpoint"], []):
                if hmac.compare_digest(self._mac(got["checkpoint"], owner, bundle, got["file"], expires).encode(),
                                       got["signature"].encode()):
                    raise Expired(f"the export {got['checkpoint']} was deleted: its files are gone; save it again")
            raise Forbidden(REFUSED)
        bundle, name = self.present(c), got["file"]  # gone: new URLs would not help either
        if expires <= self.svc.storage.clock():
            when = datetime.fromtimestamp(expires, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            raise Expired(f"this download URL expired at {when}: ask for new ones (get_external_weights_urls)")
        target = bundle
        for part in name.split("/"):
            if part in ("", ".", "..") or "\\" in part:
                raise Forbidden(REFUSED)
            target = target / part
            if target.is_symlink():
                raise Forbidden(REFUSED)
        if not target.is_file():
            raise Expired(f"{name} is no longer in the export {c.path}")
        return target

    def _mac(self, path: str, owner: str, bundle: str, file: str, expires: int) -> str:
        doc = {"checkpoint": path, "owner": owner, "bundle": bundle, "file": file, "expires": expires}
        return hmac.new(self._key, canonical_json(doc), hashlib.sha256).hexdigest()
