"""Sealed directories: a directory of files encrypted onto the output volume under a key that never leaves the CVM.

The format of the nightly run's checkpoints (:mod:`app.training.checkpoints`) and of the training API's saved
states (``app.api.proof.vault``); each use has a key of its own (its own dstack ``GetKey`` path), so one never opens the
other's. A sealed directory holds::

    manifest.enc          the manifest, itself sealed (below)
    0000.enc, 0001.enc …  one sealed blob per plaintext file
    key-epochs.json       the dstack KMS key epochs the key was derived under (``app.keys_epoch``; absent: unknown)

Every ``.enc`` file is a cvm-tune STREAM file (``app.dataset.format``: AES-256-GCM chunks, HKDF keys, header MAC)
with content type ``application/octet-stream``. Each blob's authenticated header metadata names its ``path``,
``step`` and ``fingerprint``; the manifest (canonical JSON, ``cvm-tune/checkpoint/v1``) lists every blob with its
plaintext and ciphertext SHA-256 and the ``inputs`` the fingerprint stands for (named in a refusal). Opening checks
all of it: the key, every tag, the step and fingerprint of every blob, the set of blobs, the plaintext hashes; any
failure is :class:`Unusable` with a reason that names no data.

No pruning here: the caller seals into a staging directory and publishes it. After a KMS key rotation
:func:`reseal` opens a directory with its old epoch's key and replaces it, re-sealed under the current one, by
:func:`swap_in` (crash-safe: :func:`recover_swaps` finishes or undoes an interrupted swap).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from attestation.io.hashing import canonical_json

from app.dataset.format import BLOB_CONTENT_TYPE, encrypt_stream, open_encrypted
from app.errors import CvmTuneError, DatasetIntegrityError, HeaderIntegrityError, WrongKeyError
from app.fsutil import fsync_dir, fsync_tree, open_regular, staged_dir
from app.keys_epoch import EPOCHS_FILE, FixedKey, KeyEpochError, KeyEpochs, write_epochs

SCHEMA = "cvm-tune/checkpoint/v1"
MANIFEST = "manifest.enc"
BLOB_ID = "cvm-tune-checkpoint"
WRONG_KEY = "sealed with another key (other app id)"  # the reason for a key that does not open it


class Unusable(Exception):
    """A sealed directory cannot be opened (the message is the reason, naming no data)."""


def _seal_file(src: Path, dst: Path, key: bytes, metadata: dict[str, Any]) -> tuple[str, str, int]:
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        res = encrypt_stream(fin, fout, key, dataset_id=BLOB_ID, dataset_version=int(metadata["step"]),
                             metadata=metadata, content_type=BLOB_CONTENT_TYPE)
    return res.plaintext_sha256, res.ciphertext_sha256, res.plaintext_size


def seal_files(src: Path, stage: Path, *, key: bytes, step: int, fingerprint: str,
               inputs: Mapping[str, str], epochs: KeyEpochs | None = None) -> bytes:
    """Seal every regular file under ``src`` into the existing empty directory ``stage``: blobs, then the manifest,
    then the key ``epochs`` the key was derived under (when known).

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
    write_epochs(stage, epochs)
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
    present = {p.name for p in sealed.iterdir()} - {EPOCHS_FILE}
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
        return WRONG_KEY
    if isinstance(exc, DatasetIntegrityError | HeaderIntegrityError):
        return "corrupt (failed authentication)"
    if isinstance(exc, CvmTuneError):
        return "corrupt (not a sealed file)"
    return f"malformed manifest ({type(exc).__name__})"


SWAP_SUFFIX = ".pre-rekey"


def manifest_of(sealed: Path, key: bytes) -> dict[str, Any]:
    """The manifest of ``sealed`` opened with ``key`` (no check of step or fingerprint: what :func:`reseal` needs).

    Raises:
        Unusable: wrong key or not a sealed manifest.
    """
    buf = io.BytesIO()
    try:
        with _regular(Path(sealed) / MANIFEST) as fh:
            for chunk in open_encrypted(fh, key, content_type=BLOB_CONTENT_TYPE):
                buf.write(chunk)
        body = json.loads(buf.getvalue())
    except FileNotFoundError:
        raise Unusable("no manifest (interrupted save)") from None
    except (CvmTuneError, ValueError) as exc:
        raise Unusable(_reason(exc)) from None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        raise Unusable("manifest does not describe a sealed directory")
    return body


def swap_in(stage: Path, final: Path) -> None:
    """Replace the sealed directory ``final`` by the complete ``stage`` (same parent) without a moment where
    neither exists under a name :func:`recover_swaps` knows: ``final`` -> ``final.pre-rekey``, ``stage`` ->
    ``final``, fsync, then the old copy is removed."""
    fsync_tree(stage)
    old = final.with_name(final.name + SWAP_SUFFIX)
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(stage, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_swaps(parent: Path) -> None:
    """Finish or undo a :func:`swap_in` a kill interrupted: a ``X.pre-rekey`` next to a complete ``X`` is removed,
    one without ``X`` is renamed back (the old copy is then the only one)."""
    for old in Path(parent).glob(f"*{SWAP_SUFFIX}") if Path(parent).is_dir() else []:
        final = old.with_name(old.name[: -len(SWAP_SUFFIX)])
        if final.is_dir() and (final / MANIFEST).is_file():
            shutil.rmtree(old, ignore_errors=True)
        elif not final.exists():
            os.rename(old, final)


def reseal(sealed: Path, ram: Path, keys: Any, *, recorded: KeyEpochs | None, required: Iterable[str] = ()) -> bool:
    """Re-seal ``sealed`` under ``keys.current`` (``app.keys_epoch.EpochKeys``) when it was sealed under other key
    epochs: opened with the key of the epochs it records into ``ram`` (a RAM directory, removed after), sealed again
    into a staging sibling, swapped in. Returns whether it re-sealed.

    Raises:
        KeyEpochError: the old epoch's key cannot be had (the agent ignores the selectors; nothing changed).
        Unusable: no candidate key opens it (another app's key, or damaged; nothing changed).
    """
    sealed, last = Path(sealed), None
    if isinstance(keys, FixedKey):  # a key outside dstack (tests, tools): nothing to re-seal, open_sealed says why
        return False
    if keys.current_epochs is None and recorded is not None:  # epochs recorded, but this agent reports none
        try:
            manifest_of(sealed, keys.current)
            return False
        except Unusable:
            raise KeyEpochError(f"{sealed.name} was sealed under {recorded} and does not open with the key this guest "
                                "agent gives; the agent reports no key epochs, so it cannot be asked for that epoch's "
                                "key (dstack guest 0.6.5 / 0.5.15 or older ignores GetKey's selectors)") from None
    if not keys.stale(recorded):
        return False
    for key, _epochs in keys.candidates(recorded):
        try:
            body = manifest_of(sealed, key)
        except Unusable as exc:
            last = exc
            continue
        step, fingerprint, inputs = body["global_step"], body["fingerprint"], body.get("inputs", {})
        target, staged = Path(ram) / f"reseal-{sealed.name}", sealed.with_name(f".tmp-reseal-{sealed.name}")
        mode = sealed.stat().st_mode & 0o777
        shutil.rmtree(staged, ignore_errors=True)  # left by a kill before its swap: the original is intact
        try:
            open_sealed(sealed, target, key=key, step=step, fingerprint=fingerprint, inputs=inputs, required=required)
            with staged_dir(staged) as stage:
                seal_files(target, stage, key=keys.current, step=step, fingerprint=fingerprint, inputs=inputs,
                           epochs=keys.current_epochs)
            os.chmod(staged, mode)
            swap_in(staged, sealed)
        finally:
            shutil.rmtree(target, ignore_errors=True)
        return True
    if last is None:
        raise KeyEpochError(f"{sealed.name}: no key to open it")
    raise last  # no candidate opens it: another app's, or damaged (as before epochs, the caller skips it)
