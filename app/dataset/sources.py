"""Where tonight's encrypted dataset version comes from, without a redeploy.

* a **file**: used as is (``dataset.path``);
* a **directory** of versions (``dataset.path`` on the dataset volume): the newest version of
  ``dataset.dataset_id`` by the ``dataset_version`` of its header that is a valid dataset (owner-signed by the
  pinned key when one is pinned: trailer signature and body hash checked, which covers the header). Older
  versions are ignored; a newest version older than one already trained on is refused later, as for a file;
* a **URL** the owner controls (``dataset.source: url``): the current version is downloaded (ciphertext only, with
  timeouts, retries that resume with HTTP ``Range``, a size cap and an overall deadline; https, or http on
  loopback, for the URL and every redirect; all through the one HTTP edge, :mod:`attestation.io.http_edge`) into ``<output>/datasets/fetched/``, checked
  (owner signature, body hash, dataset id) and only then renamed into place under its version. The transport is
  untrusted: nothing from it is used before those checks, and the dataset key is not needed for them. When the URL
  cannot be reached or serves something invalid, the newest valid version fetched before is used, and the caller
  is told (alert).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attestation.bundle.dataset_sig import TrailerError, read_signed_file
from attestation.io.http_edge import Answer, DeadlineExceeded, Edge, EdgeError, GaveUp, Redirected, Transient, retry

from app.config import check_url
from app.errors import (
    ConfigError,
    DataError,
    DatasetSignatureError,
    DatasetTooLargeError,
    StateError,
    TruncatedDatasetError,
)
from app.fsutil import atomic_write_bytes, fsync_dir, open_regular

Progress = Callable[[str], None]
FETCHED = "fetched"
PART = ".download.part"
PART_META = ".download.json"
_BLOCK = 1 << 16  # a connection dropped mid-block loses at most this much progress
MAX_REDIRECTS = 5
MAX_BACKOFF_S = 600.0  # the longest wait between attempts (dataset.download.retry_backoff_s is at most this)


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
        try:
            inbox.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create {inbox}: {exc.strerror}") from None
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


def download(url: str, inbox: Path, *, dataset_id: str, owner_public_key: bytes, timeout_s: float, retries: int,
             backoff_s: float, max_bytes: int, deadline_s: float = 7200.0,
             sleep: Callable[[float], None] = time.sleep) -> Path:
    """Fetch the owner's current version into ``inbox`` (resumable) and keep it only if it checks out.

    Through the HTTP edge (:mod:`attestation.io.http_edge`): ``url`` and every redirect target must pass
    :func:`app.config.check_url` and the connection goes to exactly the host that check parsed; retries follow the
    edge's one policy (network errors, 429 and 5xx; ``Retry-After`` honoured up to ``MAX_BACKOFF_S``), each resuming
    with ``Range``. ``deadline_s`` bounds the whole download, attempts and waits included: the edge shuts the
    connection down when it passes, however slowly the server sends.

    Returns:
        The checked file, renamed to ``<dataset_id>-v<version>-<sha256[:16]>.cvmds`` (already there: kept as is).

    Raises:
        DataError: unreachable after the retries, past the deadline, an HTTP error, a truncated body (the partial
            file is kept to be resumed next time), or a file that is not a valid version (deleted).
        DatasetTooLargeError: more than ``max_bytes``.
        DatasetSignatureError: not signed by the pinned owner key, or another dataset id.
        StateError: the output volume cannot be written (the partial download is removed).
    """
    part, meta_file = inbox / PART, inbox / PART_META
    meta = _read_meta(meta_file, url)
    failures: list[str] = []
    try:
        with Edge(deadline_s=deadline_s, timeout_s=timeout_s) as edge:
            retry(lambda _n: _get_once(edge, url, part, meta, meta_file, max_bytes=max_bytes), attempts=retries + 1,
                  backoff_s=backoff_s, cap_s=MAX_BACKOFF_S, deadline=edge.deadline, sleep=sleep,
                  on_failure=lambda _n, exc: failures.append(exc.reason))
        return _accept(part, meta_file, inbox, dataset_id=dataset_id, owner_public_key=owner_public_key)
    except GaveUp as exc:
        raise DataError(f"cannot download the dataset from {url} after {exc.attempts} attempt(s): {exc.last.reason}",
                        fix="check the URL and the network; the partial download is kept and resumed next run") from None
    except DeadlineExceeded:
        last = failures[-1] if failures else "no attempt"
        raise DataError(f"the download from {url} did not finish within dataset.download.deadline_s ({deadline_s:g} s;"
                        f" last: {last})", fix="check the owner's server; the partial download is kept and resumed "
                        "next run (raise dataset.download.deadline_s for a slow link)") from None
    except Redirected as exc:
        raise DataError(f"downloading the dataset: {exc.reason}", fix="check dataset.url") from None
    except EdgeError as exc:
        raise DataError(f"downloading the dataset from {url}: {exc.reason}",
                        fix="check dataset.url (serve the .cvmds file as it is, over valid TLS)") from None
    except OSError as exc:  # local files only: the edge never raises OSError
        _discard(part, meta_file)
        raise StateError(f"cannot write the dataset download into {inbox}: {exc.strerror or type(exc).__name__}",
                         fix="free space on the output volume and check its permissions; the partial download was "
                         "removed") from None


def _read_meta(meta_file: Path, url: str) -> dict:
    try:
        meta = json.loads(meta_file.read_bytes())
    except (OSError, ValueError, RecursionError):
        meta = {}
    if not isinstance(meta, dict) or meta.get("url") != url or not isinstance(meta.get("validator", ""), str):
        meta = {"url": url}
    return meta


def _check(url: str) -> urllib.parse.SplitResult:
    try:
        return check_url(url, "the dataset URL")
    except ValueError as exc:
        raise DataError(f"downloading the dataset: {exc}", fix="check dataset.url") from None


def _get_once(edge: Edge, url: str, part: Path, meta: dict, meta_file: Path, *, max_bytes: int) -> None:
    """One attempt: GET (resuming with ``Range`` when a partial file and its validator are kept) and append."""
    have = part.stat().st_size if part.is_file() and meta.get("validator") else 0
    headers = {"Range": f"bytes={have}-", "If-Range": meta["validator"]} if have else {}
    with edge.request("GET", url, check=_check, headers=headers, redirects=MAX_REDIRECTS) as r:
        if r.status == 416:  # the partial file is not a prefix of what is there now: start over
            part.unlink(missing_ok=True)
            raise Transient("HTTP 416 (restarting the download)", status=416)
        if r.status not in (200, 206):
            raise DataError(f"downloading the dataset from {url}: HTTP {r.status}",
                            fix="check dataset.url (the owner's published version)")
        if r.status == 206 and not (r.headers.get("Content-Range") or "").startswith(f"bytes {have}-"):
            part.unlink(missing_ok=True)
            raise Transient("unexpected Content-Range (restarting the download)")
        offset = have if r.status == 206 else 0
        length = r.headers.get("Content-Length")
        expected = offset + int(length) if length and length.isascii() and length.isdigit() and len(length) < 20 \
            else None
        if expected is not None and expected > max_bytes:
            raise DatasetTooLargeError(f"the dataset at {url} is {expected} bytes, over dataset.download.max_bytes "
                                       f"({max_bytes})", fix="raise dataset.download.max_bytes if the size is expected")
        validator = r.headers.get("ETag") or r.headers.get("Last-Modified") or ""
        meta["validator"] = validator if validator.isascii() and validator.isprintable() and len(validator) < 1000 \
            else None  # sent back in If-Range: never a header a server could fold a line break into
        got = _receive(r, part, meta, meta_file, offset, max_bytes, url)
    if expected is not None and got < expected:
        raise Transient(f"connection closed after {got} of {expected} bytes")


def _receive(r: Answer, part: Path, meta: dict, meta_file: Path, offset: int, max_bytes: int, url: str) -> int:
    """Append the body to ``part``; returns the size reached. Network errors are the edge's (``Transient``,
    ``DeadlineExceeded``), with every block received before them kept; a disk error is the ``OSError`` itself."""
    atomic_write_bytes(meta_file, json.dumps(meta).encode())
    got = offset
    with open(part, "r+b" if offset else "wb") as fh:
        fh.seek(offset)
        fh.truncate()
        try:
            while block := r.read(_BLOCK):
                got += len(block)
                if got > max_bytes:
                    fh.truncate(0)
                    raise DatasetTooLargeError(f"the dataset at {url} exceeds dataset.download.max_bytes "
                                               f"({max_bytes})", fix="raise dataset.download.max_bytes if the size is "
                                               "expected")
                fh.write(block)
        finally:
            fh.flush()
            os.fsync(fh.fileno())
    return got


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
    for path in (part, meta_file):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]
