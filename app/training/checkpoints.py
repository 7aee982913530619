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

The blobs and the manifest are a sealed directory (:mod:`app.training.sealed`: AES-256-GCM STREAM files, each
blob's authenticated metadata naming its ``path``, ``step`` and the run ``fingerprint``, the manifest listing every
blob's hashes and the run's ``inputs``) under the **checkpoint key** (HKDF of dstack
``GetKey("cvm-tune/checkpoints/v1")``: bound to the app id, never on disk; used for nothing else). Order: blobs,
fsync, manifest, fsync, rename ``.tmp-…`` → ``checkpoint-N``, fsync the parent, then ``LATEST``. A kill at any point
leaves either the previous state or the complete new checkpoint.

**Key epochs** (``app.keys_epoch``): ``checkpoints/key-epochs.json`` records the dstack KMS key epochs the run's
checkpoint key was derived under (one key per run); a ``checkpoint-N/key-epochs.json`` (written by a re-seal)
overrides it. After a KMS key rotation :func:`rekey_checkpoints` (before training) opens every sealed checkpoint
on the volume with its old epoch's key and re-seals it under the current one, atomically; an agent that cannot give
the old key stops the run with nothing changed.

:func:`restore_checkpoint` tries every ``checkpoint-N`` newest first (``LATEST`` is repaired to
name the one resumed), decrypts into the scratch directory and checks everything; a candidate that fails (no manifest =
interrupted save, wrong key, a changed byte, other inputs) is skipped with a reason naming no data; one sealed with
another key is kept aside as ``checkpoint-N.other-key`` (a rotation the agent could not report must not lose it).

The final adapter (:func:`export_adapter`) is staged next to ``run_dir/"adapter"`` and renamed
into place. No torch here: the model object is passed in.
"""

from __future__ import annotations

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

from app.errors import StateError, TrainingError
from app.fsutil import atomic_write_bytes, fsync_dir, fsync_tree, staged_dir
from app.keys_epoch import EPOCHS_FILE, KeyEpochs, epochs_bytes, read_epochs
from attestation.io.hashing import sha256_hex

from .sealed import WRONG_KEY, Unusable, open_sealed, recover_swaps, reseal, seal_files

logger = logging.getLogger(__name__)

LATEST = "LATEST"
OTHER_KEY = ".other-key"
CHECKPOINT_GETKEY_PATH = "cvm-tune/checkpoints/v1"
ADAPTER_IN_RAM = "adapter.in-ram"  # run_dir marker: the confidential adapter's RAM directory (adapter_home)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
REQUIRED_FILES = ("trainer_state.json", "adapter_model.safetensors")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


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
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=checkpoints_dir))
        try:
            body = seal_files(Path(src), stage, key=key, step=step, fingerprint=fingerprint, inputs=inputs)
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


def _set_aside(path: Path) -> None:
    """Move a checkpoint sealed under a key this agent does not give to ``checkpoint-N.other-key[.i]``: out of the
    resume candidates, and kept (rename it back once the guest can give its key epoch's key)."""
    aside, i = path.with_name(f"{path.name}{OTHER_KEY}"), 0
    while aside.exists():
        i += 1
        aside = path.with_name(f"{path.name}{OTHER_KEY}.{i}")
    os.rename(path, aside)


def record_epochs(checkpoints_dir: Path, epochs: KeyEpochs | None) -> None:
    """Record (once, before training) the key epochs of the run's checkpoint key in ``checkpoints_dir``."""
    checkpoints_dir = Path(checkpoints_dir)
    if epochs is None or (checkpoints_dir / EPOCHS_FILE).exists():
        return
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(checkpoints_dir / EPOCHS_FILE, epochs_bytes(epochs), mode=0o600)


def rekey_checkpoints(runs_dir: Path, keys: Any, ram: Path) -> list[str]:
    """Re-seal every sealed checkpoint under ``runs_dir/*/checkpoints`` that was sealed under other key epochs than
    ``keys.current_epochs`` (``app.keys_epoch.EpochKeys``), through ``ram`` (a RAM directory). Returns
    ``run/checkpoint-N`` of each one re-sealed.

    Raises:
        KeyEpochError: an old epoch's key cannot be had (the agent ignores the selectors): nothing was changed.
        StateError: the volume cannot be written (each checkpoint is either the old or the re-sealed one).
    """
    done: list[str] = []
    for ckpts in sorted(Path(runs_dir).glob("*/checkpoints")) if Path(runs_dir).is_dir() else []:
        recover_swaps(ckpts)
        shared = read_epochs(ckpts / EPOCHS_FILE)
        for _step, path in checkpoint_dirs(ckpts):
            recorded = read_epochs(path / EPOCHS_FILE) if (path / EPOCHS_FILE).exists() else shared
            try:
                if reseal(path, ram, keys, recorded=recorded, required=REQUIRED_FILES):
                    done.append(f"{ckpts.parent.name}/{path.name}")
            except Unusable as exc:  # damaged or interrupted: restore_checkpoint skips it as before
                logger.info("not re-sealing %s: %s", path.name, exc)
            except OSError as exc:
                raise StateError(f"cannot re-seal {path}: {exc.strerror or type(exc).__name__}",
                                 fix="free space on the output volume; every checkpoint is intact") from exc
        if keys.current_epochs is not None and shared != keys.current_epochs:
            atomic_write_bytes(ckpts / EPOCHS_FILE, epochs_bytes(keys.current_epochs), mode=0o600)
    return done


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
            restored = open_sealed(path, scratch / path.name, key=key, step=step, fingerprint=fingerprint,
                                   inputs=inputs, required=REQUIRED_FILES)
        except OSError as exc:  # the volume or the scratch directory failed: keep the checkpoint, fail the run
            raise StateError(f"cannot restore {path.name}: {exc.strerror or type(exc).__name__}",
                             fix="check the output volume and the scratch directory (free memory/space)") from exc
        except Unusable as exc:
            reason = str(exc)
            logger.info("skipping %s: %s", path.name, reason)
            rejected.append((path.name, reason))
            if reason == WRONG_KEY:  # perhaps a KMS key rotation the agent cannot report: kept aside, never deleted
                _set_aside(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            continue
        logger.info("resuming from %s", path.name)
        if latest != path.name:
            _point_latest(checkpoints_dir, path.name)
        return ResumeChoice(path=restored, step=step, rejected=rejected)
    return ResumeChoice(path=None, step=None, rejected=rejected)


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
