"""The input stages of a run: the guest agent, tonight's dataset version and its key, the decrypted rows, the base
model and the token budget (:mod:`app.run.pipeline` runs them in this order, then trains, exports and attests).

Each stage is a function with typed inputs and outputs; nothing here writes plaintext to disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attestation.io.hashing import sha256_hex, tree_digest

from app import alerts
from app.audit import AuditLog
from app.run.build_info import build_info
from app.config import Config
from app.dataset import DerivedKeySource, KeySource, open_encrypted, parse_jsonl
from app.dataset.key_request import ReleasedKeySource
from app.dataset import tabular
from app.dataset.format import CONTENT_TYPE
from app.dataset.row_sets import check_objective, rows_sha256
from app.dataset.rows import split_eval_rows
from app.dataset.sources import Located, download, locate
from app.dataset.versions import check_version, rebuild_if_missing
from app.errors import BaseModelError, DataError, EmptyDatasetError, KeyReleasePendingError, TeeError
from app.run.inputs import base_model, dataset_file, key_source, open_dataset
from app.tee import GuestAgent, Identity, open_guest_agent

Progress = Callable[[str], None]
DATASET_CONTENT_TYPES = (CONTENT_TYPE, *tabular.CONTENT_TYPES)  # JSONL, Parquet, Arrow IPC


@dataclass(frozen=True)
class Agent:
    agent: GuestAgent
    ident: Identity
    simulated: bool
    compose_bytes: bytes
    build: dict[str, Any]


@dataclass(frozen=True)
class Keys:
    source: KeySource
    dataset: bytes
    checkpoint: bytes
    located: Located | None = None  # the version this key opens (an older one while a key release is pending)
    note: str | None = None  # why that is not the newest version
    checkpoint_epochs: Any = None  # app.keys_epoch.KeyEpochs the checkpoint key was derived under (None: unknown)


@dataclass
class Dataset:
    path: Path
    rows: list[Any]
    rows_report: Any  # app.dataset.RowReport
    chunks: int
    info: dict[str, Any]  # the manifest's "dataset" section
    eval_rows: list[Any] = field(default_factory=list)  # the owner's "split": "eval" rows (promotion gate)
    note: str | None = None  # e.g. a pending key release made this an older version
    tokens: list[Any] | None = None  # the token stage's ids of ``rows`` (handed to the trainer: tokenized once)
    recipients: tuple[str, ...] = ()  # the age recipients the owner signed into the authenticated header


@dataclass(frozen=True)
class BaseModel:
    dir: Path
    name: str
    tree: str
    files: dict[str, str]


def agent_stage(cfg: Config, stack: ExitStack, progress: Progress) -> Agent:
    """Open (or start) the guest agent; its app-compose must hash to its compose-hash."""
    agent = stack.enter_context(open_guest_agent(cfg.tee))
    ident = agent.identity()
    simulated = cfg.tee.mode == "embedded-simulator" or ident.is_cvm_tune_simulator
    kind = "cvm-tune SIMULATOR (test CA, not a TEE)" if simulated else "dstack"
    progress(f"guest agent: {kind} {ident.version} app_id {ident.app_id} compose_hash {ident.compose_hash[:16]}…")
    compose_bytes = ident.app_compose.encode()
    if sha256_hex(compose_bytes) != ident.compose_hash:
        raise TeeError("the agent's app-compose text does not hash to its compose-hash", fix="report this: the guest agent is inconsistent")
    # image digest from the measured compose, lock hash from the image
    return Agent(agent, ident, simulated, compose_bytes, build_info(ident.app_compose))


def source_stage(cfg: Config, out: Path, progress: Progress) -> Located | None:
    """Which encrypted file this run uses: the configured file, the newest valid version in a directory, or the
    owner's current version downloaded from a URL (checked before use; the last good one when the URL fails).
    ``None``: the bundled sample (encrypted with the key in the next stage)."""
    d = cfg.dataset
    owner = bytes.fromhex(d.owner_public_key) if d.owner_public_key else None

    def fetch(inbox: Path) -> None:
        path = download(d.url, inbox, dataset_id=d.dataset_id, owner_public_key=owner,  # type: ignore[arg-type]
                        timeout_s=d.download.timeout_s, retries=d.download.retries,
                        backoff_s=d.download.retry_backoff_s, max_bytes=d.download.max_bytes,
                        deadline_s=d.download.deadline_s)
        progress(f"dataset: fetched {path.name} from the owner's URL (owner signature and body hash checked)")

    located = locate(d.source, d.path, d.dataset_id, owner, out, fetch=fetch)
    if located is None:
        return None
    for note in located.skipped:
        progress(f"dataset: passed over {note}")
    if located.fetch_error:
        progress(f"dataset: {located.fetch_error}; using the newest version fetched before: {located.path.name}")
        alerts.send(cfg.alerts, {"event": "dataset.fetch_failed", "reason": located.fetch_error}, output=out)
    elif located.skipped:
        alerts.send(cfg.alerts, {"event": "dataset.version_skipped", "reason": "; ".join(located.skipped)[:500]},
                    output=out)
    if located.version >= 0:
        progress(f"dataset: using {located.path.name} (dataset_version {located.version}, the newest valid one)")
    return located


def key_stage(cfg: Config, ag: Agent, out: Path, located: Located | None, progress: Progress) -> Keys:
    """The dataset key (GetKey-derived, a key file, an env var, or released by the owner) and the checkpoint key
    (its own GetKey path, bound to the app id, never on disk)."""
    source = key_source(cfg, ag.agent, ag.ident, out, located.path if located else None)
    note = None
    try:
        dataset_key = source.dataset_key()
    except KeyReleasePendingError as exc:  # a version under a new key: keep training the last released one
        fallback = _released_version(source, located)
        if fallback is None:
            raise
        note = (f"key release pending for dataset v{located.version} (under a new key; "  # type: ignore[union-attr]
                f"send {out / 'key-release' / 'request.json'} to the data owner): using v{fallback[0].version}, "
                "the last released version")
        located, dataset_key = fallback
        progress(f"dataset: {note}")
        alerts.send(cfg.alerts, {"event": "key_release.pending", "reason": exc.message}, output=out)
    ckpt = checkpoint_keys(cfg, ag.agent, out, progress)
    return Keys(source, dataset_key, ckpt.current, located, note, ckpt.current_epochs)


def checkpoint_keys(cfg: Config, agent: Any, out: Path, progress: Progress) -> Any:
    """The checkpoint key across KMS key epochs; every sealed checkpoint on the volume sealed under older epochs is
    re-sealed under the current ones first (``app.keys_epoch``; the plaintext passes through RAM only).

    Raises:
        KeyEpochError: an old epoch's key cannot be had (nothing changed).
    """
    import shutil
    import tempfile

    from app.dataset.keys import derive_key
    from app.keys_epoch import EpochKeys, FixedKey
    from app.run.inputs import scratch_dir
    from app.training.checkpoints import CHECKPOINT_GETKEY_PATH, rekey_checkpoints

    if not isinstance(agent, GuestAgent):  # a stand-in agent (tests): one key, no epochs
        return FixedKey(DerivedKeySource(agent.get_key, CHECKPOINT_GETKEY_PATH, "cvm-tune-checkpoint-key").dataset_key())
    keys = EpochKeys(agent, CHECKPOINT_GETKEY_PATH, "cvm-tune-checkpoint-key", derive_key)
    if keys.current_epochs is None and not any((out / "runs").glob("*/checkpoints/key-epochs.json")):
        return keys  # nothing recorded and nothing to record: no rotation to follow
    ram = scratch_dir(cfg, out)
    tmp = Path(tempfile.mkdtemp(prefix=ram.name + "-rekey-", dir=ram.parent))
    try:
        done = rekey_checkpoints(out / "runs", keys, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if done:
        progress(f"key rotation: re-sealed {len(done)} checkpoint(s) under the current key epochs "
                 f"({keys.current_epochs})")
    return keys


def _released_version(source: KeySource, located: Located | None) -> tuple[Located, bytes] | None:
    """The newest older version that the owner's earlier key release opens (``None``: there is none)."""
    if located is None or not isinstance(source, ReleasedKeySource):
        return None
    for version, path in located.older:
        if (key := source.released_key_for(path)) is not None:
            return Located(path, version), key
    return None


def dataset_stage(cfg: Config, out: Path, keys: Keys, progress: Progress) -> Dataset:
    """Owner signature first (when pinned), then decrypt in memory, authenticate ALL of it, validate rows, drop
    duplicates, hold out the owner's eval rows; refuse a rolled-back version (the record is rebuilt from the audit
    chain if it was deleted)."""
    dcfg = cfg.dataset
    owner_pub = bytes.fromhex(dcfg.owner_public_key) if dcfg.owner_public_key else None
    path = keys.located.path if keys.located else dataset_file(cfg, out, keys.dataset, progress)
    with open_dataset(path) as fh:
        stream = open_encrypted(fh, keys.dataset, owner_public_key=owner_pub, content_type=DATASET_CONTENT_TYPES)
        if stream.header.content_type in tabular.CONTENT_TYPES:  # Parquet / Arrow: read from memory, same row rules
            rows, rep = tabular.parse_table(stream, stream.header.content_type, source=path.name, dedup=dcfg.dedup,
                                            max_plaintext_bytes=dcfg.max_plaintext_bytes)
        else:
            rows, rep = parse_jsonl(stream, source=path.name, max_row_bytes=dcfg.max_row_bytes, dedup=dcfg.dedup,
                                    max_plaintext_bytes=dcfg.max_plaintext_bytes)
    sig, header = stream.signature, stream.header
    plain_format = tabular.format_name(header.content_type)
    check_objective(rows, rep.lines, cfg.training.objective, source=path.name,
                    unit="line" if plain_format == "jsonl" else "row")
    rows_digest = rows_sha256(rows)
    if dcfg.dataset_id is not None and header.dataset_id != dcfg.dataset_id:
        raise DataError(f"dataset {path.name} is {header.dataset_id!r}, not dataset.dataset_id {dcfg.dataset_id!r}",
                        fix="point dataset.path at that dataset's versions, or correct dataset.dataset_id")
    rows, lines, eval_rows = split_eval_rows(rows, rep.lines)
    if cfg.evaluation.gate != "off" and len(eval_rows) < cfg.evaluation.min_rows:
        raise DataError(f"dataset {path.name} has {len(eval_rows)} eval row(s) (\"split\": \"eval\"); the promotion "
                        f"gate needs at least {cfg.evaluation.min_rows}",
                        fix="ask the owner to include eval rows in the signed dataset, or set evaluation.gate: off")
    if not rows:
        raise EmptyDatasetError(f"dataset {path.name} has only eval rows: nothing to train on")
    rep = dataclasses.replace(rep, lines=lines)
    info = {
        "dataset_id": header.dataset_id, "dataset_version": header.dataset_version,
        "format": f"cvm-tune encrypted dataset v{header.format_version}",
        "encrypted_sha256": stream.ciphertext_sha256, "encrypted_size": stream.ciphertext_size,
        "plaintext_sha256": stream.plaintext_sha256, "plaintext_size": stream.plaintext_size,
        "plaintext_format": plain_format, "rows_sha256": rows_digest, "rows": rep.rows_kept, "key_source": keys.source.describe(),
        "owner_public_key": sig.owner_public_key.hex() if sig else None,
        "owner_key_id": sig.owner_key_id if sig else None, "commitment": sig.commitment if sig else None,
        "validation": {"rows_read": rep.rows_total, "duplicates_dropped": rep.duplicates_dropped,
                       **({"eval_rows": len(eval_rows)} if eval_rows else {})},
    }
    if rebuilt := rebuild_if_missing(out / "state", AuditLog(out / "state" / "audit.jsonl").entries):
        progress(f"state: dataset-versions.json was missing; rebuilt {rebuilt} dataset version(s) from the audit chain")
    check_version(out / "state", info["dataset_id"], info["dataset_version"], info["plaintext_sha256"])
    signer = f", signed by owner key {sig.owner_key_id[:16]}…" if sig else ", not owner-signed"
    progress(f"dataset: {path.name} v{info['dataset_version']} ({plain_format}) decrypted in memory and authenticated "
             f"({stream.chunks} chunks{signer}), {row_summary(rep.rows_kept, rep.by_kind)}, "
             f"{rep.duplicates_dropped} duplicates dropped{_lines(rep.duplicate_lines)}")
    return Dataset(path, rows, rep, stream.chunks, info, eval_rows, keys.note, recipients=header.recipients)


def base_model_stage(cfg: Config, out: Path, progress: Progress) -> BaseModel:
    """Built (tiny demo model) or found locally, hashed file by file, checked against the pinned tree hash."""
    from app.training import build_tiny_model

    base_dir, name = base_model(cfg, out, build_tiny_model)
    tree, files = tree_digest(base_dir)
    if cfg.base_model.sha256 and tree != cfg.base_model.sha256:
        raise BaseModelError(f"base model {base_dir} has tree sha256 {tree}, config pins {cfg.base_model.sha256}",
                             fix="restore the pinned base model files (never download them at run time)")
    progress(f"base model: {name} tree sha256 {tree[:16]}…")
    return BaseModel(base_dir, name, tree, files)


def token_stage(cfg: Config, ds: Dataset, base: BaseModel, progress: Progress) -> None:
    """Token budget: the too-long policy and rows without a trainable token, counted before training."""
    from app.training.tokens import tokenize_rows

    if cfg.training.objective == "dpo":  # TRL's DPOTrainer tokenizes the pairs itself: count and apply the policy
        from app.training.dpo import token_policy

        ds.rows, tokens = token_policy(ds.rows, base_model_dir=base.dir, max_length=cfg.training.max_length,
                                       too_long=cfg.dataset.too_long, lines=ds.rows_report.lines)
    else:
        ds.rows, ds.tokens, tokens = tokenize_rows(ds.rows, base_model_dir=base.dir, max_length=cfg.training.max_length,
                                                   assistant_only_loss=cfg.training.assistant_only_loss,
                                                   too_long=cfg.dataset.too_long, lines=ds.rows_report.lines)
    ds.info["rows"] = tokens.rows_out
    ds.info["validation"].update(tokens.counts())
    progress(f"tokens: {tokens.rows_out} rows, {tokens.trainable_tokens} trainable tokens; {tokens.too_long} longer "
             f"than {tokens.max_length} tokens ({cfg.dataset.too_long}{_lines(tokens.too_long_lines)}), "
             f"{tokens.dropped_no_trainable} without trainable tokens dropped{_lines(tokens.no_trainable_lines)}")


ROW_KINDS = {"messages": "chat", "text": "text", "preference": "preference"}  # the progress line's names for them


def row_summary(rows: int, by_kind: dict[str, int]) -> str:
    """``171 rows (111 chat, 60 text)``, or ``12 preference rows`` when all are of one kind (counts only)."""
    kinds = {ROW_KINDS.get(k, k): n for k, n in by_kind.items() if n}
    if len(kinds) == 1 and sum(kinds.values()) == rows:
        return f"{rows} {next(iter(kinds))} row{'s' if rows != 1 else ''}"
    return f"{rows} row{'s' if rows != 1 else ''}" + (f" ({', '.join(f'{n} {k}' for k, n in kinds.items())})" if kinds else "")


def _lines(numbers: tuple[int, ...], most: int = 10) -> str:
    """`` (lines 3, 9, …)`` for a progress line: positions, never content."""
    if not numbers:
        return ""
    more = ", …" if len(numbers) > most else ""
    return f" (line{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers[:most]))}{more})"
