"""Crash-safe file operations: temp + fsync + rename, then fsync the directory.

A reader never sees a half-written file or directory under its final name: either the old state
or the complete new one. Temp names start with ``.tmp-`` in the same directory (``os.rename``
across filesystems would fail with EXDEV and would not be atomic).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def open_regular(path: Path, error: Callable[..., Exception], what: str, fix: str) -> BinaryIO:
    """Open a regular file for reading without ever blocking on a FIFO (``O_NONBLOCK``, then ``S_ISREG``).

    Raises:
        error: missing, unreadable, a directory, a FIFO, a device or a socket.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}", fix=fix) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {path} is not a regular file", fix=fix)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


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


def remove_dead_pid_dirs(parent: Path, prefix: str) -> list[str]:
    """Best effort: delete ``<prefix><pid>-*`` directories of this user whose process is gone (kill -9 leftovers)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in Path(parent).glob(f"{prefix}*"):
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
            except OSError:  # alive, owned by someone else
                continue
    return removed


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: Path) -> str | None:
    """The type of the mount holding ``path`` (Linux ``/proc/self/mounts``); ``None`` when unknown."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(Path(path).resolve())
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].encode().decode("unicode_escape")  # \040 = space
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def scratch_dir(requested: Path | None, out: Path, *, unsafe_ok: bool = False) -> Path:
    """Private directory for the trainer's plaintext checkpoints: a RAM filesystem, never the volume.

    ``requested`` (``output.scratch_dir``) must already exist: it is never created. Unset: /dev/shm.

    Raises:
        ConfigError: the directory is missing, on the output volume, or not tmpfs/ramfs (unless ``unsafe_ok``).
    """
    from attestation.hashing import sha256_hex

    from app.errors import ConfigError

    fix = "point output.scratch_dir at an existing tmpfs (e.g. /dev/shm), or set output.scratch_unsafe_ok: true"
    base = Path(requested) if requested is not None else Path("/dev/shm")
    if not base.is_dir():
        raise ConfigError(f"scratch directory {base} does not exist (it is never created)", fix=fix)
    path = base.resolve() / f"cvm-tune-{sha256_hex(str(out).encode())[:12]}"
    if path == out or out in path.parents:
        raise ConfigError(f"output.scratch_dir {base} is on the output volume", fix="point it at /dev/shm or a tmpfs")
    kind = filesystem_type(base)
    if kind not in RAM_FILESYSTEMS and not unsafe_ok:
        raise ConfigError(f"scratch directory {base} is on {kind or 'an unknown filesystem'}, not tmpfs: plaintext "
                          "checkpoints would be written to disk", fix=fix)
    return path
