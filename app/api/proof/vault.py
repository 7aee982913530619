"""The training API's saved states, sealed to the app: never plaintext on the output volume.

A save writes the engine's plaintext directory (adapter, optimizer state, progress, DP spend) into a private RAM
directory, seals it (:mod:`app.training.sealed`: AES-256-GCM, every byte authenticated) into
``<output>/api/checkpoints/<id>`` under a temp name, renames it into place and removes the RAM copy. A load or a
sample decrypts it into RAM, hands it to the engine and removes it again.

- **Key**: HKDF of dstack ``GetKey("cvm-tune/api-checkpoints/v1")``: derived in the CVM, bound to the app id, never
  on disk, and not the nightly checkpoints' key (``cvm-tune/checkpoints/v1``). A restarted server of the same app
  derives it again and opens its states; another app, or anyone holding the volume alone, cannot.
- **Key epochs**: each state records the dstack KMS key epochs its key was derived under (``key-epochs.json``,
  ``app.keys_epoch``); after a KMS key rotation a load opens it with the old epoch's key and re-seals it under the
  current one (atomically); an agent that ignores GetKey's epoch selectors is refused with nothing changed.
- **Binding**: each state's fingerprint is the hash of its record in ``state/runs.sqlite`` (``tinker://`` path,
  owner, kind, directory, op-chain head and count, LoRA): a state copied under another record, or a record edited
  to hand a state to another key or another chain head, does not open.
- **RAM**: ``<scratch>-api``, next to the nightly run's scratch directory (:func:`app.run.inputs.scratch_dir`: the
  configured ``output.scratch_dir``, else ``/dev/shm``; refused unless a RAM file system, as for a nightly run).
  It exists only while one operation runs (the engine runs one at a time), with the one copy that operation needs,
  and is removed when it ends (and at start, after a kill). A sampler checkpoint is decrypted to a path stable per
  checkpoint, so the engine's cache of sampler adapters (keyed by that path, at most ``app.api.engine.sample_batch.MAX_SAMPLERS``) loads it once;
  it is decrypted again only after the engine evicted it.
- **Storage** (:class:`Storage`): a training save, and a sampler save that asks for it, is also an export bundle; a
  sampler save's bundle can be made later, from the progress sealed with it (``export.json``), as its save would
  have made it. A state past its ``ttl_seconds`` is refused (:class:`Expired`, 410) and its sealed directory
  removed (its record and bundle stay); ``api.max_saved_bytes`` refuses a save before anything is written.
- **Refusals** (the operation's future fails, category ``user``; nothing changes): a state that does not open (a
  changed, cut or added byte, another key) and a plaintext directory (a state saved by a version before sealing, or
  one planted by whoever can write the volume: plaintext cannot be authenticated, so it is never loaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from attestation.io.hashing import canonical_json, sha256_hex

from app.api.errors import ApiError, BadRequest
from app.api.proof.store import Checkpoint
from app.config import Config
from app.config.api import ApiSettings
from app.dataset import DerivedKeySource
from app.dataset.keys import derive_key
from app.errors import ConfigError
from app.keys_epoch import EpochKeys, FixedKey, KeyEpochError, read_epochs
from app.tee import GuestAgent
from app.fsutil import remove_stale_temps, staged_dir, withdraw_dir
from app.run.inputs import scratch_dir
from app.training.sealed import MANIFEST, Unusable, open_sealed, recover_swaps, reseal, seal_files

GETKEY_PATH = "cvm-tune/api-checkpoints/v1"
KEY_PURPOSE = "cvm-tune-api-checkpoint-key"
RAM_SUFFIX = "-api"
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
PLAINTEXT = (*ADAPTER, "optimizer.pt", "progress.json")  # what an unsealed state (of an older version) holds
LEGACY = ("it is a plaintext directory (saved by a version before saved states were sealed, or planted on the "
          "output volume): plaintext states are refused because anyone who can write the volume could plant one; "
          "load a state saved since, or train again and save")
TTL_S = (3600, 315_360_000)  # ttl_seconds as Tinker accepts it: 1 hour to 10 years
PROGRESS = "export.json"  # in a sealed state: the model's progress at the save, what a later export of it needs
RUNTIME = {"id", "adapter", "optimizer", "lora", "op_head", "ops", "pending", "pending_loss", "dp_sums"}  # not in it
SEALED = ("saved states are sealed to this app: this one was changed, cut short or sealed elsewhere, so it is "
          "refused; other saved states are unaffected")


class Expired(ApiError):
    """A saved state past its expiry: its sealed state was removed (its record and export bundle stay)."""

    status = 410


class Full(ApiError):
    """A save that would take the API's storage past ``api.max_saved_bytes``: refused before anything is written."""

    status = 507


def size_of(path: Path) -> int:
    """Bytes of the regular file ``path``, or of those under the directory ``path`` (0 when it is absent)."""
    if Path(path).is_file():
        return Path(path).stat().st_size
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


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
    if isinstance(agent.agent, GuestAgent):
        keys: EpochKeys | FixedKey = EpochKeys(agent.agent, GETKEY_PATH, KEY_PURPOSE, derive_key)
    else:  # a stand-in agent (tests): one key, no epochs
        keys = FixedKey(DerivedKeySource(agent.agent.get_key, GETKEY_PATH, KEY_PURPOSE).dataset_key())
    return Vault(Path(out) / "api" / "checkpoints", ram.with_name(ram.name + RAM_SUFFIX), keys)


class Vault:
    def __init__(self, root: Path, ram: Path, keys: EpochKeys | FixedKey | bytes) -> None:
        self.root, self.ram = Path(root), Path(ram)
        self._keys = FixedKey(keys) if isinstance(keys, bytes) else keys
        self._key = self._keys.current
        self.expired: dict[str, str] = {}  # sealed directory -> why it was removed, for operations queued before
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.root)  # a save killed mid-seal
        recover_swaps(self.root)  # a re-seal after a key rotation killed mid-swap
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
            seal_files(src, stage, key=self._key, step=c.ops, fingerprint=_fingerprint(c), inputs=_inputs(c),
                       epochs=self._keys.current_epochs)

    @staticmethod
    def remove(c: Checkpoint) -> None:
        shutil.rmtree(c.dir, ignore_errors=True)

    def expire(self, c: Checkpoint, why: str) -> None:
        """Remove ``c``'s sealed directory because it expired (``why``: what a load or sample of it answers)."""
        self.expired[c.dir] = why
        self.remove(c)

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
        if c.dir in self.expired:
            raise Expired(self.expired[c.dir])
        if not sealed.is_dir():
            raise BadRequest(f"saved state {c.path} cannot be opened: its directory is missing from the output volume")
        if not (sealed / MANIFEST).exists() and any((sealed / n).exists() for n in PLAINTEXT):
            raise BadRequest(f"saved state {c.path} is refused: {LEGACY}")
        required = (*ADAPTER, "optimizer.pt") if c.kind == "training" else ADAPTER
        try:
            reseal(sealed, self.ram, self._keys, recorded=read_epochs(sealed), required=required)  # after a rotation
            open_sealed(sealed, target, key=self._key, step=c.ops, fingerprint=_fingerprint(c), inputs=_inputs(c),
                        required=required)
        except Unusable as exc:
            raise BadRequest(f"saved state {c.path} cannot be opened: {exc}; {SEALED}") from None
        except KeyEpochError as exc:
            raise BadRequest(f"saved state {c.path} cannot be opened after a KMS key rotation: {exc.message}; "
                             f"fix: {exc.fix}") from None


def _inputs(c: Checkpoint) -> dict[str, str]:
    """What a state is sealed to: its record (the manifest keeps it, to name what differs in a refusal)."""
    return {"path": c.path, "owner": c.owner, "kind": c.kind, "dir": Path(c.dir).name, "op_head": c.op_head,
            "ops": str(c.ops), "lora": canonical_json(c.lora).decode()}


def _fingerprint(c: Checkpoint) -> str:
    return sha256_hex(canonical_json(_inputs(c)))


class Storage:
    """What the API's saved states take on the volume: which saves are exported, their expiry, the quota.
    ``limits`` and ``clock`` (seconds) are read at each use."""

    def __init__(self, store: Any, vault: Vault, exporter: Any, limits: ApiSettings) -> None:
        self.store, self.vault, self.exporter, self.limits = store, vault, exporter, limits
        self.clock = time.time

    def options(self, req: Any, kind: str) -> tuple[bool, int | None]:
        """(whether it is exported, its ttl_seconds) of a save request.

        Raises:
            BadRequest: ``user_metadata`` export not "true"/"false" ("false" on a training save), a ttl out of range.
        """
        asked = (req.user_metadata or {}).get("export")
        if asked not in (None, "true", "false"):
            raise BadRequest(f'user_metadata export must be "true" or "false" (got {asked!r})')
        if kind == "training" and asked == "false":
            raise BadRequest('user_metadata export "false": a training save is always exported')
        ttl = req.ttl_seconds
        if ttl is None and kind == "sampler":
            ttl = self.limits.sampler_ttl_s
        if ttl is not None and not TTL_S[0] <= ttl <= TTL_S[1]:
            raise BadRequest(f"ttl_seconds {ttl} is outside {TTL_S[0]}..{TTL_S[1]} (1 hour to 10 years)")
        return kind == "training" or asked == "true", ttl

    def now(self, after_s: float = 0) -> str:
        return datetime.fromtimestamp(self.clock() + after_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def live(self, c: Checkpoint) -> Checkpoint:
        """``c``, unless it expired (:class:`Expired`, with when)."""
        if c.removed_at is not None or (c.expires_at is not None and c.expires_at <= self.now()):
            raise Expired(_expired(c))
        return c

    def sweep(self) -> list[str]:
        """Remove the sealed state of every saved state past its expiry (the server runs it at start and before each
        save, holding the volume's lock); their records and export bundles stay. Returns their paths."""
        now = self.now()
        gone = self.store.expired(now)
        for c in gone:
            self.vault.expire(c, _expired(c))  # removed first: a kill before the record is swept again
            self.store.mark_removed(c.path, now)
        return [c.path for c in gone]

    def prepare(self, m: Any, ram: Path, export: bool, path: str) -> None:
        """Before ``ram`` (the engine's save of ``m``) is sealed: the progress a later export needs, and the quota."""
        (ram / PROGRESS).write_text(json.dumps({f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                                                if f.name not in RUNTIME}))
        self._room(size_of(ram) + (size_of(ram / ADAPTER[1]) if export else 0), f"{path} is not saved")

    def export(self, c: Checkpoint, src: Path) -> Path | None:
        """Publish the bundle of ``c`` from its plaintext ``src``: the model as it was at the save (its record and
        the progress sealed with it), whether the save exports it at once or :meth:`export_saved` does later."""
        if self.exporter is None:
            return None
        p = json.loads((src / PROGRESS).read_text())
        p["losses"] = [tuple(x) for x in p["losses"]]
        return self.exporter.export(SimpleNamespace(**p, lora=c.lora, op_head=c.op_head, ops=c.ops), src, c.path)

    def export_saved(self, c: Checkpoint) -> dict[str, str]:
        """``{"path", "bundle"}`` of the saved state ``c``: its bundle, made now (with a fresh quote) if it has none."""
        if c.bundle is None:
            with self.vault.opened(c) as src:
                if not (src / PROGRESS).is_file():
                    raise BadRequest(f"{c.path} was saved by a version that cannot export it later")
                self._room(size_of(src / ADAPTER[1]), f"{c.path} is not exported")
                bundle = self.export(c, src)
            try:
                self.store.set_bundle(c.path, str(bundle), size_of(bundle))
            except BaseException:
                withdraw_dir(bundle)
                raise
            c = dataclasses.replace(c, bundle=str(bundle))
        return {"path": c.path, "bundle": str(c.bundle)}

    def _room(self, need: int, refused: str) -> None:
        limit = self.limits.max_saved_bytes
        used = self.store.saved_bytes() if limit is not None else 0
        if limit is not None and used + need > limit:
            raise Full(f"{refused}: the saved states and export bundles hold {used} bytes and this needs "
                       f"about {need} more, past api.max_saved_bytes ({limit}); nothing was written. Let sampler "
                       "states expire (ttl_seconds, api.sampler_ttl_s) or raise the limit")


def _expired(c: Checkpoint) -> str:
    kept = f"; its export bundle {c.bundle} stays" if c.bundle else ""
    return f"checkpoint {c.path} expired at {c.expires_at} (its ttl_seconds): its saved state was removed{kept}"
