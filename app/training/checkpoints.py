"""On-disk state of a training run: sealed checkpoints, resume selection, the exported adapter.

HF Trainer checkpoints are not atomic: a crash mid-save leaves a ``checkpoint-N`` directory
that ``resume_from_checkpoint=True`` would happily pick. So after HF has written
``checkpoint-N`` (``TrainerCallback.on_save`` runs after the save), the trainer's files are
fsynced and ``checkpoint-N/cvm-tune-checkpoint.json`` is written atomically::

    {"fingerprint": <run fingerprint>, "global_step": N, "files": {<relative path>: <sha256>}}

covering every other file in the directory. A checkpoint is resumed only if its marker exists,
names this run's fingerprint and step, and every file hash matches with no file missing or
extra. Candidates are tried newest first; the rest are reported with a reason.

The final adapter (:func:`export_adapter`) is staged next to ``run_dir/"adapter"`` and renamed
into place. Stdlib only: the model object is passed in.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import TrainingError
from app.fsutil import atomic_write_bytes, fsync_tree, staged_dir
from attestation.hashing import canonical_json, tree_files

logger = logging.getLogger(__name__)

MARKER = "cvm-tune-checkpoint.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class ResumeChoice:
    """Outcome of :func:`select_checkpoint`.

    Attributes:
        path: The checkpoint to resume from, or ``None`` to train from scratch.
        step: Its global step (``None`` with ``path``).
        rejected: ``(directory name, reason)`` for every newer candidate that was skipped.
    """

    path: Path | None
    step: int | None
    rejected: list[tuple[str, str]] = field(default_factory=list)


def checkpoint_dirs(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory, newest (highest step) first."""
    found: list[tuple[int, Path]] = []
    if Path(checkpoints_dir).is_dir():
        for entry in Path(checkpoints_dir).iterdir():
            match = _CKPT_RE.match(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


def write_marker(ckpt_dir: Path, *, fingerprint: str, global_step: int) -> dict[str, str]:
    """Seal a finished HF checkpoint: fsync its files, then write the marker atomically.

    Args:
        ckpt_dir: The ``checkpoint-N`` directory HF just wrote.
        fingerprint: The run fingerprint the checkpoint belongs to.
        global_step: The optimizer step it was saved at.

    Returns:
        The ``{relative path: sha256}`` map recorded in the marker.

    Raises:
        OSError: the directory cannot be read or the marker cannot be written.
        ValueError: the directory contains a symlink or special file.
    """
    ckpt_dir = Path(ckpt_dir)
    # Data before marker: without this a power cut could persist the marker but not the files.
    fsync_tree(ckpt_dir)
    files = {rel: digest for rel, digest in tree_files(ckpt_dir).items() if rel != MARKER}
    body = {"fingerprint": fingerprint, "global_step": int(global_step), "files": files}
    atomic_write_bytes(ckpt_dir / MARKER, canonical_json(body) + b"\n")
    return files


def check_checkpoint(ckpt_dir: Path, *, fingerprint: str, step: int) -> str | None:
    """Why ``ckpt_dir`` cannot be resumed, or ``None`` when it is complete and ours.

    Args:
        ckpt_dir: A ``checkpoint-N`` directory.
        fingerprint: The fingerprint the checkpoint must carry.
        step: ``N`` from the directory name.

    Returns:
        A short reason (no data, no file contents) or ``None``.
    """
    marker = Path(ckpt_dir) / MARKER
    if not marker.is_file():
        return "no completeness marker (interrupted save)"
    try:
        body = json.loads(marker.read_bytes())
        recorded = body["files"]
        marker_fp, marker_step = body["fingerprint"], body["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable completeness marker"
    if marker_fp != fingerprint:
        return "fingerprint differs (other config, dataset or base model)"
    if marker_step != step:
        return f"marker names step {marker_step}"
    if not isinstance(recorded, dict) or not recorded:
        return "marker lists no files"
    try:
        actual = {rel: digest for rel, digest in tree_files(Path(ckpt_dir)).items() if rel != MARKER}
    except (OSError, ValueError) as exc:
        return f"cannot hash files ({type(exc).__name__})"
    missing = sorted(set(recorded) - set(actual))
    extra = sorted(set(actual) - set(recorded))
    changed = sorted(rel for rel in set(recorded) & set(actual) if recorded[rel] != actual[rel])
    if missing:
        return f"missing files: {', '.join(missing)}"
    if extra:
        return f"unexpected files: {', '.join(extra)}"
    if changed:
        return f"hash mismatch: {', '.join(changed)}"
    if not (Path(ckpt_dir) / "trainer_state.json").is_file():
        return "no trainer_state.json"
    return None


def select_checkpoint(checkpoints_dir: Path, fingerprint: str) -> ResumeChoice:
    """Pick the newest complete checkpoint of this run.

    Args:
        checkpoints_dir: ``run_dir/"checkpoints"`` (may be absent).
        fingerprint: The run fingerprint; checkpoints with another one are never resumed.

    Returns:
        The chosen checkpoint (or none) and the reasons newer candidates were skipped; each
        skip is also logged at INFO (directory name and reason only).
    """
    rejected: list[tuple[str, str]] = []
    for step, path in checkpoint_dirs(checkpoints_dir):
        reason = check_checkpoint(path, fingerprint=fingerprint, step=step)
        if reason is None:
            logger.info("resuming from %s", path.name)
            return ResumeChoice(path=path, step=step, rejected=rejected)
        logger.info("skipping %s: %s", path.name, reason)
        rejected.append((path.name, reason))
    return ResumeChoice(path=None, step=None, rejected=rejected)


def discard_rejected(checkpoints_dir: Path, choice: ResumeChoice) -> None:
    """Delete the skipped checkpoints so HF neither overwrites them in place nor counts them.

    HF saves ``checkpoint-N`` into an existing directory without clearing it and rotates by
    count, so a stale or corrupt directory would mix files with the new save or evict a good one.
    """
    for name, _reason in choice.rejected:
        target = Path(checkpoints_dir) / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
            logger.info("removed unusable %s", name)


def export_adapter(model: Any, final: Path, base_model_name: str) -> Path:
    """Write exactly the two adapter files to ``final`` atomically (any older adapter is replaced).

    ``base_model_name_or_path`` is set to ``base_model_name`` (PEFT stores the load path, which
    would leak a local path into the export) and module lists PEFT keeps as sets are sorted, so the
    file's bytes do not depend on the hash seed. Formatting stays PEFT's (indent 2, sorted keys).

    Args:
        model: The trained ``PeftModel``.
        final: ``run_dir/"adapter"``.
        base_model_name: The name recorded for the base model.

    Returns:
        ``final``.

    Raises:
        TrainingError: PEFT did not write one of the two files.
        OSError: the run directory cannot be written.
    """
    final = Path(final)
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
        for key in ("target_modules", "exclude_modules"):
            if isinstance(cfg.get(key), list):
                cfg[key] = sorted(cfg[key])
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")
        missing = [name for name in ADAPTER_FILES if not (stage / name).is_file()]
        if missing:
            raise TrainingError(f"adapter export lacks {', '.join(missing)}", fix="check the installed peft version")
    return final
