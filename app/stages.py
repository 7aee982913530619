"""What each stage of ``app.pipeline.run_once`` hands to the next (typed, frozen)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.dataset import KeySource
from app.tee import GuestAgent, Identity


@dataclass(frozen=True)
class AgentStage:
    """The guest agent and what it says about this CVM."""

    agent: GuestAgent
    ident: Identity
    simulated: bool
    compose_bytes: bytes
    build: dict[str, Any]


@dataclass(frozen=True)
class Keys:
    """The dataset key (and where it came from) and the checkpoint sealing key."""

    source: KeySource
    dataset_key: bytes
    checkpoint_key: bytes


@dataclass(frozen=True)
class DatasetStage:
    """The authenticated, validated rows and what the manifest records about the dataset."""

    rows: list[Any]
    report: Any  # RowReport
    chunks: int
    meta: dict[str, Any]  # the manifest's "dataset" section


@dataclass(frozen=True)
class BaseModel:
    """The local base model and its tree hash."""

    dir: Path
    name: str
    tree: str
    files: dict[str, str]


@dataclass(frozen=True)
class RunIdentity:
    """Which run this is (new or resumed) and the hashes it commits to."""

    run_id: str
    resuming: bool
    run_dir: Path
    fingerprint: str
    started_at: str
    inputs: dict[str, str]
    config_bytes: bytes
    code_sha: str
