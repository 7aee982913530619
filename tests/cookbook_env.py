"""The tinker-cookbook's own virtual environment for tests/test_cookbook.py (never the server's: the cookbook pins
``transformers<=5.5.4``), made from ``requirements/cookbook.lock`` with ``pip --require-hashes`` and kept between runs.

Where: ``$CVM_TUNE_COOKBOOK_VENV`` when set, else ``<system temp dir>/cvm-tune-cookbook-<hash>``, the hash taken over
the two locks it is installed from and the Python that runs it, so a changed pin makes a new one (docs/development.md).
A venv is complete once its marker file is written (last); one left incomplete by a killed run is made anew. Making it
takes a few minutes and needs the package index; a failure fails the tests (never a skip).

    .venv/bin/python tests/cookbook_env.py          # make it now and print its path
    .venv/bin/python tests/cookbook_env.py --lock   # rewrite requirements/cookbook.lock after editing cookbook.txt
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCKS = (ROOT / "requirements" / "pip.lock", ROOT / "requirements" / "cookbook.lock")
ENV = "CVM_TUNE_COOKBOOK_VENV"
MARK = "cvm-tune-cookbook-complete"


def venv_dir() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    h = hashlib.sha256(sys.version.encode())
    for lock in LOCKS:
        h.update(lock.read_bytes())
    return Path(tempfile.gettempdir()) / f"cvm-tune-cookbook-{h.hexdigest()[:16]}"


def _run(*cmd: str) -> None:
    """Run ``cmd`` quietly (pip without its cache, which lives in $HOME); its output is the error when it fails."""
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cookbook venv: {' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-6000:]}")


def ensure() -> Path:
    """The venv's python, made first when missing (under a file lock: one maker at a time)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / MARK).is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if (venv / MARK).is_file():  # made by another run while this one waited
            return python
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        print(f"cookbook venv: creating {venv} (minutes; kept for later runs)", file=sys.stderr, flush=True)
        _run(sys.executable, "-m", "venv", str(venv))
        for lock in LOCKS:  # pip.lock first: a pip that handles the locks as install.sh does
            _run(str(python), "-m", "pip", "install", "--quiet", "--require-hashes", "-r", str(lock))
        _run(str(python), "-m", "pip", "check")
        (venv / MARK).write_text(f"{time.monotonic() - started:.0f} s\n")
        print(f"cookbook venv: created in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return python


def lock_module() -> Any:
    """``requirements/lock.py`` (its hash locks: ``write_lock``, ``is_stale``, ``parse_pins``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock", ROOT / "requirements" / "lock.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


if __name__ == "__main__":
    if sys.argv[1:] == ["--lock"]:
        lock = lock_module()
        print(lock.write_lock("cookbook", lock.target_tags(), lock.pip_sources()))
    else:
        print(ensure())
