"""Continual retraining on one output volume: the promoted adapter, warm start from it, lineage, the promotion
gate and skipping a night whose inputs did not change.

Two pointers under ``exports/`` (each one line, a run id, replaced atomically), written by the runs that continue the
lineage (``training.init`` previous; ``auto`` in the nightly service):

* ``PROMOTED``: the bundle users should take, and the one the next warm start continues from. It moves only to a
  bundle whose manifest records a passed promotion gate (or no gate);
* ``CANDIDATE``: the newest exported bundle, promoted or not.

A warm start reads the promoted bundle only after it passes its own verification again (the simulator: the test-CA
policy; a CVM: every integrity check of the default policy) and only if it was trained on the same base model with
the same LoRA shape. Its manifest hash and adapter hash become the new bundle's ``lineage`` and are committed in the
``run.start`` audit entry, so ``cvm-tune verify --parent`` / ``--chain`` can check every link offline.

``PROMOTED`` is a file anyone with the volume can edit, so it is not the record of what was promoted: every move is
also a ``promote`` audit entry (the bundle's manifest hash and dataset), measured into RTMR3 like the rest of the
chain. Before a warm start :func:`check_promoted` insists that the pointer names the bundle of the chain's last
``promote`` entry, with the same manifest, trained on the run's dataset id; a pointer that was deleted, moved back,
or names a bundle from another volume stops the run (:class:`~app.errors.PromotionStateError`, exit 7). The one
gap it tolerates is the pointer moved and the entry not yet written (a crash in between): a bundle exported on this
volume after the last promotion, continuing from it, whose gate passed; the caller records its entry then.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation.bundle.audit import AuditEntry
from attestation.io.hashing import sha256_file
from attestation.io.safe_yaml import parse_json

from app.config import Config
from app.errors import InputsUnchanged, PromotionStateError, StateError, TrainingError
from app.fsutil import atomic_write_bytes
from app.run.state import RUN_ID

PROMOTED = "PROMOTED"
CANDIDATE = "CANDIDATE"
PROMOTE = "promote"  # the audit entry that records each move of PROMOTED


@dataclass(frozen=True)
class Parent:
    """The promoted bundle a run continues from."""

    run_id: str
    bundle: Path
    manifest_sha256: str
    adapter_sha256: str
    manifest: dict[str, Any]
    plain_adapter: Path | None = None  # encrypted weights: their decrypted copy in RAM (app.run.confidential)

    @property
    def adapter_dir(self) -> Path:
        return self.plain_adapter or self.bundle / "adapter"

    def lineage(self) -> dict[str, str]:
        return {"parent_run_id": self.run_id, "parent_manifest_sha256": self.manifest_sha256,
                "parent_adapter_sha256": self.adapter_sha256}


def init_mode(cfg: Config, *, service: bool) -> str:
    """``base`` or ``previous`` (``auto``: previous for the nightly service, base for an ad-hoc run)."""
    mode = cfg.training.init
    return ("previous" if service else "base") if mode == "auto" else mode


def pointer(out: Path, name: str) -> Path | None:
    """The bundle a pointer names (``None``: no pointer yet).

    Raises:
        StateError: the pointer is unreadable, names no valid run id, or its bundle is gone.
    """
    path = out / "exports" / name
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise StateError(f"{path} is unreadable ({type(exc).__name__})",
                         fix=f"write the run id of the bundle to use into {path}, or remove it to start from the base model") from exc
    bundle = out / "exports" / text
    if not RUN_ID.fullmatch(text) or not (bundle / B.MANIFEST).is_file():
        raise StateError(f"{path} names {text[:100]!r}, which is not an exported bundle on this volume",
                         fix=f"write the run id of an existing bundle into {path}, or remove it to start from the base model")
    return bundle


def set_pointer(out: Path, name: str, run_id: str) -> None:
    try:
        atomic_write_bytes(out / "exports" / name, f"{run_id}\n".encode())
    except OSError as exc:
        raise StateError(f"cannot write exports/{name}: {exc.strerror}") from exc


def load_parent(bundle: Path) -> Parent:
    """The promoted bundle's identity (its manifest hash and adapter weights hash, recomputed from the files).

    Raises:
        TrainingError: the manifest or the adapter weights cannot be read (the bundle fails verification).
    """
    fix = "set training.init: base to train this run from the base model (the lineage then starts again)"
    try:
        raw = (bundle / B.MANIFEST).read_bytes()
        manifest: dict[str, Any] = parse_json(raw, f"{bundle.name}/manifest.json", ValueError)  # type: ignore[assignment]
        parsed = B.Manifest.model_validate(manifest)  # the fields read below exist and have their types
        adapter = sha256_file(bundle / B.weights_file(parsed))  # encrypted weights: the .age file's hash
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise TrainingError(f"the promoted bundle {bundle.name} fails verification (its manifest or adapter cannot be "
                            f"read: {str(exc).splitlines()[0][:200]})", fix=fix) from exc
    return Parent(run_id=manifest["run_id"], bundle=bundle, manifest_sha256=_sha256(raw), adapter_sha256=adapter,
                  manifest=manifest)


def promotions(entries: list[AuditEntry]) -> list[AuditEntry]:
    """The chain's ``promote`` entries, oldest first."""
    return [e for e in entries if e.type == PROMOTE]


def promotion_data(bundle: Path) -> dict[str, Any]:
    """The ``promote`` audit entry's data for an exported bundle that ``PROMOTED`` now names."""
    raw = (bundle / B.MANIFEST).read_bytes()
    m = json.loads(raw)
    return {"manifest_sha256": _sha256(raw), "dataset_id": m["dataset"]["dataset_id"],
            "dataset_version": m["dataset"]["dataset_version"],
            "parent_manifest_sha256": (m.get("lineage") or {}).get("parent_manifest_sha256")}


def check_promoted(bundle: Path | None, entries: list[AuditEntry], dataset_id: str) -> bool:
    """``PROMOTED`` (``bundle``, ``None`` when absent) must agree with the audit chain's last ``promote`` entry and
    name an adapter of ``dataset_id``. Returns True when the pointer is one promotion ahead of the chain (moved, then a
    crash before the entry): the caller records the entry once the bundle has passed its verification.

    Raises:
        PromotionStateError: the pointer was deleted, moved to another bundle, or names a bundle whose manifest is
            not the promoted one, that was not exported on this volume, or that was trained on another dataset.
    """
    done = promotions(entries)
    last = done[-1] if done else None
    said = f"the audit chain promoted run {last.run_id} last (seq {last.seq})" if last else "the audit chain records no promotion"
    if bundle is None:
        if last is not None:
            raise PromotionStateError(f"exports/{PROMOTED} is missing, but {said}: refusing to restart the lineage from "
                                      "the base model")
        return False
    raw = (bundle / B.MANIFEST).read_bytes()
    if last is not None and last.run_id == bundle.name and last.data.get("manifest_sha256") == _sha256(raw):
        pending = False
    else:
        why = _not_pending(bundle.name, raw, entries, last)
        if why is not None:
            raise PromotionStateError(f"exports/{PROMOTED} names {bundle.name}, but {said}: {why}")
        pending = True
    manifest = parse_json(raw, f"{bundle.name}/manifest.json", PromotionStateError)
    got = (manifest.get("dataset") or {}).get("dataset_id") if isinstance(manifest, dict) else None
    if got != dataset_id:
        raise PromotionStateError(f"the promoted adapter {bundle.name} was trained on dataset {str(got)[:80]!r}, not "
                                  f"{dataset_id!r}: cannot continue from it",
                                  fix="train another dataset on an output volume of its own (output.dir)")
    return pending


def _not_pending(run_id: str, raw: bytes, entries: list[AuditEntry], last: AuditEntry | None) -> str | None:
    """Why the bundle is not the next promotion after ``last`` (``None``: it is)."""
    try:
        m = B.Manifest.model_validate(parse_json(raw, "manifest.json", ValueError))
    except ValueError:
        return "its manifest is not a valid manifest"
    exported = next((e for e in entries if e.hash == m.audit.head), None)
    if exported is None or exported.type != "export" or exported.run_id != run_id or m.run_id != run_id:
        return "it is not a bundle exported on this output volume (its audit head is not in the chain)"
    if last is not None and exported.seq < last.seq:
        return "it was exported before that promotion (the pointer was moved back)"
    if last is not None and (m.lineage.parent_manifest_sha256 if m.lineage else None) != last.data.get("manifest_sha256"):
        return "it does not continue from the promoted adapter"
    if m.evaluation is not None and not m.evaluation.promote:
        return "its promotion was refused by the evaluation gate"
    return None


def check_parent(parent: Parent, cfg: Config, base_tree: str, verdict_failures: list[str]) -> None:
    """Refuse to warm-start from a bundle that fails verification or does not fit this run.

    Raises:
        TrainingError: the bundle fails its verification, or its base model / LoRA shape differ.
    """
    fix = "set training.init: base to train this run from the base model (the lineage then starts again)"
    if verdict_failures:
        raise TrainingError(f"the promoted bundle {parent.run_id} fails verification ({'; '.join(verdict_failures[:3])}): "
                            "refusing to warm-start from it", fix=fix)
    if parent.manifest["base_model"]["tree_sha256"] != base_tree:
        raise TrainingError(f"the promoted bundle {parent.run_id} was trained on another base model "
                            f"(tree {parent.manifest['base_model']['tree_sha256'][:16]}…): cannot continue from it", fix=fix)
    try:
        lora = json.loads((parent.bundle / B.CONFIG).read_bytes())["training"]["lora"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TrainingError(f"the promoted bundle {parent.run_id} has no readable LoRA settings", fix=fix) from exc
    want = cfg.training.lora.model_dump(mode="json")
    differ = sorted(k for k in ("r", "alpha", "target_modules") if lora.get(k) != want.get(k))
    if differ:
        raise TrainingError(f"the promoted bundle {parent.run_id} has another LoRA shape ({', '.join(differ)} differ)",
                            fix=fix)


def inputs_of(manifest: dict[str, Any], config_bytes: bytes) -> dict[str, Any]:
    """What decides whether a night has anything new: dataset content, base model, adapter settings, code."""
    return {"dataset_plaintext_sha256": manifest["dataset"]["plaintext_sha256"],
            "base_model_tree_sha256": manifest["base_model"]["tree_sha256"],
            "training_config_sha256": B.training_config_sha256(config_bytes),
            "code_source_sha256": manifest["code"]["source_sha256"]}


def check_unchanged(out: Path, current: dict[str, Any], parent: Parent | None) -> None:
    """Skip a night whose inputs equal the promoted run's, or the last candidate's from the same parent.

    Raises:
        InputsUnchanged: nothing new to train on (the reason names the bundle that already has these inputs).
    """
    if parent is not None and inputs_of(parent.manifest, (parent.bundle / B.CONFIG).read_bytes()) == current:
        raise InputsUnchanged(f"inputs unchanged since the promoted run {parent.run_id}")
    cand = pointer(out, CANDIDATE)
    if cand is None or parent is None or cand == parent.bundle:
        return
    try:
        manifest = parse_json((cand / B.MANIFEST).read_bytes(), f"{cand.name}/manifest.json", ValueError)
        same_parent = (manifest.get("lineage") or {}).get("parent_manifest_sha256") == parent.manifest_sha256  # type: ignore[union-attr]
        unchanged = same_parent and inputs_of(manifest, (cand / B.CONFIG).read_bytes()) == current  # type: ignore[arg-type]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"exports/{CANDIDATE} names {cand.name}, whose manifest or config cannot be read",
                         fix=f"restore that bundle from a backup, or remove exports/{CANDIDATE}") from exc
    if unchanged:
        raise InputsUnchanged(f"inputs unchanged since run {manifest['run_id']}, whose promotion was refused")  # type: ignore[index]


decide = B.promotion_rule  # the promotion rule, shared with the verifier (which recomputes it)


def dpo_gate(base_dir: Path, adapter_dir: Path, parent: Parent | None, eval_rows: list[Any], cfg: Config,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """The promotion gate of a DPO run: candidate and parent (the promoted adapter, or the base model) scored by the
    mean DPO loss against the base model on the owner's preference eval rows; the same rule as for SFT decides on
    the losses, and the preference accuracies are recorded with them."""
    from app.training.dpo import eval_scores

    ev = cfg.evaluation
    cand_loss, cand_acc = eval_scores(base_dir, adapter_dir, eval_rows, cfg.training)
    par_loss, par_acc = eval_scores(base_dir, parent.adapter_dir if parent else None, eval_rows, cfg.training)
    promote = decide(cand_loss, par_loss, ev.max_regression)
    against = f"run {parent.run_id}" if parent else "the base model"
    progress(f"evaluation: DPO loss {cand_loss:.4f} vs {par_loss:.4f}, preference accuracy {cand_acc:.2f} vs "
             f"{par_acc:.2f} ({against}) on {len(eval_rows)} eval pairs: "
             + ("promote" if promote else f"promotion refused (allowed regression {ev.max_regression:g})"))
    return {"metric": "dpo_loss", "rows": len(eval_rows), "candidate_loss": cand_loss, "parent_loss": par_loss,
            "candidate_accuracy": cand_acc, "parent_accuracy": par_acc, "parent": against,
            "max_regression": ev.max_regression, "promote": promote}


def record_outcome(out: Path, bundle: Path, *, lineage: bool) -> tuple[bool, str | None]:
    """The promotion decision of an exported bundle; with ``lineage`` (the run continues the promoted chain, i.e.
    ``training.init`` previous) also move ``CANDIDATE`` (always) and ``PROMOTED`` (gate passed or off). Idempotent.

    Returns:
        (promoted, reason): the reason says why a promotion was refused.
    """
    manifest = json.loads((bundle / B.MANIFEST).read_bytes())
    run_id, ev = manifest["run_id"], manifest.get("evaluation")
    promote = ev is None or bool(ev["promote"])
    if lineage:
        set_pointer(out, CANDIDATE, run_id)
        if promote:
            set_pointer(out, PROMOTED, run_id)
    if promote:
        return True, None
    metric = "eval DPO loss" if ev.get("metric") == "dpo_loss" else "eval loss"
    return False, (f"promotion refused: {metric} {ev['candidate_loss']:.4f} > {ev['parent_loss']:.4f} x "
                   f"(1 + {ev['max_regression']:g}) of {ev['parent']}")


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
