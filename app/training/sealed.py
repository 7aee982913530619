"""Sealed directories: a directory of files encrypted onto the output volume under a key that never leaves the CVM.

The format of the nightly run's checkpoints (:mod:`app.training.checkpoints`) and of the training API's saved
states (``app.api.vault``); each use has a key of its own (its own dstack ``GetKey`` path), so one never opens the
other's. A sealed directory holds::

    manifest.enc          the manifest, itself sealed (below)
    0000.enc, 0001.enc …  one sealed blob per plaintext file

Every ``.enc`` file is a cvm-tune STREAM file (``app.dataset.format``: AES-256-GCM chunks, HKDF keys, header MAC)
with content type ``application/octet-stream``. Each blob's authenticated header metadata names its ``path``,
``step`` and ``fingerprint``; the manifest (canonical JSON, ``cvm-tune/checkpoint/v1``) lists every blob with its
plaintext and ciphertext SHA-256 and the ``inputs`` the fingerprint stands for (named in a refusal). Opening checks
all of it: the key, every tag, the step and fingerprint of every blob, the set of blobs, the plaintext hashes; any
failure is :class:`Unusable` with a reason that names no data.

No rename, fsync or pruning here: the caller seals into a staging directory and publishes it.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from attestation.io.hashing import canonical_json

from app.dataset.format import BLOB_CONTENT_TYPE, encrypt_stream, open_encrypted
from app.errors import CvmTuneError, DatasetIntegrityError, HeaderIntegrityError, WrongKeyError
from app.fsutil import open_regular, staged_dir

SCHEMA = "cvm-tune/checkpoint/v1"
MANIFEST = "manifest.enc"
BLOB_ID = "cvm-tune-checkpoint"


class Unusable(Exception):
    """A sealed directory cannot be opened (the message is the reason, naming no data)."""


def _seal_file(src: Path, dst: Path, key: bytes, metadata: dict[str, Any]) -> tuple[str, str, int]:
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        res = encrypt_stream(fin, fout, key, dataset_id=BLOB_ID, dataset_version=int(metadata["step"]),
                             metadata=metadata, content_type=BLOB_CONTENT_TYPE)
    return res.plaintext_sha256, res.ciphertext_sha256, res.plaintext_size


def seal_files(src: Path, stage: Path, *, key: bytes, step: int, fingerprint: str,
               inputs: Mapping[str, str]) -> bytes:
    """Seal every regular file under ``src`` into the existing empty directory ``stage``: blobs, then the manifest.

    Returns:
        The manifest plaintext (canonical JSON).

    Raises:
        OSError: ``src`` cannot be read or ``stage`` written (the caller removes ``stage``).
    """
    rels = sorted(p.relative_to(src).as_posix() for p in Path(src).rglob("*") if p.is_file() and not p.is_symlink())
    files = []
    for i, rel in enumerate(rels):
        blob = f"{i:04d}.enc"
        meta = {"path": rel, "step": step, "fingerprint": fingerprint}
        pt_sha, ct_sha, size = _seal_file(Path(src) / rel, Path(stage) / blob, key, meta)
        files.append({"path": rel, "blob": blob, "plaintext_sha256": pt_sha, "ciphertext_sha256": ct_sha,
                      "size": size})
    body = canonical_json({"schema": SCHEMA, "global_step": step, "fingerprint": fingerprint, "inputs": dict(inputs),
                           "files": files})
    with open(Path(stage) / MANIFEST, "xb") as fout:
        encrypt_stream(io.BytesIO(body), fout, key, dataset_id=BLOB_ID, dataset_version=step,
                       metadata={"path": MANIFEST, "step": step, "fingerprint": fingerprint},
                       content_type=BLOB_CONTENT_TYPE)
    return body


def _open_blob(path: Path, key: bytes, *, rel: str, step: int, fingerprint: str, sink: Any) -> str:
    """Decrypt one blob into ``sink`` (``write``); returns the plaintext SHA-256."""
    with _regular(path) as fh:
        stream = open_encrypted(fh, key, content_type=BLOB_CONTENT_TYPE)
        meta = stream.header.metadata
        if (stream.header.dataset_id, meta.get("path"), meta.get("step")) != (BLOB_ID, rel, step):
            raise Unusable(f"{path.name} belongs to another file or step")
        if meta.get("fingerprint") != fingerprint:
            raise Unusable("__fingerprint__")
        for chunk in stream:
            sink.write(chunk)
        return stream.plaintext_sha256


def _regular(path: Path) -> Any:
    """``path`` opened for reading; a FIFO, device or directory in its place is unusable (never blocks)."""
    try:
        return open_regular(path)
    except IsADirectoryError:
        raise Unusable(f"{path.name} is not a regular file") from None


def _read_manifest(sealed: Path, key: bytes, step: int, fingerprint: str, inputs: Mapping[str, str]) -> dict[str, Any]:
    if not (sealed / MANIFEST).is_file():
        raise Unusable("no manifest (interrupted save)")
    buf = io.BytesIO()
    try:
        _open_blob(sealed / MANIFEST, key, rel=MANIFEST, step=step, fingerprint=fingerprint, sink=buf)
    except Unusable as exc:
        if str(exc) != "__fingerprint__":
            raise
        buf = io.BytesIO()  # other inputs: read the manifest anyway to say which input differs
        with _regular(sealed / MANIFEST) as fh:
            for chunk in open_encrypted(fh, key, content_type=BLOB_CONTENT_TYPE):
                buf.write(chunk)
        theirs = json.loads(buf.getvalue()).get("inputs", {})
        differ = sorted(k for k in set(inputs) | set(theirs) if inputs.get(k) != theirs.get(k))
        raise Unusable(f"sealed for other inputs ({', '.join(differ) or 'fingerprint'} differ)") from None
    body = json.loads(buf.getvalue())
    if body.get("schema") != SCHEMA or body.get("global_step") != step:
        raise Unusable("manifest does not describe this checkpoint")
    return body


def _open_into(sealed: Path, target: Path, key: bytes, step: int, fingerprint: str, inputs: Mapping[str, str],
               required: Iterable[str]) -> None:
    body = _read_manifest(sealed, key, step, fingerprint, inputs)
    listed = {f["blob"] for f in body["files"]} | {MANIFEST}
    present = {p.name for p in sealed.iterdir()}
    if present != listed:
        raise Unusable(f"blobs {'missing' if listed - present else 'unexpected'}: {', '.join(sorted(listed ^ present))}")
    paths = [f["path"] for f in body["files"]]
    if any(Path(p).is_absolute() or ".." in Path(p).parts for p in paths) or not set(required) <= set(paths):
        raise Unusable("manifest lists unsafe or too few files")
    with staged_dir(target) as stage:
        for f in body["files"]:
            out = stage / f["path"]
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "xb") as sink:
                got = _open_blob(sealed / f["blob"], key, rel=f["path"], step=step, fingerprint=fingerprint, sink=sink)
            if got != f["plaintext_sha256"]:
                raise Unusable(f"hash mismatch: {f['path']}")


def open_sealed(sealed: Path, target: Path, *, key: bytes, step: int, fingerprint: str, inputs: Mapping[str, str],
                required: Iterable[str]) -> Path:
    """Decrypt the sealed directory ``sealed`` into ``target`` (replaced if present; built under a temp name and
    renamed, so ``target`` is complete or absent), checking everything the module docstring lists.

    Args:
        required: Plaintext files the manifest must list.

    Raises:
        Unusable: wrong key, a changed or missing byte, other step, fingerprint or files (the reason).
        OSError: the volume or ``target``'s file system failed (nothing is wrong with the sealed directory).
    """
    sealed, target = Path(sealed), Path(target)
    shutil.rmtree(target, ignore_errors=True)
    try:
        _open_into(sealed, target, key, step, fingerprint, inputs, required)
    except (CvmTuneError, ValueError, KeyError, TypeError) as exc:  # Unusable itself passes through
        raise Unusable(_reason(exc)) from None
    return target


def _reason(exc: BaseException) -> str:
    if isinstance(exc, WrongKeyError):
        return "sealed with another key (other app id)"
    if isinstance(exc, DatasetIntegrityError | HeaderIntegrityError):
        return "corrupt (failed authentication)"
    if isinstance(exc, CvmTuneError):
        return "corrupt (not a sealed file)"
    return f"malformed manifest ({type(exc).__name__})"
