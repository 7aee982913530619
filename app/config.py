"""The one configuration model: closed, typed, YAML on disk, never names code.

``cvm-tune run`` with no ``--config`` uses ``Config()``: the embedded demo defaults (the
embedded guest-agent simulator, the bundled sample dataset encrypted on the fly, a tiny
Llama-shaped model built locally). A production file sets ``tee.mode: dstack``, an encrypted
dataset on a mounted volume and a pinned base model. ``cvm-tune schema`` prints the JSON schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.errors import ConfigError

HEX64 = r"^[0-9a-f]{64}$"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TeeSettings(_Closed):
    """Where quotes, keys and RTMR3 events come from."""

    mode: Literal["embedded-simulator", "dstack"] = Field(
        "embedded-simulator",
        description="embedded-simulator: start the in-process guest-agent simulator (test CA, NOT a TEE). "
        "dstack: talk to the guest agent at `endpoint`.",
    )
    endpoint: str | None = Field(
        None,
        description="dstack mode only: unix socket path or http(s) URL of the guest agent. "
        "Unset: $DSTACK_SIMULATOR_ENDPOINT, else /var/run/dstack.sock.",
    )
    timeout_s: float = Field(30.0, gt=0, le=600, description="Per-request timeout for the guest agent.")
    emit_events: Literal["auto", "required"] = Field(
        "auto",
        description="auto: extend RTMR3 with EmitEvent when the agent supports it, else record that it "
        "does not (the hash chain is kept either way). required: fail if EmitEvent is unsupported.",
    )
    collateral: Literal["auto", "pccs", "none"] = Field(
        "auto",
        description="Where the bundle's collateral.json comes from. auto: the simulator's test collateral "
        "in simulator mode, the PCCS in dstack mode. none: export without collateral.",
    )
    pccs_url: str = Field("https://pccs.phala.network", description="PCCS used when collateral is fetched.")


class KeySettings(_Closed):
    """Where the dataset key comes from (README "Dataset keys": what each source does NOT protect)."""

    source: Literal["getkey", "file", "release", "env"] = Field(
        "getkey",
        description="getkey: dstack GetKey at `getkey_path` (the owner trusts whatever code holds the app id). "
        "file: a 32-byte key file (demo/tests: protects nothing against whoever reads the file). "
        "release: attested key release: the owner verifies this CVM's quote and sends a grant (needs "
        "dataset.owner_public_key). env: 64 hex characters in the env var `env_var`, e.g. a dstack encrypted env "
        "var: confidential but forgeable by the host, so only with dataset.owner_public_key.",
    )
    getkey_path: str = Field("cvm-tune/dataset/v1", min_length=1, description="GetKey path for the dataset key.")
    file: Path | None = Field(None, description="Key file (32 raw bytes or 64 hex characters) when source is file.")
    env_var: str = Field("CVM_TUNE_DATASET_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,254}$",
                         description="source env: the environment variable holding the key (list it in allowed_envs).")
    grant_file: Path | None = Field(
        None, description="source release: where the owner's key grant is placed. Unset: "
        "<output.dir>/key-release/grant.json. The key request is written to <output.dir>/key-release/request.json."
    )

    @model_validator(mode="after")
    def _file_needs_path(self) -> KeySettings:
        if self.source == "file" and self.file is None:
            raise ValueError("dataset.key.file is required when dataset.key.source is 'file'")
        return self


class DatasetSettings(_Closed):
    """The encrypted training data."""

    source: Literal["bundled-sample", "encrypted-file"] = Field(
        "bundled-sample",
        description="bundled-sample: the demo JSONL shipped with cvm-tune, encrypted on the fly into the output "
        "volume. encrypted-file: a cvm-tune encrypted dataset at `path`.",
    )
    path: Path | None = Field(None, description="Encrypted dataset file (on the read-only data volume).")
    key: KeySettings = KeySettings()
    owner_public_key: str | None = Field(
        None, pattern=HEX64,
        description="The data owner's Ed25519 public key (64 hex, the .pub file of `cvm-tune keys new`). Set: the "
        "dataset must be format version 2 signed by this key, checked before training. Required by key sources "
        "release and env.",
    )
    max_row_bytes: int = Field(1 << 20, gt=0, le=64 << 20, description="Rows longer than this are rejected before parsing.")
    max_plaintext_bytes: int = Field(
        1 << 30, gt=0, description="Refuse a larger plaintext (training holds every row in memory; about 5-10x the "
        "JSONL size in Python objects): a clear error instead of running out of memory."
    )
    dedup: Literal["exact", "normalized", "off"] = Field(
        "exact", description="Duplicate rows are dropped (first kept, file order) and counted. exact: same JSON "
        "value. normalized: also equal after Unicode NFKC, case folding and whitespace collapsing. off: keep all."
    )
    too_long: Literal["truncate", "drop"] = Field(
        "truncate", description="Rows longer than training.max_length tokens: truncate (keep the first max_length "
        "tokens) or drop; counted either way. Rows left with no trainable token are always dropped and counted."
    )

    @model_validator(mode="after")
    def _file_needs_path(self) -> DatasetSettings:
        if self.source == "encrypted-file" and self.path is None:
            raise ValueError("dataset.path is required when dataset.source is 'encrypted-file'")
        if self.key.source in ("release", "env") and (self.owner_public_key is None or self.source != "encrypted-file"):
            raise ValueError(f"dataset.key.source {self.key.source!r} needs dataset.source 'encrypted-file' and "
                             "dataset.owner_public_key (the owner's signature is what makes such a key trustworthy)")
        if self.owner_public_key is not None and self.source != "encrypted-file":
            raise ValueError("dataset.owner_public_key needs dataset.source 'encrypted-file' (the bundled sample is unsigned)")
        return self


class BaseModelSettings(_Closed):
    """The model the adapter is trained on top of. Never downloaded."""

    source: Literal["tiny-llama", "local-dir"] = Field(
        "tiny-llama", description="tiny-llama: built locally and deterministically (demo). local-dir: a HF model directory."
    )
    path: Path | None = Field(None, description="Model directory when source is local-dir.")
    sha256: str | None = Field(
        None, pattern=HEX64, description="Pinned tree hash of the model directory (see `manifest.json` base_model.tree_sha256)."
    )

    @model_validator(mode="after")
    def _dir_needs_path(self) -> BaseModelSettings:
        if self.source == "local-dir" and self.path is None:
            raise ValueError("base_model.path is required when base_model.source is 'local-dir'")
        return self


class LoraSettings(_Closed):
    """LoRA adapter shape."""

    r: int = Field(8, ge=1, le=1024)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), min_length=1
    )


class TrainingSettings(_Closed):
    """Optimisation settings shared by both backends."""

    backend: Literal["auto", "hf", "unsloth"] = Field(
        "auto", description="auto: Unsloth when it imports and a CUDA GPU is present, else transformers+PEFT+TRL."
    )
    seed: int = 42
    max_steps: int = Field(30, ge=1)
    per_device_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(2, ge=1)
    learning_rate: float = Field(5e-3, gt=0)
    max_length: int = Field(128, ge=8, description="Tokens per example; longer examples are truncated by TRL.")
    save_steps: int = Field(10, ge=1, description="Checkpoint interval (optimizer steps) on the output volume.")
    logging_steps: int = Field(1, ge=1)
    assistant_only_loss: bool = False
    lora: LoraSettings = LoraSettings()


class OutputSettings(_Closed):
    """The output volume: runs, checkpoints, audit chain and export bundles."""

    dir: Path = Field(Path("cvm-tune-output"), description="Output volume root.")


class Config(_Closed):
    """A whole cvm-tune configuration."""

    schema_version: Literal[1] = 1
    tee: TeeSettings = TeeSettings()
    dataset: DatasetSettings = DatasetSettings()
    base_model: BaseModelSettings = BaseModelSettings()
    training: TrainingSettings = TrainingSettings()
    output: OutputSettings = OutputSettings()

    def canonical_json(self) -> bytes:
        """The bytes hashed into the manifest and written to the bundle's ``config.json``."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def load_config(path: Path | None) -> Config:
    """Read and validate a YAML config; ``None`` gives the embedded defaults.

    Raises:
        ConfigError: unreadable file, bad YAML, or a schema violation (all problems listed).
    """
    if path is None:
        return Config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}", fix="pass an existing YAML file") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}".splitlines()[0]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a YAML mapping at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"config {path} is invalid: {problems}") from exc
