"""Crash-safe file operations: temp + fsync + rename, then fsync the directory.

A reader never sees a half-written file or directory under its final name: either the old state
or the complete new one. Temp names start with ``.tmp-`` in the same directory (``os.rename``
across filesystems would fail with EXDEV and would not be atomic).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import shutil
import tempfile
from collections.abc import Iterator
from typing import BinaryIO
from pathlib import Path


RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (``tmpfs``, ``ext4``, …) from /proc/self/mountinfo;
    None where that cannot be read (not Linux)."""
    target = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                sep = fields.index("-")
                mount = fields[4].replace("\\040", " ")
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, fields[sep + 1]
    except (OSError, ValueError, IndexError):
        return None
    return fstype


def open_regular(path: Path) -> BinaryIO:
    """Open an input file for reading only if it is a regular file: a FIFO, device or directory is refused
    without blocking (``O_NONBLOCK`` on the open, ``fstat`` on the descriptor actually opened).

    Raises:
        FileNotFoundError: it does not exist.
        IsADirectoryError: it is a directory, a FIFO, a socket or a device (``errno.EISDIR``, its text says which).
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise IsADirectoryError(errno.EISDIR, f"{path} is {kind}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


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


def withdraw_dir(path: Path) -> None:
    """Unpublish a directory :func:`staged_dir` published: one rename to a ``.tmp-`` name (so no half-removed
    directory is ever visible under its own name), then removal; a leftover is what :func:`remove_stale_temps`
    clears. A missing ``path`` is not an error."""
    path = Path(path)
    tmp = path.parent / f".tmp-{path.name}-withdrawn-{os.urandom(4).hex()}"
    try:
        os.rename(path, tmp)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
    shutil.rmtree(tmp, ignore_errors=True)


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
