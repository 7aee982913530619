"""The training API's saved states, sealed to the app: never plaintext on the output volume.

A save writes the engine's plaintext directory (adapter, optimizer state, progress, DP spend) into a private RAM
directory, seals it (:mod:`app.training.sealed`: AES-256-GCM, every byte authenticated) into
``<output>/api/checkpoints/<id>`` under a temp name, renames it into place and removes the RAM copy. A load or a
sample decrypts it into RAM, hands it to the engine and removes it again.

- **Key**: HKDF of dstack ``GetKey("cvm-tune/api-checkpoints/v1")``: derived in the CVM, bound to the app id, never
  on disk, and not the nightly checkpoints' key (``cvm-tune/checkpoints/v1``). A restarted server of the same app
  derives it again and opens its states; another app, or anyone holding the volume alone, cannot.
- **Binding**: each state's fingerprint is the hash of its record in ``state/runs.sqlite`` (``tinker://`` path,
  owner, kind, directory, op-chain head and count, LoRA): a state copied under another record, or a record edited
  to hand a state to another key or another chain head, does not open.
- **RAM**: ``<scratch>-api``, next to the nightly run's scratch directory (:func:`app.run.inputs.scratch_dir`: the
  configured ``output.scratch_dir``, else ``/dev/shm``; refused unless a RAM file system, as for a nightly run).
  It exists only while one operation runs (the engine runs one at a time), with the one copy that operation needs,
  and is removed when it ends (and at start, after a kill). A sampler checkpoint is decrypted to a path stable per
  checkpoint, so the engine's cache of sampler adapters (keyed by that path, at most ``MAX_SAMPLERS``) loads it once;
  it is decrypted again only after the engine evicted it.
- **Refusals** (the operation's future fails, category ``user``; nothing changes): a state that does not open (a
  changed, cut or added byte, another key) and a plaintext directory (a state saved by a version before sealing, or
  one planted by whoever can write the volume: plaintext cannot be authenticated, so it is never loaded).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from attestation.io.hashing import canonical_json, sha256_hex

from app.api.errors import BadRequest
from app.api.store import Checkpoint
from app.config import Config
from app.dataset import DerivedKeySource
from app.errors import ConfigError
from app.fsutil import remove_stale_temps, staged_dir
from app.run.inputs import scratch_dir
from app.training.sealed import MANIFEST, Unusable, open_sealed, seal_files

GETKEY_PATH = "cvm-tune/api-checkpoints/v1"
KEY_PURPOSE = "cvm-tune-api-checkpoint-key"
RAM_SUFFIX = "-api"
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
PLAINTEXT = (*ADAPTER, "optimizer.pt", "progress.json")  # what an unsealed state (of an older version) holds
LEGACY = ("it is a plaintext directory (saved by a version before saved states were sealed, or planted on the "
          "output volume): plaintext states are refused because anyone who can write the volume could plant one; "
          "load a state saved since, or train again and save")
SEALED = ("saved states are sealed to this app: this one was changed, cut short or sealed elsewhere, so it is "
          "refused; other saved states are unaffected")


def open_vault(cfg: Config, out: Path, agent: Any) -> Vault:
    """The vault of the output volume ``out``: its RAM directory (``cfg.output``) and its key (``agent``:
    ``app.run.stages.Agent``).

    Raises:
        ConfigError: no RAM directory (as a nightly run refuses it), or no guest agent to derive the key with.
        TeeError, KeySourceError: GetKey failed.
    """
    ram = scratch_dir(cfg, Path(out))
    if agent is None:
        raise ConfigError("the training API has no guest agent to derive the key of its saved states with",
                          fix="run it in a CVM, or with tee.mode: embedded-simulator")
    key = DerivedKeySource(agent.agent.get_key, GETKEY_PATH, KEY_PURPOSE).dataset_key()
    return Vault(Path(out) / "api" / "checkpoints", ram.with_name(ram.name + RAM_SUFFIX), key)


class Vault:
    def __init__(self, root: Path, ram: Path, key: bytes) -> None:
        self.root, self.ram, self._key = Path(root), Path(ram), key
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.root)  # a save killed mid-seal
        shutil.rmtree(self.ram, ignore_errors=True)  # plaintext a server killed mid-operation left

    @contextlib.contextmanager
    def _in_ram(self, name: str) -> Iterator[Path]:
        """``ram/name`` (not created) for one operation: the RAM directory exists, private, only while it runs."""
        shutil.rmtree(self.ram, ignore_errors=True)
        self.ram.mkdir(mode=0o700)
        try:
            yield self.ram / name
        finally:
            shutil.rmtree(self.ram, ignore_errors=True)

    def plain(self) -> contextlib.AbstractContextManager[Path]:
        """A path in RAM (not created) for the engine to save into; removed after."""
        return self._in_ram("state")

    def seal(self, src: Path, c: Checkpoint) -> None:
        """Seal the plaintext directory ``src`` as ``c.dir`` (atomically: complete or absent)."""
        with staged_dir(Path(c.dir)) as stage:
            seal_files(src, stage, key=self._key, step=c.ops, fingerprint=_fingerprint(c), inputs=_inputs(c))

    @staticmethod
    def remove(c: Checkpoint) -> None:
        shutil.rmtree(c.dir, ignore_errors=True)

    @contextlib.contextmanager
    def opened(self, c: Checkpoint, *, name: str = "state") -> Iterator[Path]:
        """``c`` decrypted and checked in RAM (as ``ram/name``), removed after.

        Raises:
            BadRequest: it does not open, or is plaintext (the reason; nothing was changed).
        """
        with self._in_ram(name) as target:
            self._open(c, target)
            yield target

    @contextlib.contextmanager
    def sampler(self, c: Checkpoint, loaded: Callable[[str], bool]) -> Iterator[Path]:
        """``c`` for the engine's sampler cache: a path stable per checkpoint, decrypted there unless ``loaded``
        says the engine holds it already (then nothing is read); removed after either way."""
        name = f"sampler-{Path(c.dir).name}"
        if loaded(str(self.ram / name)):
            yield self.ram / name
            return
        with self.opened(c, name=name) as src:
            yield src

    def _open(self, c: Checkpoint, target: Path) -> None:
        sealed = Path(c.dir)
        if not sealed.is_dir():
            raise BadRequest(f"saved state {c.path} cannot be opened: its directory is missing from the output volume")
        if not (sealed / MANIFEST).exists() and any((sealed / n).exists() for n in PLAINTEXT):
            raise BadRequest(f"saved state {c.path} is refused: {LEGACY}")
        required = (*ADAPTER, "optimizer.pt") if c.kind == "training" else ADAPTER
        try:
            open_sealed(sealed, target, key=self._key, step=c.ops, fingerprint=_fingerprint(c), inputs=_inputs(c),
                        required=required)
        except Unusable as exc:
            raise BadRequest(f"saved state {c.path} cannot be opened: {exc}; {SEALED}") from None


def _inputs(c: Checkpoint) -> dict[str, str]:
    """What a state is sealed to: its record (the manifest keeps it, to name what differs in a refusal)."""
    return {"path": c.path, "owner": c.owner, "kind": c.kind, "dir": Path(c.dir).name, "op_head": c.op_head,
            "ops": str(c.ops), "lora": canonical_json(c.lora).decode()}


def _fingerprint(c: Checkpoint) -> str:
    return sha256_hex(canonical_json(_inputs(c)))
