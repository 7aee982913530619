"""The one configuration model: closed, typed, YAML on disk, never names code.

``cvm-tune run`` with no ``--config`` uses ``Config()``: the embedded demo defaults (the
embedded guest-agent simulator, the bundled sample dataset encrypted on the fly, a tiny
Llama-shaped model built locally). A production file sets ``tee.mode: dstack``, an encrypted
dataset on a mounted volume and a pinned base model. ``cvm-tune schema`` prints the JSON schema.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from app.config.base import HEX64, _Closed, problems
from app.config.training import (
    EvaluationSettings,
    GpuTrainingSettings,
    LoraSettings,
    LossWatchdogSettings,
    PrivacySettings,
    TrainingSettings,
)
from app.errors import ConfigError
from app.config.federation import FederationSettings
from app.config.api import ApiSettings
from app.config.simulator import TeeSimulatorSettings
from attestation.io.http_edge import check_url as _edge_check_url
from attestation.io.safe_yaml import parse_yaml

__all__ = [  # with the training and evaluation sections of app.config.training
    "AlertSettings", "BaseModelSettings", "Config", "DatasetSettings", "DownloadSettings", "EvaluationSettings",
    "ExportSettings", "FederationSettings", "GpuTrainingSettings", "KeySettings", "LoraSettings", "LossWatchdogSettings",
    "OutputSettings", "PrivacySettings", "ScheduleSettings", "StateSettings", "TeeSettings", "TeeSimulatorSettings",
    "TrainingSettings", "load_config",
]

MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB; refuse anything that is not one before parsing it
MAX_CONFIG_DEPTH = 32


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
    gpu_evidence: Literal["auto", "required", "attested"] = Field(
        "auto",
        description="auto: record what attests the GPU (nvidia-smi CC state, driver/VBIOS, NVIDIA local-verifier report "
        "if nvattest is installed), or that there is no GPU. required: also refuse to train unless nvidia-smi reports "
        "every GPU in CC mode ON (not DevTools) and ready -- the driver's unsigned word -- and any NVIDIA report passed. "
        "attested: required, and NVIDIA's nvattest report for this run must exist and pass (the published image does "
        "not install nvattest).",
    )
    simulator: TeeSimulatorSettings = Field(default_factory=TeeSimulatorSettings, description="embedded-simulator only.")


class KeySettings(_Closed):
    """Where the dataset key comes from (docs/data-owner.md, "Where the dataset key comes from": what each source does NOT protect)."""

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


def check_url(url: str, what: str) -> urllib.parse.SplitResult:
    """Parse a URL cvm-tune will fetch and check the host it will contact: ``https://``, or ``http://`` only on
    loopback; printable ASCII without spaces or backslashes; no user name or password. The one rule of the HTTP
    edge (:func:`attestation.io.http_edge.check_url`), which then contacts exactly the host parsed here.

    Raises:
        ValueError: anything else (the message names ``what``).
    """
    return _edge_check_url(url, what)


class DownloadSettings(_Closed):
    """How dataset.source url fetches a version (resumable, bounded)."""

    timeout_s: float = Field(60.0, gt=0, le=3600, description="Connect and read timeout per request.")
    retries: int = Field(3, ge=0, le=20, description="Retries after the first request (network errors, 5xx, 429), "
                         "each resuming where the partial download stopped.")
    retry_backoff_s: float = Field(2.0, ge=0, le=600, description="Wait before the first retry; doubles per retry.")
    max_bytes: int = Field(64 << 30, gt=0, description="Refuse a larger download (checked against Content-Length and "
                           "while reading).")
    deadline_s: float = Field(7200.0, gt=0, le=86400, description="Give up a download (every attempt and wait "
                              "together) after this long, however slowly the server keeps sending; the partial "
                              "download is kept and resumed next run.")


class DatasetSettings(_Closed):
    """The encrypted training data."""

    source: Literal["bundled-sample", "encrypted-file", "url"] = Field(
        "bundled-sample",
        description="bundled-sample: the demo JSONL shipped with cvm-tune, encrypted on the fly into the output "
        "volume. encrypted-file: a cvm-tune encrypted dataset at `path` (a file, or a directory of versions). "
        "url: the owner publishes signed versions at `url`; each run downloads the current one (ciphertext only) "
        "into the output volume and keeps the newest valid version it has when the URL cannot be reached.",
    )
    path: Path | None = Field(None, description="Encrypted dataset file, or a directory of owner-signed versions (the "
                              "newest valid one for `dataset_id` is used), on the read-only data volume.")
    dataset_id: str | None = Field(
        None, min_length=1, max_length=200,
        description="The dataset id (signed header) to take from a directory or URL; required for those, checked "
        "against the file otherwise.")
    url: str | None = Field(
        None, description="source url: where the owner publishes the current signed version (HTTPS; plain http only on "
        "loopback; no user name or password in it). The transport is untrusted: the owner signature and every hash are "
        "checked before the key is used.")
    download: DownloadSettings = DownloadSettings()
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

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None:
            check_url(value, "dataset.url")
        return value

    @model_validator(mode="after")
    def _file_needs_path(self) -> DatasetSettings:
        if self.source == "encrypted-file" and self.path is None:
            raise ValueError("dataset.path is required when dataset.source is 'encrypted-file'")
        if self.source == "url" and (self.url is None or self.dataset_id is None or self.owner_public_key is None):
            raise ValueError("dataset.source 'url' needs dataset.url, dataset.dataset_id and dataset.owner_public_key "
                             "(the transport is untrusted: only owner-signed versions are used)")
        if self.source != "url" and self.url is not None:
            raise ValueError("dataset.url is only used with dataset.source 'url'")
        if self.key.source in ("release", "env") and (self.owner_public_key is None or self.source == "bundled-sample"):
            raise ValueError(f"dataset.key.source {self.key.source!r} needs an encrypted dataset (source "
                             "'encrypted-file' or 'url') and dataset.owner_public_key (the owner's signature is what "
                             "makes such a key trustworthy)")
        if self.owner_public_key is not None and self.source == "bundled-sample":
            raise ValueError("dataset.owner_public_key needs dataset.source 'encrypted-file' or 'url' (the bundled "
                             "sample is unsigned)")
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
    hub_id: str | None = Field(
        None, description="Hugging Face Hub name of these weights (e.g. Qwen/Qwen2.5-0.5B-Instruct): written to the adapter's "
        "adapter_config.json and model card so PEFT and the Hub find the base. Never downloaded; the tree hash stays the binding."
    )
    revision: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$", description="Hub revision (commit or tag) of hub_id."
    )

    @field_validator("hub_id")
    @classmethod
    def _hub_id(cls, v: str | None) -> str | None:
        if v is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(v)
            except HFValidationError as exc:
                raise ValueError(f"base_model.hub_id {v!r} is not a Hub repo id (OWNER/NAME): {exc}") from None
        return v

    @model_validator(mode="after")
    def _dir_needs_path(self) -> BaseModelSettings:
        if self.revision is not None and self.hub_id is None:
            raise ValueError("base_model.revision needs base_model.hub_id")
        if self.source == "local-dir" and self.path is None:
            raise ValueError("base_model.path is required when base_model.source is 'local-dir'")
        return self


class OutputSettings(_Closed):
    """The output volume: runs, checkpoints, audit chain and export bundles."""

    dir: Path = Field(Path("cvm-tune-output"), description="Output volume root.")
    scratch_dir: Path | None = Field(
        None, description="Private in-memory directory where the trainer writes a checkpoint before it is sealed "
        "(encrypted) onto the output volume; never on the output volume. It must exist and be a RAM file system "
        "(tmpfs/ramfs): cvm-tune never creates it. Unset: /dev/shm when writable, else the system temp directory "
        "(which must then be a tmpfs too).")
    scratch_unsafe_ok: bool = Field(
        False, description="Allow a scratch_dir that is not a RAM file system: the adapter and optimizer state of each "
        "checkpoint then sit in the clear on that disk until sealed and removed. Only for machines whose disk is itself "
        "inside the TEE's encrypted memory or discarded with it.")
    keep_checkpoints: int = Field(3, ge=1, le=100, description="Sealed checkpoints kept per run (newest first).")


class ScheduleSettings(_Closed):
    """`cvm-tune serve`: one run per calendar day at `time` in `timezone`, with catch-up, retries and a watchdog."""

    time: str = Field("02:00", pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$", description="Local time of day (HH:MM).")
    timezone: str = Field("UTC", min_length=1, description="IANA time zone of `time` (DST: a time in the spring gap "
                          "runs at the first valid instant after it, a time in the autumn fold runs once, at its first occurrence).")
    max_attempts: int = Field(3, ge=1, le=50, description="Attempts per slot (the first run and its retries).")
    retry_backoff_s: float = Field(60.0, gt=0, description="Wait before the first retry; doubles per attempt.")
    retry_backoff_max_s: float = Field(3600.0, gt=0, description="Cap on the wait between retries.")
    max_run_hours: float = Field(24.0, gt=0, description="Watchdog on the monotonic clock: a run still training after "
                                 "this long is checkpointed and stopped (failed: watchdog).")
    tick_s: float = Field(30.0, gt=0, le=3600, description="How often the service wakes up to check for work and "
                          "write its heartbeat.")
    health_max_age_s: float = Field(600.0, gt=0, description="`cvm-tune status --health` fails when the heartbeat "
                                    "is older than this (a run in progress refreshes it every step).")

    @model_validator(mode="after")
    def _known_zone(self) -> ScheduleSettings:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"schedule.timezone {self.timezone!r} is not a known IANA time zone") from exc
        return self


class AlertSettings(_Closed):
    """Failure alerts: a JSON POST to a webhook (metadata only, never dataset content)."""

    webhook_url_env: str = Field("CVM_TUNE_ALERT_WEBHOOK", pattern=r"^[A-Z_][A-Z0-9_]{0,63}$", description="Environment "
                                 "variable holding the webhook URL (a dstack encrypted env var: the URL often "
                                 "embeds a token, so it is never in the config or the bundle). Unset or empty: no alerts.")
    timeout_s: float = Field(10.0, gt=0, le=120)
    retries: int = Field(3, ge=0, le=10, description="Retries after the first POST (5xx, 429 and network errors).")
    retry_backoff_s: float = Field(2.0, ge=0, le=300, description="Wait before the first retry; doubles per retry.")


class StateSettings(_Closed):
    """The service's run database and its rollback anchor."""

    rollback_anchor: Path | None = Field(
        None, description="A file outside the output volume where the service publishes its run counter and audit "
        "chain head after every run and at every anchored checkpoint; a volume rolled back behind it is refused. "
        "Unset: no rollback detection.")


class ExportSettings(_Closed):
    """What the export bundle holds besides the adapter."""

    license: str = Field("other", pattern=r"^[a-z0-9][a-z0-9.+-]{0,63}$", description="License id for the model "
                         "card front matter (a Hub license id such as apache-2.0, or 'other'): usually the base model's.")
    merged: bool = Field(False, description="Also write the base + LoRA merged weights (merge_and_unload, sharded "
                         "safetensors) under merged/, hashed and signed like the adapter. Large: the full model size.")
    merged_max_shard_size: str = Field("4GB", pattern=r"^[1-9][0-9]{0,5}(KB|MB|GB)$", description="Largest merged "
                                       "safetensors shard (transformers' max_shard_size, e.g. 4GB or 500MB).")
    recipients: tuple[str, ...] = Field((), max_length=16, description="age X25519 recipients (age1…) the weight "
                                        "files are encrypted to, in addition to those the dataset's owner named in its "
                                        "signed header (which cannot be removed) and the CVM's own key. Empty, with a "
                                        "dataset that names none: the weights are exported in plaintext.")
    verify_page_url: str | None = Field(None, pattern=r"^https://[^\s<>()\[\]`]+$", max_length=512, description="Where "
                                        "you publish the browser verifier (web/dist/verify.html, or a bundles server's "
                                        "/verify): the model card then tells readers to open it and drop the bundle. "
                                        "None: the card names cvm-tune verify only.")

    @field_validator("recipients")
    @classmethod
    def _age_recipients(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if bad := [r for r in v if not re.fullmatch(r"age1[02-9ac-hj-np-z]{58}", r)]:
            raise ValueError(f"{bad[0][:70]!r} is not an age X25519 recipient (age1…, 62 characters)")
        return tuple(sorted(set(v)))


class Config(_Closed):
    """A whole cvm-tune configuration."""

    schema_version: Literal[1] = 1
    tee: TeeSettings = TeeSettings()
    dataset: DatasetSettings = DatasetSettings()
    base_model: BaseModelSettings = BaseModelSettings()
    training: TrainingSettings = TrainingSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    output: OutputSettings = OutputSettings()
    export: ExportSettings = ExportSettings()
    schedule: ScheduleSettings = ScheduleSettings()
    alerts: AlertSettings = AlertSettings()
    state: StateSettings = StateSettings()
    federation: FederationSettings = FederationSettings()
    api: ApiSettings = ApiSettings()

    def canonical_json(self) -> bytes:
        """The bytes hashed into the manifest and written to the bundle's ``config.json``."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    def training_json(self) -> bytes:
        """Canonical JSON of the settings that shape the adapter (a checkpoint's config identity)."""
        data = self.model_dump(mode="json", include={"training", "base_model"})
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def load_config(path: Path | None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Read and validate a YAML config; ``None`` gives the embedded defaults. ``overrides`` are ``KEY=VALUE``
    settings (``training.max_steps=5``: a dotted key, a YAML value) applied over the file before it is validated.

    Raises:
        ConfigError: unreadable file, bad YAML, a malformed override, or a schema violation (all problems listed).
    """
    if path is None:
        if not overrides:
            return Config()
        data: object = {}
    else:
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}", fix="pass an existing YAML file") from exc
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {path} is larger than {MAX_CONFIG_BYTES} bytes: not a cvm-tune config")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path} is not UTF-8 text (byte {exc.start})") from exc
        data = parse_yaml(text, f"config {path}", ConfigError, max_depth=MAX_CONFIG_DEPTH)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a YAML mapping at the top level")
    for item in overrides:
        _override(data, item)  # type: ignore[arg-type]
    where = f"config {path}" if path is not None else "the embedded defaults"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}{' with --set' if overrides else ''} is invalid: {problems(Config, exc)}") \
            from exc


_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,7}")


def _override(data: dict, item: str) -> None:
    """Set ``KEY=VALUE`` in ``data``: the sections on the key's path are made (or must be mappings), the value is
    read as YAML (``5``, ``true``, ``[a, b]``, ``null``); the model then judges it like a value in the file.

    Raises:
        ConfigError: not ``KEY=VALUE``, a key that crosses a value, or a value that is not YAML.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY.fullmatch(key):
        raise ConfigError(f"--set {item!r} is not KEY=VALUE with a dotted key",
                          fix="e.g. --set training.max_steps=5 (keys: docs/configuration.md, `cvm-tune schema`)")
    value = parse_yaml(text, f"--set {key}", ConfigError, max_depth=MAX_CONFIG_DEPTH)
    *sections, name = key.split(".")
    node = data
    for depth, part in enumerate(sections):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(sections[:depth + 1])} is a value, not a section",
                              fix="set the value itself, or a key of a section")
        node = child
    node[name] = value
