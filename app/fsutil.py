"""Crash-safe file operations: temp + fsync + rename, then fsync the directory.

A reader never sees a half-written file or directory under its final name: either the old state
or the complete new one. Temp names start with ``.tmp-`` in the same directory (``os.rename``
across filesystems would fail with EXDEV and would not be atomic).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory below ``root`` (before renaming it into place)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Build a directory under a temp name; on success fsync it and rename it to ``final``.

    On any exception the temp directory is removed and ``final`` is untouched. ``final`` must not
    exist (a complete directory is never overwritten).

    Raises:
        FileExistsError: ``final`` already exists.
    """
    final = Path(final)
    if final.exists():
        raise FileExistsError(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the published directory is meant to be read
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temps(parent: Path) -> list[str]:
    """Delete ``.tmp-*`` leftovers of interrupted writes in ``parent``; returns their names."""
    removed = []
    if parent.is_dir():
        for entry in parent.iterdir():
            if entry.name.startswith(".tmp-"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
    return removed
