"""Where a run's inputs come from: the dataset key source, the encrypted dataset file, the base model
directory and the private RAM scratch for plaintext checkpoints. Small functions the pipeline calls in order."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from attestation.io.hashing import sha256_file, sha256_hex

from app.config import Config
from app.dataset import DerivedKeySource, KeyFileSource, KeySource, encrypt_file
from app.dataset.key_request import CvmIdentity, ReleasedKeySource
from app.dataset.release import key_opens
from app.dataset.keys import EnvKeySource
from app.errors import BaseModelError, ConfigError, DataError
from app.fsutil import RAM_FILESYSTEMS, filesystem_type, open_regular
from app.tee import GuestAgent, Identity

Progress = Callable[[str], None]
SAMPLE_DATASET_ID = "cvm-tune-sample"


def key_source(cfg: Config, agent: GuestAgent, ident: Identity, out: Path, dataset: Path | None) -> KeySource:
    """The configured dataset key source; ``dataset``: the located encrypted file (``None``: the bundled sample)."""
    k = cfg.dataset.key
    if k.source == "file":
        return KeyFileSource(k.file)  # type: ignore[arg-type]  # validated: file is set
    if k.source == "env":
        return EnvKeySource(k.env_var)
    if k.source == "release":  # validated: encrypted-file with a pinned owner key
        return ReleasedKeySource(agent=agent, identity=CvmIdentity(ident.app_id, ident.compose_hash, ident.instance_id),
                                 out_dir=out, dataset=dataset,  # type: ignore[arg-type]  # validated: encrypted
                                 grant_file=k.grant_file or out / "key-release" / "grant.json",
                                 owner_public_key=bytes.fromhex(cfg.dataset.owner_public_key),  # type: ignore[arg-type]
                                 pccs_url=cfg.tee.pccs_url, timeout_s=cfg.tee.timeout_s)
    # after a KMS key rotation the key of the epochs the dataset was encrypted under (app.keys_epoch)
    probe = dataset if dataset is not None else (_sample_dst(out) if cfg.dataset.source == "bundled-sample" else None)
    opens = (lambda key: key_opens(probe, key)) if probe is not None and probe.is_file() else None
    return DerivedKeySource(agent.get_key, k.getkey_path, agent=agent if isinstance(agent, GuestAgent) else None,
                            opens=opens)


def _sample_dst(out: Path) -> Path:
    with resources.as_file(resources.files("app") / "data" / "sample.jsonl") as sample_path:
        return out / "datasets" / f"sample-{sha256_file(sample_path)[:12]}.cvmds"


def dataset_file(cfg: Config, out: Path, key: bytes, progress: Progress) -> Path:
    """The encrypted dataset; the bundled demo sample is encrypted once into the output volume."""
    if cfg.dataset.source == "encrypted-file":
        return Path(cfg.dataset.path)  # type: ignore[arg-type]  # validated: path is set
    sample = resources.files("app") / "data" / "sample.jsonl"
    with resources.as_file(sample) as sample_path:
        dst = _sample_dst(out)
        if not dst.exists():
            encrypt_file(sample_path, dst, key, dataset_id=SAMPLE_DATASET_ID, dataset_version=1)
            progress(f"dataset: bundled sample encrypted on the fly to {dst} (demo; real data arrives encrypted)")
    return dst


def open_dataset(path: Path) -> BinaryIO:
    """The encrypted dataset, opened without blocking on a FIFO and refused unless it is a regular file."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise DataError(f"dataset {path} does not exist", fix="set dataset.path to the encrypted dataset file (.cvmds)") from None
    except IsADirectoryError as exc:
        raise DataError(f"dataset {exc.strerror}, not an encrypted dataset file",
                        fix="set dataset.path to the encrypted dataset file (.cvmds)") from None
    except OSError as exc:
        raise DataError(f"cannot read dataset {path}: {exc.strerror}") from exc


def base_model(cfg: Config, out: Path, build_tiny_model: Callable[[Path], None]) -> tuple[Path, str]:
    if cfg.base_model.source == "tiny-llama":
        path = out / "models" / "tiny-llama"
        build_tiny_model(path)
        return path, "cvm-tune/tiny-llama"
    path = Path(cfg.base_model.path)  # type: ignore[arg-type]  # validated: path is set
    if not (path / "config.json").is_file():
        raise BaseModelError(f"base model directory {path} has no config.json", fix="point base_model.path at a local HF model directory")
    return path, path.name


def scratch_dir(cfg: Config, out: Path) -> Path:
    """Private directory for the trainer's plaintext checkpoints: RAM, never the output volume.

    Raises:
        ConfigError: the directory is missing, on the output volume, or not a RAM file system (unless
            ``output.scratch_unsafe_ok``).
    """
    base = cfg.output.scratch_dir
    if base is None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    if not Path(base).is_dir():
        raise ConfigError(f"output.scratch_dir {base} does not exist (cvm-tune never creates it)",
                          fix="point output.scratch_dir at an existing tmpfs such as /dev/shm")
    path = Path(base).resolve() / f"cvm-tune-{sha256_hex(str(out).encode())[:12]}"
    if path == out or out in path.parents:
        raise ConfigError(f"output.scratch_dir {base} is on the output volume", fix="point it at /dev/shm or a tmpfs")
    fs = filesystem_type(path.parent)
    if fs not in RAM_FILESYSTEMS and not cfg.output.scratch_unsafe_ok:
        raise ConfigError(f"output.scratch_dir {base} is on a {fs or 'unknown'} file system, not in RAM: plaintext "
                          "checkpoints would be written to disk",
                          fix="point output.scratch_dir at a tmpfs (/dev/shm; in Docker: shm_size), or set "
                          "output.scratch_unsafe_ok: true if that disk never leaves the TEE")
    return path
