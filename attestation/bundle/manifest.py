"""Export-bundle layout, the manifest schema and the report_data binding.

A bundle ``exports/<run_id>/`` holds::

    adapter/adapter_config.json       PEFT adapter (base_model_name_or_path: the base's Hub id or name)
    adapter/adapter_model.safetensors   the weights; adapter_model.safetensors.age (age ciphertext) instead when the
                                      manifest has ``confidentiality`` (``attestation.outputs.confidential``)
    adapter/tokenizer*.json, ...      the base model's tokenizer files (a loadable PEFT repo)
    adapter/model.sig                 OpenSSF model signature of adapter/ (``model-signing``, ECDSA P-256 key
                                      derived in the CVM; public key in the manifest ``signing``)
    merged/                           optional (``export.merged``): base + LoRA merged, sharded safetensors,
                                      config, tokenizer and its own ``model.sig``
    config.json                       the resolved run configuration (canonical JSON)
    app-compose.json                  the dstack app-compose the CVM measured (raw bytes)
    README.md                         model card
    report/report.json, report/loss.png   run report: metrics and counts, no data (absent from older bundles)
    audit.jsonl                       this run's slice of the hash-chained audit log
    manifest.json                     hashes of all of the above + provenance (schema below)
    quote.bin, quote.hex              TDX quote whose report_data = manifest_report_data(manifest.json)
    event_log.json                    the event log returned with the quote (RTMR0-3 replay)
    collateral.json                   Intel (or test-CA) collateral for offline verification, when available
    gpu-evidence.json                 raw GPU captures (nvidia-smi CC state, NVIDIA report): ``attestation.tdx.gpu``

**report_data** (64 bytes) = ``SHA-512(b"cvm-tune-manifest-v1:" || manifest.json bytes)`` — dstack's
typed-content convention ``hash(tag ":" content)`` with a cvm-tune tag, over the exact file bytes.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from attestation.outputs import confidential as C
from attestation.outputs.confidential import ConfidentialityInfo
from attestation.tdx.gpu import FILE as GPU_EVIDENCE
from attestation.tdx.gpu import GpuInfo

MANIFEST_SCHEMA = "cvm-tune/manifest/v1"
REPORT_DATA_TAG = b"cvm-tune-manifest-v1"
RUN_ID_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}"  # a safe single path component

MANIFEST = "manifest.json"
QUOTE_BIN = "quote.bin"
QUOTE_HEX = "quote.hex"
EVENT_LOG = "event_log.json"
COLLATERAL = "collateral.json"
MR_CONFIG = "mr-config.json"  # dstack 0.6: the MrConfigV3 document a v3 MRCONFIGID is the hash of (exact bytes)
GPU_BOOT_EVIDENCE = "gpu-boot-evidence.json"  # dstack 0.6: nvattest's boot-time output, bound by RTMR3 gpu-attestation
AUDIT = "audit.jsonl"
AUDIT_ANCHORS = "audit-anchors.jsonl"  # quotes over the chain head at each checkpoint (attestation.bundle.anchors)
CONFIG = "config.json"
APP_COMPOSE = "app-compose.json"
MODEL_CARD = "README.md"
ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")  # their plaintext names
WEIGHTS = ADAPTER_FILES[1]
# Files whose hashes the manifest must list (collateral and the quote cannot be: they come after it).
HASHED_FILES = (*ADAPTER_FILES, CONFIG, APP_COMPOSE, MODEL_CARD, AUDIT)
ARTIFACT_FILES = tuple(f for f in HASHED_FILES if f != AUDIT)  # what the audit `export` entry commits to
ATTESTATION_FILES = (MANIFEST, QUOTE_BIN, QUOTE_HEX, EVENT_LOG)
# The run report: hashed in `files` like the rest (all or none: bundles made before reports lack both).
REPORT_FILES = ("report/report.json", "report/loss.png")
# Made by the platform, not the run; each is checked by what it must reproduce (MRCONFIGID, an RTMR3 event's hash).
OPTIONAL_FILES = (COLLATERAL, MR_CONFIG, GPU_BOOT_EVIDENCE)
# Directories whose further files (tokenizer, signature, merged shards) the manifest lists by name: one level deep,
# a plain file name each (the manifest, bound by the quote, says which exist).
LISTED_DIRS = ("adapter", "merged")
LISTED_FILE = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}"
SIGNATURE_NAME = "model.sig"  # model_signing's default signature file name, inside each signed directory
SIGNING_GETKEY_PATH = "cvm-tune/model-signing/v1"


def encrypted(manifest: Manifest) -> bool:
    """The bundle holds its weight files as age ciphertext, named ``<name>.age`` (``confidentiality``)."""
    return manifest.confidentiality is not None


def artifact_files(confidential: bool) -> tuple[str, ...]:
    """What the audit ``export`` entry commits to: ARTIFACT_FILES, the weights under their ``.age`` name when the
    bundle is confidential."""
    return tuple(C.stored_name(f, confidential) for f in ARTIFACT_FILES)


def weights_file(manifest: Manifest) -> str:
    """Where the bundle holds its adapter weights: ``adapter/adapter_model.safetensors``, or its ``.age`` name."""
    return C.stored_name(WEIGHTS, encrypted(manifest))


def hashed_files(manifest: Manifest | None) -> tuple[str, ...]:
    """The files a manifest must list: HASHED_FILES (the weights under their ``.age`` name when encrypted), plus
    gpu-evidence.json when it records a ``gpu``, plus the run report when it lists any report file (bundles made
    before reports have neither)."""
    if manifest is None:
        return HASHED_FILES
    base = tuple(C.stored_name(f, encrypted(manifest)) for f in HASHED_FILES)
    gpu = (GPU_EVIDENCE,) if manifest.gpu is not None else ()
    gpu += (AUDIT_ANCHORS,) if manifest.audit.anchors is not None else ()
    report = REPORT_FILES if set(REPORT_FILES) & set(manifest.files) else ()
    signed = tuple(f"{d}/{SIGNATURE_NAME}" for d in manifest.signing.signed) if manifest.signing else ()
    listed = tuple(sorted(f for f in manifest.files if _LISTED.fullmatch(f) and f not in base and f not in signed))
    return base + gpu + report + signed + listed


def files_problem(manifest: Manifest) -> str | None:
    """Why ``manifest.files`` is not the list the manifest must have (None: it is): a weight file under the wrong
    name for the bundle's kind first (plaintext name in a confidential bundle, ``.age`` name in a plaintext one),
    then any other difference from :func:`hashed_files`."""
    if bad := C.naming_problems(manifest.files, encrypted(manifest)):
        return "; ".join(bad[:3])
    if set(manifest.files) != set(hashed_files(manifest)):
        return f"manifest lists {sorted(manifest.files)}, expected {sorted(hashed_files(manifest))}"
    return None


_LISTED = re.compile(rf"(?:{'|'.join(LISTED_DIRS)})/{LISTED_FILE}")
LISTED_NAME = re.compile(LISTED_FILE)
Hex64 = str
_H64 = Field(pattern=r"^[0-9a-f]{64}$")


def manifest_report_data(manifest_bytes: bytes) -> bytes:
    """The 64-byte report_data that binds a quote to these exact manifest bytes."""
    return hashlib.sha512(REPORT_DATA_TAG + b":" + manifest_bytes).digest()


TRAINING_SECTIONS = ("base_model", "training")


def training_config_sha256(config_bytes: bytes) -> str:
    """SHA-256 of the canonical JSON of the config's ``base_model`` and ``training`` sections: the settings
    that shape the adapter. ``run.start``/``run.resume`` audit entries commit to it, so a resume after a change
    elsewhere in the config (output, schedule, alerts) stays verifiable. Unparseable config -> ``"invalid"``."""
    import json

    try:
        doc = json.loads(config_bytes)
        sections = {k: doc[k] for k in TRAINING_SECTIONS}
    except (ValueError, TypeError, KeyError, RecursionError):
        return "invalid"
    return hashlib.sha256(json.dumps(sections, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class CodeInfo(_Closed):
    package: str
    version: str
    source_sha256: Hex64 = _H64


class BackendInfo(_Closed):
    name: Literal["hf", "unsloth"]
    device: str
    libraries: dict[str, str]
    cpu_threads: int | None = Field(None, ge=1)  # torch's CPU threads (a replay needs them); absent in older bundles


class BaseModelInfo(_Closed):
    name: str
    hub_id: str | None = None  # the Hub name of the local weights (config base_model.hub_id); never downloaded
    revision: str | None = None
    source: str
    tree_sha256: Hex64 = _H64
    files: dict[str, Hex64]


class DatasetInfo(_Closed):
    dataset_id: str
    dataset_version: int
    format: str
    encrypted_sha256: Hex64 = _H64
    encrypted_size: int
    plaintext_sha256: Hex64 = _H64
    plaintext_size: int
    rows: int
    key_source: str
    # Owner-signed datasets (format version 2; attestation.bundle.dataset_sig). None: the dataset was unsigned.
    owner_public_key: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    owner_key_id: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    commitment: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the owner-signed statement")
    # Counted row-policy decisions (duplicates, too long, no trainable token): counts only, never content.
    validation: dict[str, int] | None = None
    # The plaintext's format and the SHA-256 of its validated rows as canonical JSONL (the same for a Parquet, Arrow
    # or JSONL file of the same rows). Absent in bundles made before tables were accepted.
    plaintext_format: Literal["jsonl", "parquet", "arrow"] | None = None
    rows_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class TeeInfo(_Closed):
    mode: Literal["embedded-simulator", "dstack"]
    app_id: str = Field(pattern=r"^[0-9a-f]{40}$")
    instance_id: str
    compose_hash: Hex64 = _H64
    agent_version: str
    agent_rev: str


class BatchSizes(_Closed):
    micro: int
    accumulation: int
    eval_micro: int


class BatchAdjustment(_Closed):
    phase: Literal["train", "eval"]
    reason: Literal["oom", "auto"]
    at_step: int
    from_: BatchSizes = Field(alias="from")
    to: BatchSizes


class BatchConfigured(_Closed):
    micro: int
    accumulation: int
    auto: bool


class BatchInfo(_Closed):
    """Micro-batch sizes: configured, what ran, and every OOM back-off / auto-size change (also audit ``train.batch``)."""

    configured: BatchConfigured
    final: BatchSizes
    processes: int
    effective: int
    adjustments: list[BatchAdjustment]


class DpoInfo(_Closed):
    """Preference training (``training.objective: dpo``): the reference is the base model (adapter disabled)."""

    beta: float = Field(gt=0)
    loss_type: Literal["sigmoid", "hinge", "ipo"]
    reference: Literal["base model (adapter disabled)"]


class TrainingInfo(_Closed):
    seed: int
    global_step: int
    resumed_from_step: int | None
    losses: list[tuple[int, float]]
    train_runtime_s: float
    tokens_seen: int | None
    effective_batch_size: int
    batch: BatchInfo | None = None
    eval_losses: list[tuple[int, float]] | None = None
    # The training objective and, for dpo, its settings; absent in bundles made before DPO (they are sft).
    objective: Literal["sft", "dpo"] = "sft"
    dpo: DpoInfo | None = None


class AuditInfo(_Closed):
    head: Hex64 = _H64
    start_prev: Hex64 = _H64
    first_seq: StrictInt  # JSON integers only (not "7" nor true), as the page reads them
    entries: StrictInt
    rtmr3: Literal["emit_event", "unsupported"]
    anchors: StrictInt | None = Field(None, ge=0)  # lines of audit-anchors.jsonl (attestation.bundle.anchors); None: none


class BuildInfo(_Closed):
    """The image and dependency lock of the run (``app.run.build_info``); absent outside a container."""

    image: str | None  # the cvm-tune service's image in the measured app-compose.json
    image_digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None
    base_image: str | None
    lock_file: str | None
    lock_sha256: Annotated[str, _H64] | None
    lock_mismatches: list[str]  # installed distributions that differ from the lock (empty: none)


class LineageInfo(_Closed):
    """The promoted bundle this run continued from (warm start); committed in the run's ``run.start`` entry."""

    parent_run_id: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    parent_manifest_sha256: Hex64 = _H64  # SHA-256 of the parent's manifest.json bytes
    parent_adapter_sha256: Hex64 = _H64  # SHA-256 of the parent's adapter weights file (its .age file when encrypted)


class EvaluationInfo(_Closed):
    """The promotion gate: candidate and parent scored on the owner's eval rows, and the decision."""

    metric: Literal["loss", "dpo_loss"]  # dpo_loss: the mean DPO loss against the base model (objective dpo)
    rows: int = Field(ge=1)
    candidate_loss: float
    parent_loss: float
    # dpo_loss only: share of eval pairs whose chosen answer the model prefers over the rejected one (vs the base)
    candidate_accuracy: float | None = Field(None, ge=0, le=1)
    parent_accuracy: float | None = Field(None, ge=0, le=1)
    parent: str  # "run <id>" or "the base model"
    max_regression: float = Field(ge=0)
    promote: bool


def promotion_rule(candidate_loss: float, parent_loss: float, max_regression: float) -> bool:
    """Promote when the candidate is not worse than its parent beyond the allowed relative regression."""
    return candidate_loss <= parent_loss * (1.0 + max_regression)


class FederationInfo(_Closed):
    """A federated round this run trained for (``app.federated``): the aggregator's round number and fresh nonce,
    and the global adapter it started from (SHA-256 of its safetensors bytes; None: from the base model)."""

    round: int = Field(ge=1)
    nonce: Hex64 = _H64
    global_adapter_sha256: Hex64 | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    proximal_mu: float = Field(0.0, ge=0)  # FedProx: weight of the proximal term the client trained with


class SigningInfo(_Closed):
    """OpenSSF model signatures (``model-signing``, key-based): one ``<dir>/model.sig`` per signed directory.

    The key is ECDSA P-256, derived in the CVM from dstack GetKey at ``key_path`` (bound to the app id); the public
    key is here, so the quote's report_data binds it. Check with ``model_signing verify key <dir> --signature
    <dir>/model.sig --public_key KEY.pem``.
    """

    scheme: Literal["model-signing/ec-key"] = "model-signing/ec-key"
    key_path: str
    public_key_pem: str = Field(pattern=r"^-----BEGIN PUBLIC KEY-----\n[A-Za-z0-9+/=\n]+-----END PUBLIC KEY-----\n$")
    signed: tuple[Literal["adapter", "merged"], ...] = Field(min_length=1)

    @field_validator("signed")
    @classmethod
    def _adapter_first(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if v[0] != "adapter" or len(set(v)) != len(v):
            raise ValueError("signed must start with 'adapter' and name each directory once")
        return v


class PrivacyLibraries(_Closed):
    opacus: str
    torch: str


class PrivacyInfo(_Closed):
    """DP-SGD as run (``training.privacy``): the mechanism's parameters and the (epsilon, delta) it spent.

    ``rows`` is N after deduplication and the token policy (= ``dataset.rows``); ``sample_rate`` =
    ``expected_batch_size / rows``; ``steps`` = ``training.global_step``; the verifier checks all three.
    """

    mechanism: Literal["dp-sgd"]
    sampling: Literal["poisson"]
    library: PrivacyLibraries
    max_grad_norm: float = Field(gt=0)
    noise_multiplier: float = Field(gt=0)
    noise_derived: bool
    sample_rate: float = Field(gt=0, le=1)
    expected_batch_size: int = Field(ge=1)
    rows: int = Field(ge=2)
    steps: int = Field(ge=0)
    accountant: Literal["rdp", "prv"]
    epsilon: float = Field(ge=0)
    delta: float = Field(gt=0, lt=1)
    target_epsilon: float = Field(gt=0)


class OpChainInfo(_Closed):
    """A training-API checkpoint (``cvm-tune api serve``): the head of the SHA-256 chain over every op that changed
    the model (forward_backward, optim_step, load), in order (``attestation.outputs.op_chain``), the LoRA and the
    last Adam parameters. ``cvm-tune verify BUNDLE --ops OPS.jsonl`` recomputes the head from the client's record."""

    schema_: Literal["cvm-tune/op-chain/v1"] = Field("cvm-tune/op-chain/v1", alias="schema")
    head: Hex64 = _H64
    ops: int = Field(ge=0)
    optimizer_steps: int = Field(ge=0)
    checkpoint: str
    # Strict kinds, as on the page: 1.0 is not an integer (a lax int would read it as 1), true not a number.
    lora: dict[str, StrictInt | StrictBool | None]
    adam_params: dict[str, StrictFloat | StrictInt] | None = None
    # DP-SGD (opt-in per model): noise_multiplier, max_grad_norm, dataset_size, batch_size, sample_rate, delta,
    # accountant, steps and the epsilon spent (each optim_step's is also in the chain). None: trained without DP.
    dp: dict[str, StrictInt | StrictFloat | StrictStr] | None = None
    # What a bit-exact replay needs (``cvm-tune verify --ops --replay``): device (cpu or cuda), torch's CPU threads,
    # the CPU kernels torch chose (``cpu_capability``: DEFAULT, AVX2, AVX512, …) and on a CPU the rows every packed
    # pass was padded to (``pass_rows``; 0: no packed passes).
    # None: a bundle made before replay existed.
    determinism: dict[str, StrictInt | StrictStr] | None = None
    # Server-side custom losses the ops used: loss id (the hash of the document) -> {name, inputs, graph} as sent.
    custom_losses: dict[str, dict[str, Any]] | None = None

    @field_validator("dp")
    @classmethod
    def _dp_members(cls, dp: dict[str, Any] | None) -> dict[str, Any] | None:
        """Each member of ``dp`` of its kind, as the server writes it (its numbers are checked by ``privacy.dp``)."""
        from attestation.outputs.op_chain import op_chain_dp_problem

        if dp is not None and (problem := op_chain_dp_problem(dp)):
            raise ValueError(problem)
        return dp


class Manifest(_Closed):
    """The provenance manifest (schema ``cvm-tune/manifest/v1``)."""

    schema_: Literal["cvm-tune/manifest/v1"] = Field(MANIFEST_SCHEMA, alias="schema")
    run_id: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    started_at: str
    created_at: str
    code: CodeInfo
    backend: BackendInfo
    base_model: BaseModelInfo
    dataset: DatasetInfo
    tee: TeeInfo
    training: TrainingInfo
    audit: AuditInfo
    files: dict[str, Hex64]
    gpu: GpuInfo | None = None  # absent only in bundles from before GPU evidence was recorded
    build: BuildInfo | None = None
    lineage: LineageInfo | None = None  # None: trained from the base model
    evaluation: EvaluationInfo | None = None  # None: no promotion gate
    signing: SigningInfo | None = None  # absent only in bundles from before model signatures
    privacy: PrivacyInfo | None = None  # absent: trained without differential privacy
    federation: FederationInfo | None = None  # None: not trained for a federated round
    op_chain: OpChainInfo | None = None  # None: not a training-API checkpoint
    confidentiality: ConfidentialityInfo | None = None  # None: weights in plaintext (attestation.outputs.confidential)
