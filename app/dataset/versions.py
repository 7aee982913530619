"""Dataset rollback protection: versions only move forward on this output volume.

``<output>/state/dataset-versions.json`` remembers, per ``dataset_id``, the highest
``dataset_version`` a run has started training on and the plaintext SHA-256 of that version. A
dataset with a lower version, or with the same version but other content, is refused before
training (:class:`~app.errors.DatasetRollbackError`). The file is replaced atomically.

What this does NOT protect: the host can roll back the whole output volume (this file with it):
threats-and-faults.md §0.7. Only a counter anchored outside the CVM closes that gap. With an
owner-signed dataset the version itself is authentic (it sits in the signed header); without a
signature it is only as authentic as the dataset key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attestation.io.safe_yaml import parse_json

from app.errors import DatasetRollbackError, StateError
from app.fsutil import atomic_write_bytes

SCHEMA = "cvm-tune/dataset-versions/v1"
FILE = "dataset-versions.json"


def load_state(state_dir: Path, file: str = FILE, schema: str = SCHEMA,
               fix: str = "restore it from a backup (deleting it disables rollback protection until the next run)",
               error: type[StateError] = StateError) -> dict[str, dict]:
    """The ``datasets`` mapping of a per-dataset state file (``{}`` when absent); also the privacy budget's reader,
    which checks each entry itself. Raises ``error`` (a :class:`StateError`) when the file is unreadable, not
    bounded JSON, or not a ``schema`` file."""
    path = Path(state_dir) / file
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise error(f"{path} is unreadable ({exc.strerror})", fix=fix) from exc
    obj = parse_json(raw, str(path), lambda message: error(message, fix=fix))
    if not isinstance(obj, dict) or obj.get("schema") != schema or not isinstance(obj.get("datasets"), dict):
        raise error(f"{path} is not a {schema} file", fix=fix)
    return obj["datasets"]


def rebuild_if_missing(state_dir: Path, audit_entries: list) -> int:
    """Recreate the version record from the audit chain when the file is gone but runs were recorded.

    ``run.start``/``run.resume`` entries commit to ``dataset_id``, ``dataset_version`` and the plaintext hash, so
    deleting this file does not reopen rollbacks. Returns how many dataset ids were restored (0: nothing to do).

    Raises:
        StateError: the file is missing, the chain records runs, and none of them names its dataset version
            (a chain written before versions were recorded): refuse rather than train unprotected.
    """
    path = Path(state_dir) / FILE
    if path.exists():
        return 0
    opens = [e for e in audit_entries if e.type in ("run.start", "run.resume")]
    if not opens:
        return 0
    best: dict[str, dict] = {}
    for e in opens:
        ds_id, version, digest = e.data.get("dataset_id"), e.data.get("dataset_version"), e.data.get("dataset_plaintext_sha256")
        if isinstance(ds_id, str) and isinstance(version, int) and isinstance(digest, str):
            if ds_id not in best or version >= best[ds_id]["version"]:
                best[ds_id] = {"version": version, "plaintext_sha256": digest}
    if not best:
        raise StateError(f"{path} is missing, but the audit log records {len(opens)} runs: the rollback record was removed",
                         fix="restore state/dataset-versions.json from a backup of the output volume")
    save_state(state_dir, best, what="the rebuilt dataset versions")
    return len(best)


def check_version(state_dir: Path, dataset_id: str, version: int, plaintext_sha256: str) -> int | None:
    """Refuse a rollback; returns the last version trained on (``None`` for a new dataset id).

    Raises:
        DatasetRollbackError: ``version`` is lower than the last one, or equal with other content.
        StateError: the state file is unreadable.
    """
    last = load_state(state_dir).get(dataset_id)
    if last is None:
        return None
    if version < last["version"]:
        raise DatasetRollbackError(f"dataset {dataset_id!r} v{version} is older than v{last['version']}, "
                                   "which this output volume already trained on (rollback refused)")
    if version == last["version"] and plaintext_sha256 != last["plaintext_sha256"]:
        raise DatasetRollbackError(f"dataset {dataset_id!r} v{version} differs from the v{version} already trained on: "
                                   "a version number must name one content",
                                   fix="ask the data owner to publish the changed data under a higher dataset_version")
    return int(last["version"])


def record_version(state_dir: Path, dataset_id: str, version: int, plaintext_sha256: str) -> None:
    """Remember that training started on this version (never lowers a recorded version).

    Raises:
        DatasetRollbackError: a concurrent record made this version stale.
        StateError: the state file cannot be written.
    """
    check_version(state_dir, dataset_id, version, plaintext_sha256)
    datasets = load_state(state_dir)
    datasets[dataset_id] = {"version": version, "plaintext_sha256": plaintext_sha256}
    save_state(state_dir, datasets, what="the dataset version")


def save_state(state_dir: Path, datasets: dict[str, Any], *, what: str, file: str = FILE, schema: str = SCHEMA) -> None:
    """Replace a per-dataset state file atomically (also the privacy budget's writer)."""
    data = json.dumps({"schema": schema, "datasets": dict(sorted(datasets.items()))}, indent=2, sort_keys=True).encode()
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(state_dir) / file, data + b"\n")
    except OSError as exc:
        raise StateError(f"cannot record {what} in {state_dir}: {exc.strerror}") from exc
