"""The embedded simulator's socket directories: where they go (a socket path must fit in ``sun_path``), who owns
one (an ``flock`` held for the owner process's life), and removing the ones killed processes left behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from app.simulator.server import MAX_SOCKET_PATH

SIM_DIR_PREFIX = "cvm-tune-sim-"
SIM_OWNER_LOCK = "owner.lock"  # flock'd by the process serving the simulator, for as long as it lives


@contextlib.contextmanager
def hold_owner_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory/owner.lock`` for the block: the simulator's directory is live
    for exactly as long as its owner process is (the kernel drops the lock when the process dies, even on kill -9).

    The file is locked under a private name and then renamed to ``owner.lock``: another process's
    :func:`remove_stale_simulator_dirs` never finds it unlocked (between a create and a flock it would have judged
    the new directory stale and removed it under its owner).
    """
    import fcntl

    private = directory / f".{SIM_OWNER_LOCK}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(private, directory / SIM_OWNER_LOCK)
        yield
    finally:
        os.close(fd)


def _owner_alive(directory: Path) -> bool | None:
    """True while another process holds the directory's owner lock, False once nobody does, None without a lock."""
    import fcntl

    try:
        fd = os.open(directory / SIM_OWNER_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _answers(sock: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(sock))
            return True
        except OSError:
            return False


def remove_stale_simulator_dirs(parent: Path) -> list[str]:
    """Delete embedded-simulator socket directories left by killed processes (kill -9 skips the cleanup).

    A directory is stale when it is ours (same uid) and no process holds its owner lock (``owner.lock``): liveness
    is what the kernel says, not whether the socket answers in time, so a simulator slowed by load is never removed.
    A directory without a lock (being set up, or left by an older release) is kept while its socket answers or it is
    less than a minute old. Returns the names removed.
    """
    import shutil

    removed = []
    for d in parent.glob(f"{SIM_DIR_PREFIX}*"):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            alive = _owner_alive(d)
            if alive is None:
                sock = d / "dstack.sock"
                alive = _answers(sock) if sock.exists() else time.time() - d.stat().st_mtime < 60
            if alive:
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        except OSError:
            continue
    return removed


def socket_parent() -> Path:
    """Where the embedded simulator's socket directory goes: the temp directory, or /tmp when a socket path there
    would not fit in ``sun_path`` (a long ``$TMPDIR``)."""
    temp = Path(tempfile.gettempdir())
    fits = len(os.fsencode(str(temp / f"{SIM_DIR_PREFIX}01234567" / "dstack.sock"))) <= MAX_SOCKET_PATH
    return temp if fits else Path("/tmp")
