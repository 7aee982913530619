"""Where tonight's encrypted dataset version comes from, without a redeploy.

* a **file**: used as is (``dataset.path``);
* a **directory** of versions (``dataset.path`` on the dataset volume): the newest version of
  ``dataset.dataset_id`` by the ``dataset_version`` of its header that is a valid dataset (owner-signed by the
  pinned key when one is pinned: trailer signature and body hash checked, which covers the header). Older
  versions are ignored; a newest version older than one already trained on is refused later, as for a file;
* a **URL** the owner controls (``dataset.source: url``): the current version is downloaded (ciphertext only, with
  timeouts, retries that resume with HTTP ``Range``, a size cap) into ``<output>/datasets/fetched/``, checked
  (owner signature, body hash, dataset id) and only then renamed into place under its version. The transport is
  untrusted: nothing from it is used before those checks, and the dataset key is not needed for them. When the URL
  cannot be reached or serves something invalid, the newest valid version fetched before is used, and the caller
  is told (alert).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attestation.dataset_sig import TrailerError, read_signed_file

from app.errors import ConfigError, DataError, DatasetSignatureError, DatasetTooLargeError, TruncatedDatasetError
from app.fsutil import atomic_write_bytes, fsync_dir, open_regular

Progress = Callable[[str], None]
FETCHED = "fetched"
PART = ".download.part"
PART_META = ".download.json"
_BLOCK = 1 << 16  # a connection dropped mid-block loses at most this much progress


@dataclass
class Located:
    """The version a run will use, and what was passed over (reasons, never content)."""

    path: Path
    version: int
    skipped: list[str] = field(default_factory=list)  # "name: reason" for invalid or foreign files
    fetch_error: str | None = None  # source url: why tonight's download was not used
    older: list[tuple[int, Path]] = field(default_factory=list)  # other versions, newest first (key-release fallback)


def newest_version(directory: Path, dataset_id: str, owner_public_key: bytes | None) -> Located:
    """The newest valid version of ``dataset_id`` in ``directory``.

    Raises:
        DataError: no file in the directory is a valid version of that dataset.
    """
    from app.dataset.format import read_header

    found: list[tuple[int, str, Path]] = []
    skipped: list[str] = []
    try:
        names = sorted(p for p in Path(directory).iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError as exc:
        raise DataError(f"cannot list the dataset directory {directory}: {exc.strerror}") from exc
    for p in names:
        try:
            with open_regular(p) as fh:
                header = read_header(fh)
        except (DataError, OSError):
            continue  # not a cvm-tune dataset (a README, a checksum file): not a candidate
        if header.dataset_id == dataset_id:
            found.append((header.dataset_version, p.name, p))
    for version, name, p in sorted(found, reverse=True):
        if owner_public_key is not None:
            try:
                signed = read_signed_file(p)
            except (TrailerError, OSError) as exc:
                skipped.append(f"{name}: {exc}")
                continue
            if signed.signature.owner_public_key != owner_public_key:
                skipped.append(f"{name}: signed by another owner key ({signed.signature.owner_key_id[:16]}…)")
                continue
        older = [(v, q) for v, _n, q in sorted(found, reverse=True) if v < version]
        return Located(p, version, skipped, older=older)
    why = f" ({'; '.join(skipped)})" if skipped else ""
    raise DataError(f"no valid version of dataset {dataset_id!r} in {directory}{why}",
                    fix="publish an owner-signed version there (cvm-tune dataset encrypt --dataset-id "
                    f"{dataset_id} --dataset-version N --owner-key KEY)")


def locate(source: str, path: Path | None, dataset_id: str | None, owner_public_key: bytes | None,
           out: Path, *, fetch: Callable[[Path], None] | None = None) -> Located | None:
    """Resolve the configured source to one file (``None``: the bundled sample, encrypted later with the key).

    Raises:
        ConfigError: a directory without ``dataset.dataset_id``.
        DataError: no valid version (and, for a URL, none fetched before either).
    """
    if source == "bundled-sample":
        return None
    if source == "url":
        inbox = out / "datasets" / FETCHED
        inbox.mkdir(parents=True, exist_ok=True)
        error = None
        try:
            fetch(inbox)  # type: ignore[misc]  # set by the caller for source url
        except DataError as exc:
            error = exc.message
        try:
            located = newest_version(inbox, dataset_id, owner_public_key)  # type: ignore[arg-type]
        except DataError as exc:
            raise DataError(f"dataset download failed ({error}) and no earlier version was fetched" if error
                            else exc.message, fix="check dataset.url and that the owner published a signed version") from None
        located.fetch_error = error
        return located
    p = Path(path)  # type: ignore[arg-type]  # validated: set for encrypted-file
    if p.is_dir():
        if not dataset_id:
            raise ConfigError(f"dataset.path {p} is a directory: set dataset.dataset_id to pick the versions to use")
        return newest_version(p, dataset_id, owner_public_key)
    return Located(p, -1)


# --- download -------------------------------------------------------------------------------------------------


class _Retry(Exception):
    pass


def download(url: str, inbox: Path, *, dataset_id: str, owner_public_key: bytes, timeout_s: float, retries: int,
             backoff_s: float, max_bytes: int, sleep: Callable[[float], None] = time.sleep) -> Path:
    """Fetch the owner's current version into ``inbox`` (resumable) and keep it only if it checks out.

    Returns:
        The checked file, renamed to ``<dataset_id>-v<version>-<sha256[:16]>.cvmds`` (already there: kept as is).

    Raises:
        DataError: unreachable after the retries, an HTTP error, a truncated body (the partial file is kept to be
            resumed next time), or a file that is not a valid version (deleted).
        DatasetTooLargeError: more than ``max_bytes``.
        DatasetSignatureError: not signed by the pinned owner key, or another dataset id.
    """
    import requests

    part, meta_file = inbox / PART, inbox / PART_META
    meta = _read_meta(meta_file, url)
    last = "no attempt"
    for attempt in range(retries + 1):
        if attempt:
            sleep(backoff_s * 2 ** (attempt - 1))
        try:
            _get_once(requests, url, part, meta, meta_file, timeout_s=timeout_s, max_bytes=max_bytes)
            break
        except _Retry as exc:
            last = str(exc)
        except requests.RequestException as exc:  # refused, reset, timed out, closed mid-body
            last = f"{type(exc).__name__}"
    else:
        raise DataError(f"cannot download the dataset from {url} after {retries + 1} attempt(s): {last}",
                        fix="check the URL and the network; the partial download is kept and resumed next run")
    return _accept(part, meta_file, inbox, dataset_id=dataset_id, owner_public_key=owner_public_key)


def _read_meta(meta_file: Path, url: str) -> dict:
    try:
        meta = json.loads(meta_file.read_bytes())
    except (OSError, ValueError):
        meta = {}
    if not isinstance(meta, dict) or meta.get("url") != url:
        meta = {"url": url}
    return meta


def _get_once(requests, url: str, part: Path, meta: dict, meta_file: Path, *, timeout_s: float, max_bytes: int) -> None:  # noqa: ANN001
    have = part.stat().st_size if part.is_file() and meta.get("validator") else 0
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers.update({"Range": f"bytes={have}-", "If-Range": meta["validator"]})
    with requests.get(url, stream=True, timeout=(timeout_s, timeout_s), headers=headers, allow_redirects=True) as r:
        if r.status_code == 429 or r.status_code >= 500:
            raise _Retry(f"HTTP {r.status_code}")
        if r.status_code == 416:  # the partial file is not a prefix of what is there now: start over
            part.unlink(missing_ok=True)
            raise _Retry("HTTP 416 (restarting the download)")
        if r.status_code not in (200, 206):
            raise DataError(f"downloading the dataset from {url}: HTTP {r.status_code}",
                            fix="check dataset.url (the owner's published version)")
        if r.status_code == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            part.unlink(missing_ok=True)
            raise _Retry("unexpected Content-Range (restarting the download)")
        offset = have if r.status_code == 206 else 0
        length = r.headers.get("Content-Length")
        expected = offset + int(length) if length and length.isdigit() else None
        if expected is not None and expected > max_bytes:
            raise DatasetTooLargeError(f"the dataset at {url} is {expected} bytes, over dataset.download.max_bytes "
                                       f"({max_bytes})", fix="raise dataset.download.max_bytes if the size is expected")
        meta["validator"] = r.headers.get("ETag") or r.headers.get("Last-Modified")
        atomic_write_bytes(meta_file, json.dumps(meta).encode())
        got = offset
        with open(part, "r+b" if offset else "wb") as fh:
            fh.seek(offset)
            fh.truncate()
            for block in r.iter_content(_BLOCK):
                got += len(block)
                if got > max_bytes:
                    fh.truncate(0)
                    raise DatasetTooLargeError(f"the dataset at {url} exceeds dataset.download.max_bytes ({max_bytes})",
                                               fix="raise dataset.download.max_bytes if the size is expected")
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        if expected is not None and got < expected:
            raise _Retry(f"connection closed after {got} of {expected} bytes")


def _accept(part: Path, meta_file: Path, inbox: Path, *, dataset_id: str, owner_public_key: bytes) -> Path:
    from app.dataset.format import read_header

    try:
        signed = read_signed_file(part)
    except TrailerError as exc:
        _discard(part, meta_file)
        raise TruncatedDatasetError(f"the downloaded dataset is not a complete owner-signed version: {exc}",
                                    fix="ask the owner to republish it; the earlier version stays in use") from None
    if signed.signature.owner_public_key != owner_public_key:
        _discard(part, meta_file)
        raise DatasetSignatureError("the downloaded dataset is signed by another owner key "
                                    f"({signed.signature.owner_key_id[:16]}…), not dataset.owner_public_key",
                                    fix="publish versions signed with the pinned owner key")
    with open_regular(part) as fh:
        header = read_header(fh)
    if header.dataset_id != dataset_id:
        _discard(part, meta_file)
        raise DatasetSignatureError(f"the downloaded dataset is {header.dataset_id!r}, not dataset.dataset_id "
                                    f"{dataset_id!r}")
    final = inbox / f"{_safe(dataset_id)}-v{header.dataset_version}-{signed.file_sha256[:16]}.cvmds"
    if final.exists():
        _discard(part, meta_file)
    else:
        os.replace(part, final)
        meta_file.unlink(missing_ok=True)
        fsync_dir(inbox)
    return final


def _discard(part: Path, meta_file: Path) -> None:
    part.unlink(missing_ok=True)
    meta_file.unlink(missing_ok=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]
