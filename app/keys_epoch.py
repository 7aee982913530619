"""Key continuity across KMS key rotations (dstack 0.6.4+ key epochs, ``shared/reference/dstack-0.6.md`` §1).

Every dstack ``GetKey`` output is derived from the app root key of a ``(root_epoch, app_epoch)`` pair; a KMS root
activation or an app-epoch advance changes every key. So every object cvm-tune seals under a GetKey-derived key
records the epochs it was sealed under (:data:`EPOCHS_FILE`, next to or inside it), and opening one goes through
:class:`EpochKeys`:

* recorded epochs == the agent's current ones: the current key;
* older recorded epochs: v0 ``GetKey`` with ``root_epoch``/``app_epoch`` selectors (guest 0.6.6 / 0.5.16+), the
  answer's epochs checked; the caller opens the object with that key and re-seals it under the current one
  (atomically: nothing is lost if it is killed half-way);
* nothing recorded (sealed by an older cvm-tune): the current key, then epoch (0, 0)'s;
* an agent that ignores the selectors (guest <= 0.5.15 answers the current key and reports no epochs, or reports
  others than asked) is :class:`KeyEpochError`, with nothing opened with a wrong key and nothing overwritten.

The epochs file is plaintext (the epochs are not secret); a changed one only makes the object fail to open.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.errors import TeeError

EPOCHS_FILE = "key-epochs.json"
SCHEMA = "cvm-tune/key-epochs/v1"
UPGRADE_FIX = ("run this CVM on a dstack guest that honours GetKey's root_epoch/app_epoch selectors (0.6.6+ or "
               "0.5.16+), with a KMS whose auth policy still allows the old epoch; nothing was changed, so the "
               "sealed data opens once it does")


class KeyEpochError(TeeError):
    """A sealed object's key epoch cannot be reached through this guest agent (nothing was overwritten)."""

    default_fix = UPGRADE_FIX


@dataclass(frozen=True, order=True)
class KeyEpochs:
    """A KMS ``(root_epoch, app_epoch)`` pair."""

    root_epoch: int
    app_epoch: int

    def __str__(self) -> str:
        return f"root epoch {self.root_epoch}, app epoch {self.app_epoch}"

    def as_dict(self) -> dict[str, int]:
        return {"root_epoch": self.root_epoch, "app_epoch": self.app_epoch}

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> KeyEpochs | None:
        """The epochs a GetKey answer reports (``None``: it reports none, as every guest before 0.6.6/0.5.16)."""
        root, app = answer.get("root_epoch"), answer.get("app_epoch")
        if _is_epoch(root) and _is_epoch(app):
            return cls(root, app)
        return None


ZERO = KeyEpochs(0, 0)


def _is_epoch(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def read_epochs(path: Path) -> KeyEpochs | None:
    """The epochs recorded at ``path`` (an epochs file, or a directory holding :data:`EPOCHS_FILE`).

    Returns:
        ``None`` when nothing is recorded (sealed before epochs were recorded).

    Raises:
        KeyEpochError: the record exists but is not one (changed on the volume).
    """
    path = Path(path)
    path = path / EPOCHS_FILE if path.is_dir() else path
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyEpochError(f"cannot read {path}: {exc.strerror or type(exc).__name__}",
                            fix="check the output volume") from exc
    try:
        doc = json.loads(raw)
        epochs = KeyEpochs.from_answer(doc) if doc.get("schema") == SCHEMA else None
    except (ValueError, AttributeError):
        epochs = None
    if epochs is None:
        raise KeyEpochError(f"{path} is not a key-epochs record", fix=f"restore {path} from a backup, or remove it "
                            "if the object was sealed before key epochs were recorded")
    return epochs


def epochs_bytes(epochs: KeyEpochs) -> bytes:
    """The record :func:`read_epochs` reads (canonical JSON)."""
    return json.dumps({"schema": SCHEMA, **epochs.as_dict()}, sort_keys=True, separators=(",", ":")).encode()


def write_epochs(directory: Path, epochs: KeyEpochs | None) -> None:
    """Write ``directory/EPOCHS_FILE`` (fsync'd; the caller renames ``directory`` into place). ``None``: nothing
    to record (the agent reports no epochs)."""
    if epochs is None:
        return
    fd = os.open(Path(directory) / EPOCHS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(epochs_bytes(epochs))
        fh.flush()
        os.fsync(fh.fileno())


def older_epochs(current: KeyEpochs, limit: int = 16) -> list[KeyEpochs]:
    """Epoch pairs before ``current`` (each epoch at most the current one), newest first, at most ``limit``: where
    a key derived before one or more rotations may be (for keys that are derived, not sealed, e.g. the CVM's age
    identity, whose public half names it)."""
    pairs = [KeyEpochs(r, a) for r in range(current.root_epoch, -1, -1) for a in range(current.app_epoch, -1, -1)]
    return [p for p in pairs if p != current][:limit]


class KeyAgent(Protocol):
    """What :class:`EpochKeys` needs of ``app.tee.GuestAgent``."""

    def get_key_at(self, path: str, purpose: str, epochs: KeyEpochs | None = None) -> tuple[bytes, KeyEpochs | None]:
        ...


class EpochKeys:
    """One GetKey-derived key (``derive(GetKey(path, purpose))``) across KMS key epochs.

    Args:
        agent: the guest agent (``app.tee.GuestAgent``).
        path, purpose: the GetKey arguments.
        derive: turns the 32 GetKey bytes into the key used (an HKDF); identity by default.
    """

    def __init__(self, agent: KeyAgent, path: str, purpose: str, derive: Callable[[bytes], bytes] = bytes) -> None:
        self._agent, self.path, self.purpose, self._derive = agent, path, purpose, derive
        raw, self.current_epochs = agent.get_key_at(path, purpose)
        self.current = derive(raw)
        self._cache: dict[KeyEpochs, bytes] = {}

    def at(self, epochs: KeyEpochs) -> bytes:
        """The key of ``epochs`` (GetKey with selectors; the answer's epochs must be those asked for).

        Raises:
            KeyEpochError: the agent reports other epochs or none (it ignores the selectors), or refuses the epoch.
        """
        if epochs == self.current_epochs:
            return self.current
        if epochs not in self._cache:
            if self.current_epochs is None:
                raise KeyEpochError(f"GetKey({self.path}) is needed under {epochs}, but this guest agent reports no "
                                    "key epochs: it ignores GetKey's epoch selectors and would answer the current key")
            if epochs.root_epoch > self.current_epochs.root_epoch or epochs.app_epoch > self.current_epochs.app_epoch:
                raise KeyEpochError(f"sealed under {epochs}, newer than this CVM's ({self.current_epochs})",
                                    fix="open it on the CVM that sealed it, or after this CVM's KMS epochs caught up")
            try:
                raw, got = self._agent.get_key_at(self.path, self.purpose, epochs)
            except KeyEpochError:
                raise
            except TeeError as exc:
                raise KeyEpochError(f"GetKey({self.path}) under {epochs} was refused: {exc.message}",
                                    fix="the KMS auth policy must still allow this instance for that epoch "
                                    "(un-upgraded DstackApp contracts allow app epoch 0 only)") from exc
            if got != epochs:
                raise KeyEpochError(f"asked GetKey({self.path}) for {epochs}; the guest agent answered "
                                    f"{got or 'no epochs'}: it ignores the epoch selectors")
            self._cache[epochs] = self._derive(raw)
        return self._cache[epochs]

    def candidates(self, recorded: KeyEpochs | None) -> list[tuple[bytes, KeyEpochs | None]]:
        """Keys to try, in order, for an object sealed under ``recorded`` (``None``: not recorded), each with the
        epochs it belongs to.

        Raises:
            KeyEpochError: ``recorded`` is not reachable through this agent (see :meth:`at`).
        """
        if recorded == self.current_epochs:
            return [(self.current, recorded)]
        if recorded is None:  # sealed before epochs were recorded: the current key, else epoch (0, 0)'s
            first = [(self.current, self.current_epochs)]
            return first if self.current_epochs in (None, ZERO) else [*first, (self.at(ZERO), ZERO)]
        return [(self.at(recorded), recorded)]

    def stale(self, recorded: KeyEpochs | None) -> bool:
        """Whether an object sealed under ``recorded`` should be re-sealed under the current epochs."""
        return self.current_epochs is not None and recorded != self.current_epochs


class FixedKey:
    """A key outside dstack (a test, a key file): one epoch-less key, nothing to re-seal."""

    def __init__(self, key: bytes) -> None:
        self.current, self.current_epochs = key, None

    def candidates(self, recorded: KeyEpochs | None) -> list[tuple[bytes, KeyEpochs | None]]:
        return [(self.current, None)]

    def stale(self, recorded: KeyEpochs | None) -> bool:
        return False
