"""Hashing helpers shared by the exporter and the verifier (stdlib only).

``canonical_json`` is the one serialisation that gets hashed anywhere in cvm-tune: sorted keys,
no whitespace, UTF-8, no NaN. ``tree_digest`` hashes a directory as a sorted list of
``(relative posix path, sha256)`` pairs; symlinks and special files are refused so a tree hash
always describes regular bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

_READ = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def canonical_json(obj: Any) -> bytes:
    """Sorted-key, compact, UTF-8 JSON (raises ValueError on NaN/Infinity)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def hash_stream(fh: BinaryIO, h: Any, limit: int | None = None) -> int:
    """Feed ``fh`` (up to ``limit`` bytes, else to EOF) into hash object ``h``; return the bytes read.

    The one stream-hash loop: 1 MiB ``readinto`` a reused buffer (no allocation per block; hashlib
    releases the GIL on it), so a large file hashes near raw SHA-256 speed.
    """
    buf = bytearray(_READ)
    view = memoryview(buf)
    total = 0
    left = -1 if limit is None else limit
    while left:
        n = fh.readinto(view if left < 0 or left >= _READ else view[:left])
        if not n:
            break
        h.update(view[:n])
        total += n
        if left > 0:
            left -= n
    return total


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of a regular file (symlinks and special files are refused, never opened).

    A small file is read with one call; a large one goes through :func:`hash_stream`.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink after the lstat
            raise ValueError(f"{path} is not a regular file") from None
        raise
    with open(fd, "rb", buffering=0) as fh:
        h = hashlib.sha256()
        if st.st_size < _READ:  # one read, and one more that sees EOF
            while data := fh.read(_READ):
                h.update(data)
        else:
            hash_stream(fh, h)
    return h.hexdigest()


def tree_files(root: Path) -> dict[str, str]:
    """``{relative posix path: sha256}`` for every regular file under ``root``.

    Raises:
        ValueError: a symlink or special file is present (never followed, never hashed).
    """
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise ValueError(f"symlink {os.path.join(dirpath, name)} is not allowed in {root}")
        for name in sorted(filenames):
            full = Path(dirpath) / name
            out[full.relative_to(root).as_posix()] = sha256_file(full)
    return dict(sorted(out.items()))


def files_digest(files: dict[str, str]) -> str:
    """One hex SHA-256 over a ``{path: sha256}`` map (order-independent, canonical JSON)."""
    return sha256_hex(canonical_json(dict(sorted(files.items()))))


def tree_digest(root: Path) -> tuple[str, dict[str, str]]:
    """``(digest, files)`` of a directory: the digest is ``files_digest(tree_files(root))``."""
    files = tree_files(root)
    return files_digest(files), files
