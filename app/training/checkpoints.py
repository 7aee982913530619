"""Sealed checkpoints: encrypted at rest, atomic, hashed; resume selection; the exported adapter.

HF Trainer writes plaintext, non-atomic checkpoints (a crash mid-save leaves a ``checkpoint-N``
that ``resume_from_checkpoint=True`` would pick). So the trainer writes into a private scratch
directory (RAM: ``/dev/shm`` by default, never the output volume) and, after each HF save, the
training callback calls :func:`seal_checkpoint`, which publishes an encrypted copy::

    run_dir/checkpoints/
      .tmp-checkpoint-N-xxxx/            staging (removed on failure, ignored and cleaned on resume)
      checkpoint-N/manifest.enc          the checkpoint manifest, itself sealed (below)
      checkpoint-N/0000.enc, 0001.enc …  one sealed blob per trainer file
      LATEST                             "checkpoint-N\\n", moved (atomically) only after the rename

Every ``.enc`` file is a cvm-tune STREAM file (``app.dataset.format``: AES-256-GCM chunks, HKDF
keys, header MAC) with content type ``application/octet-stream`` under the **checkpoint key**
(HKDF of dstack ``GetKey("cvm-tune/checkpoints/v1")``: bound to the app id, never on disk). Each
blob's authenticated header metadata names its ``path``, ``step`` and ``fingerprint``; the manifest
(canonical JSON, ``cvm-tune/checkpoint/v1``) lists every blob with its plaintext and ciphertext
SHA-256 and the run's ``inputs`` (config, dataset and base-model hashes). Order: blobs, fsync,
manifest, fsync, rename ``.tmp-…`` → ``checkpoint-N``, fsync the parent, then ``LATEST``. A kill
at any point leaves either the previous state or the complete new checkpoint.

:func:`restore_checkpoint` tries every ``checkpoint-N`` newest first (``LATEST`` is repaired to
name the one resumed), decrypts into the scratch directory and checks everything; a candidate that fails (no manifest =
interrupted save, wrong key, a changed byte, other inputs) is skipped with a reason naming no data.

The final adapter (:func:`export_adapter`) is staged next to ``run_dir/"adapter"`` and renamed
into place. No torch here: the model object is passed in.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.dataset.format import BLOB_CONTENT_TYPE, encrypt_stream, open_encrypted
from app.errors import (
    CvmTuneError,
    DatasetIntegrityError,
    HeaderIntegrityError,
    StateError,
    TrainingError,
    WrongKeyError,
)
from app.fsutil import atomic_write_bytes, fsync_dir, fsync_tree, staged_dir
from attestation.hashing import canonical_json, sha256_hex

logger = logging.getLogger(__name__)

CHECKPOINT_SCHEMA = "cvm-tune/checkpoint/v1"
MANIFEST = "manifest.enc"
LATEST = "LATEST"
CHECKPOINT_GETKEY_PATH = "cvm-tune/checkpoints/v1"
ADAPTER_IN_RAM = "adapter.in-ram"  # run_dir marker: the confidential adapter's RAM directory (adapter_home)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
REQUIRED_FILES = ("trainer_state.json", "adapter_model.safetensors")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_BLOB_ID = "cvm-tune-checkpoint"


@dataclass(frozen=True)
class ResumeChoice:
    """Outcome of :func:`restore_checkpoint`.

    Attributes:
        path: The decrypted checkpoint in the scratch directory, or ``None`` to train from scratch.
        step: Its global step (``None`` with ``path``).
        rejected: ``(directory name, reason)`` for every newer candidate that was skipped.
    """

    path: Path | None
    step: int | None
    rejected: list[tuple[str, str]] = field(default_factory=list)


class _Unusable(Exception):
    """A candidate checkpoint cannot be resumed (the message is the reason)."""


def checkpoint_dirs(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every sealed ``checkpoint-N`` directory, newest (highest step) first."""
    found: list[tuple[int, Path]] = []
    if Path(checkpoints_dir).is_dir():
        for entry in Path(checkpoints_dir).iterdir():
            match = _CKPT_RE.match(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


def latest_name(checkpoints_dir: Path) -> str | None:
    """The checkpoint ``LATEST`` names, if it names a well-formed one."""
    try:
        name = (Path(checkpoints_dir) / LATEST).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _CKPT_RE.match(name) else None


def _point_latest(checkpoints_dir: Path, name: str) -> None:
    """Move ``LATEST`` to ``name`` atomically.

    Raises:
        StateError: it cannot be written (disk full, or ``LATEST`` replaced by a directory).
    """
    try:
        atomic_write_bytes(checkpoints_dir / LATEST, f"{name}\n".encode())
    except OSError as exc:
        raise StateError(f"cannot update {checkpoints_dir / LATEST}: {exc.strerror or type(exc).__name__}",
                         fix=f"make {LATEST} a file again (remove what is there; it is repaired from the newest complete "
                         "checkpoint) and free space on the output volume") from exc


def _seal_file(src: Path, dst: Path, key: bytes, metadata: dict[str, Any]) -> tuple[str, str, int]:
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        res = encrypt_stream(fin, fout, key, dataset_id=_BLOB_ID, dataset_version=int(metadata["step"]),
                             metadata=metadata, content_type=BLOB_CONTENT_TYPE)
    return res.plaintext_sha256, res.ciphertext_sha256, res.plaintext_size


def seal_checkpoint(src: Path, checkpoints_dir: Path, *, key: bytes, fingerprint: str, inputs: Mapping[str, str],
                    step: int, keep: int) -> str:
    """Encrypt the trainer's ``checkpoint-N`` directory onto the output volume, atomically.

    Args:
        src: The plaintext checkpoint HF just wrote (in the scratch directory).
        checkpoints_dir: ``run_dir/"checkpoints"`` on the output volume.
        key: The 32-byte checkpoint key.
        fingerprint: The run fingerprint (hash of ``inputs``).
        inputs: ``{"config"|"dataset"|"base_model": sha256}``, recorded to explain a refusal later.
        step: The optimizer step.
        keep: Sealed checkpoints to keep (older ones are deleted after ``LATEST`` moved).

    Returns:
        SHA-256 of the manifest plaintext (recorded in the audit chain).

    Raises:
        StateError: the output volume cannot be written (disk full, permissions); the previous
            checkpoints and ``LATEST`` are untouched and no partial directory is left.
    """
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"checkpoint-{step}"
    files = []
    try:
        rels = sorted(p.relative_to(src).as_posix() for p in Path(src).rglob("*") if p.is_file() and not p.is_symlink())
        stage = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=checkpoints_dir))
        try:
            for i, rel in enumerate(rels):
                blob = f"{i:04d}.enc"
                meta = {"path": rel, "step": step, "fingerprint": fingerprint}
                pt_sha, ct_sha, size = _seal_file(Path(src) / rel, stage / blob, key, meta)
                files.append({"path": rel, "blob": blob, "plaintext_sha256": pt_sha, "ciphertext_sha256": ct_sha,
                              "size": size})
            body = canonical_json({"schema": CHECKPOINT_SCHEMA, "global_step": step, "fingerprint": fingerprint,
                                   "inputs": dict(inputs), "files": files})
            with open(stage / MANIFEST, "xb") as fout:
                encrypt_stream(io.BytesIO(body), fout, key, dataset_id=_BLOB_ID, dataset_version=step,
                               metadata={"path": MANIFEST, "step": step, "fingerprint": fingerprint},
                               content_type=BLOB_CONTENT_TYPE)
            os.chmod(stage, 0o700)
            fsync_tree(stage)
            old = None
            if final.exists():  # the same step sealed again (a resumed run re-saving): swap, never mix
                old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{final.name}-", dir=checkpoints_dir))
                os.rename(final, old / final.name)
            os.rename(stage, final)
            fsync_dir(checkpoints_dir)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        _point_latest(checkpoints_dir, final.name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for _step, path in checkpoint_dirs(checkpoints_dir)[keep:]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
    except OSError as exc:
        raise StateError(f"cannot seal checkpoint-{step} onto {checkpoints_dir}: {exc.strerror or type(exc).__name__}",
                         fix="free space on the output volume; the previous checkpoint is intact and the run "
                         "resumes from it") from exc
    return sha256_hex(body)


def _open_blob(path: Path, key: bytes, *, rel: str, step: int, fingerprint: str, sink: Any) -> str:
    """Decrypt one blob into ``sink`` (``write``); returns the plaintext SHA-256."""
    with open(path, "rb") as fh:
        stream = open_encrypted(fh, key, content_type=BLOB_CONTENT_TYPE)
        meta = stream.header.metadata
        if (stream.header.dataset_id, meta.get("path"), meta.get("step")) != (_BLOB_ID, rel, step):
            raise _Unusable(f"{path.name} belongs to another file or step")
        if meta.get("fingerprint") != fingerprint:
            raise _Unusable("__fingerprint__")
        for chunk in stream:
            sink.write(chunk)
        return stream.plaintext_sha256


def _read_manifest(ckpt: Path, key: bytes, step: int, fingerprint: str, inputs: Mapping[str, str]) -> dict[str, Any]:
    if not (ckpt / MANIFEST).is_file():
        raise _Unusable("no manifest (interrupted save)")
    buf = io.BytesIO()
    try:
        _open_blob(ckpt / MANIFEST, key, rel=MANIFEST, step=step, fingerprint=fingerprint, sink=buf)
    except _Unusable as exc:
        if str(exc) != "__fingerprint__":
            raise
        buf = io.BytesIO()  # another run's inputs: read the manifest anyway to say which input differs
        _open_blob_any(ckpt / MANIFEST, key, sink=buf)
        body = json.loads(buf.getvalue())
        theirs = body.get("inputs", {})
        differ = sorted(k for k in set(inputs) | set(theirs) if inputs.get(k) != theirs.get(k))
        raise _Unusable(f"sealed for other inputs ({', '.join(differ) or 'fingerprint'} differ)") from None
    body = json.loads(buf.getvalue())
    if body.get("schema") != CHECKPOINT_SCHEMA or body.get("global_step") != step:
        raise _Unusable("manifest does not describe this checkpoint")
    return body


def _open_blob_any(path: Path, key: bytes, *, sink: Any) -> None:
    with open(path, "rb") as fh:
        for chunk in open_encrypted(fh, key, content_type=BLOB_CONTENT_TYPE):
            sink.write(chunk)


def _restore_one(ckpt: Path, step: int, key: bytes, fingerprint: str, inputs: Mapping[str, str], scratch: Path) -> Path:
    body = _read_manifest(ckpt, key, step, fingerprint, inputs)
    listed = {f["blob"] for f in body["files"]} | {MANIFEST}
    present = {p.name for p in ckpt.iterdir()}
    if present != listed:
        raise _Unusable(f"blobs {'missing' if listed - present else 'unexpected'}: "
                        f"{', '.join(sorted(listed ^ present))}")
    paths = [f["path"] for f in body["files"]]
    if any(Path(p).is_absolute() or ".." in Path(p).parts for p in paths) or not set(REQUIRED_FILES) <= set(paths):
        raise _Unusable("manifest lists unsafe or too few files")
    target = scratch / ckpt.name
    shutil.rmtree(target, ignore_errors=True)
    with staged_dir(target) as stage:
        for f in body["files"]:
            out = stage / f["path"]
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "xb") as sink:
                got = _open_blob(ckpt / f["blob"], key, rel=f["path"], step=step, fingerprint=fingerprint, sink=sink)
            if got != f["plaintext_sha256"]:
                raise _Unusable(f"hash mismatch: {f['path']}")
    return target


def restore_checkpoint(checkpoints_dir: Path, *, key: bytes, fingerprint: str, inputs: Mapping[str, str],
                       scratch: Path) -> ResumeChoice:
    """Decrypt the newest usable sealed checkpoint of this run into ``scratch``.

    Args:
        checkpoints_dir: ``run_dir/"checkpoints"`` (may be absent).
        key: The checkpoint key.
        fingerprint: This run's fingerprint; checkpoints of other inputs are refused.
        inputs: This run's input hashes (to name what differs in a refusal).
        scratch: Private directory for the plaintext copy (the trainer resumes from it).

    Returns:
        The chosen checkpoint (or none) and the reasons candidates were skipped, newest first.
        Skipped candidates and ``.tmp-*`` leftovers are deleted so HF never mixes them in.
    """
    checkpoints_dir = Path(checkpoints_dir)
    for leftover in checkpoints_dir.glob(".tmp-*") if checkpoints_dir.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)
        logger.info("removed interrupted save %s", leftover.name)
    # Newest first, not LATEST first: a kill between a checkpoint's rename and the LATEST update leaves a
    # complete newer checkpoint, and LATEST is then repaired to name what was resumed.
    candidates = checkpoint_dirs(checkpoints_dir)
    latest = latest_name(checkpoints_dir)
    rejected: list[tuple[str, str]] = []
    for step, path in candidates:
        try:
            restored = _restore_one(path, step, key, fingerprint, inputs, scratch)
        except OSError as exc:  # the volume or the scratch directory failed: keep the checkpoint, fail the run
            raise StateError(f"cannot restore {path.name}: {exc.strerror or type(exc).__name__}",
                             fix="check the output volume and the scratch directory (free memory/space)") from exc
        except (_Unusable, CvmTuneError, ValueError, KeyError, TypeError) as exc:
            reason = _reason(exc)
            logger.info("skipping %s: %s", path.name, reason)
            rejected.append((path.name, reason))
            shutil.rmtree(path, ignore_errors=True)
            continue
        logger.info("resuming from %s", path.name)
        if latest != path.name:
            _point_latest(checkpoints_dir, path.name)
        return ResumeChoice(path=restored, step=step, rejected=rejected)
    return ResumeChoice(path=None, step=None, rejected=rejected)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, _Unusable):
        return str(exc)
    if isinstance(exc, WrongKeyError):
        return "sealed with another key (other app id)"
    if isinstance(exc, DatasetIntegrityError | HeaderIntegrityError):
        return "corrupt (failed authentication)"
    if isinstance(exc, CvmTuneError):
        return "corrupt (not a sealed file)"
    return f"malformed manifest ({type(exc).__name__})"


def adapter_home(final: Path) -> Path:
    """Where the final adapter goes: ``final`` (``run_dir/"adapter"``), or, for a run whose weights are confidential
    (``app.run.confidential``), the RAM directory named by ``run_dir/ADAPTER_IN_RAM``, which the pipeline writes
    before training: the plaintext adapter never reaches the output volume (the sealed checkpoints are its durable
    copy; a resumed run exports it again from the last one).

    Raises:
        TrainingError: the marker names no existing absolute directory.
    """
    marker = final.parent / ADAPTER_IN_RAM
    if not marker.is_file():
        return final
    home = Path(marker.read_text(encoding="utf-8").strip())
    if not home.is_absolute() or not home.is_dir():
        raise TrainingError(f"{marker} names no RAM directory for the confidential adapter",
                            fix="run again: the pipeline recreates it (the sealed checkpoints are kept)")
    return home / final.name


def export_adapter(model: Any, final: Path, base_model_name: str, revision: str | None = None) -> Path:
    """Write exactly the two adapter files to ``final`` atomically (any older adapter is replaced).

    ``base_model_name_or_path`` is set to ``base_model_name`` (PEFT stores the load path, which
    would leak a local path into the export), module lists PEFT keeps as sets are sorted, so the
    file's bytes do not depend on the hash seed, and the ``auto_mapping`` Unsloth's ``get_peft_model``
    adds (``{"base_model_class": ..., "unsloth_fixed": true}``) is reset to PEFT's ``null``: the config
    is the same whichever backend trained. Formatting stays PEFT's (indent 2, sorted keys).

    Args:
        model: The trained ``PeftModel``.
        final: ``run_dir/"adapter"`` (or its RAM home: :func:`adapter_home`).
        base_model_name: The name recorded for the base model.
        revision: The base model's Hub revision, recorded as ``revision`` when given.

    Returns:
        Where the adapter was written (``final``, or its RAM home).

    Raises:
        TrainingError: PEFT did not write one of the two files.
        OSError: the run directory cannot be written.
    """
    final = adapter_home(Path(final))
    if final.exists():
        shutil.rmtree(final)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    with staged_dir(final) as stage:
        model.save_pretrained(str(stage))
        for entry in stage.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.name not in ADAPTER_FILES:
                entry.unlink()  # PEFT's README.md model card: not part of the attested adapter
        cfg_path = stage / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg["base_model_name_or_path"] = base_model_name
        if revision is not None:
            cfg["revision"] = revision
        if isinstance(cfg.get("auto_mapping"), dict) and cfg["auto_mapping"].get("unsloth_fixed"):
            cfg["auto_mapping"] = None  # Unsloth's marker (a standard class needs none): same config as the HF backend's
        for key in ("target_modules", "exclude_modules"):
            if isinstance(cfg.get(key), list):
                cfg[key] = sorted(cfg[key])
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")
        missing = [name for name in ADAPTER_FILES if not (stage / name).is_file()]
        if missing:
            raise TrainingError(f"adapter export lacks {', '.join(missing)}", fix="check the installed peft version")
    return final
