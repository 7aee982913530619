"""What every command runs inside (:func:`session`): quiet output and nothing left behind in ``$HOME`` or ``$TMPDIR``.

Without ``--debug``, third-party warnings (Python warnings, and log records below ERROR from loggers that are not
cvm-tune's) and progress bars are off, in this process and in the processes it starts (training workers, ray's
actors); with ``--debug`` they are all shown. Whatever the flag, nothing writes ANSI colour codes to a stream that is
not a terminal.

Caches and state that libraries keep under ``$HOME`` or ``$TMPDIR`` (matplotlib's font cache, the Hugging Face cache
and hf_xet logs, torch's compile caches, Flower's home, ray's session folders) go to one private directory that is
removed when the command ends; a variable the user set is kept. Stdlib only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

OWN_LOGGERS = ("cvm-tune", "app", "attestation")
QUIET_ENV = {
    "PYTHONWARNINGS": "ignore",  # the processes this one starts
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DATASETS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}
NO_COLOR_ENV = {"NO_COLOR": "1", "RAY_COLOR_PREFIX": "0"}
# under the private directory: variable -> sub-directory
PRIVATE_ENV = {"MPLCONFIGDIR": "matplotlib", "HF_HOME": "hf", "XDG_CACHE_HOME": "cache",
               "TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton", "FLWR_HOME": "flwr"}
MAX_RAY_TMPDIR = 36  # ray's sockets live ~70 characters below it (ray/session_<date>_<pid>/sockets/plasma_store)


class _ThirdPartyErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] in OWN_LOGGERS


def colour() -> bool:
    """Whether colour codes may be written: stderr is a terminal."""
    return sys.stderr.isatty()


def cache_env(private: Path) -> tuple[dict[str, str], Path]:
    """The variables that point the libraries' caches below ``private``, and ray's temporary directory (``RAY_TMPDIR``:
    ``private/ray``, or a new directory in /tmp when that path is too long for ray's unix sockets; the caller removes
    it)."""
    env = {name: str(private / sub) for name, sub in PRIVATE_ENV.items()}
    ray = private / "ray"
    if len(str(ray)) > MAX_RAY_TMPDIR:  # a long $TMPDIR (macOS)
        ray = Path(tempfile.mkdtemp(prefix="cvm-tune-ray-", dir="/tmp"))
    env["RAY_TMPDIR"] = str(ray)
    return env, ray


@contextlib.contextmanager
def session(*, debug: bool) -> Iterator[Path]:
    """Run a command quietly (unless ``debug``) with a private cache directory; yields that directory."""
    private = Path(tempfile.mkdtemp(prefix="cvm-tune-"))
    env, ray = cache_env(private)
    if not debug:
        env.update(QUIET_ENV)
    if not colour():
        env.update(NO_COLOR_ENV)
    saved = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        os.environ.setdefault(name, value)
    drop = _ThirdPartyErrorsOnly()
    handlers = [] if debug else list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(drop)
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.simplefilter("ignore")
            yield private
    finally:
        for h in handlers:
            h.removeFilter(drop)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(ray, ignore_errors=True)
