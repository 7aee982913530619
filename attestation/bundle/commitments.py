"""What the audit slice's entries commit to must be what the manifest says (docs/verifier-spec.md section 4): the
inputs of every opening entry, the last ``train.done``/``export``/``privacy.spent``, and a training-API checkpoint's
``op_chain`` block."""

from __future__ import annotations

from typing import Any

from attestation.bundle import confidential as confidential_verify
from attestation.bundle import manifest as B
from attestation.bundle.audit import AuditEntry
from attestation.io.hashing import files_digest


def commitment_problems(entries: list[AuditEntry], m: B.Manifest, config_bytes: bytes | None) -> list[str]:
    """The entries must commit to the same hashes as the manifest (nothing taken on trust).

    The slice is one run: ``run.start``, then a segment per resume (``run.resume`` after a stop or a kill).
    The entry that opened the last segment commits to exactly the manifest's inputs. An earlier
    ``run.start``/``run.resume`` may name another ``config_sha256`` (a setting outside ``training`` and
    ``base_model`` changed between stop and resume) but must name the same dataset, base model, code and
    ``training_config_sha256`` (SHA-256 of the canonical JSON of the bundle config's ``base_model`` and
    ``training`` sections, recomputed here). ``train.done`` and ``export`` are checked on the last of each:
    an earlier one belongs to an attempt that was never published.
    """
    parent = m.lineage.parent_manifest_sha256 if m.lineage else None
    inputs = {
        "config_sha256": m.files[B.CONFIG],
        "dataset_encrypted_sha256": m.dataset.encrypted_sha256,
        "dataset_plaintext_sha256": m.dataset.plaintext_sha256,
        "base_model_tree_sha256": m.base_model.tree_sha256,
        "code_source_sha256": m.code.source_sha256,
    }
    training_sha = B.training_config_sha256(config_bytes) if config_bytes is not None else None
    last = {
        "train.done": {"global_step": m.training.global_step,  # encrypted weights: train.done names the plaintext
                       "adapter_sha256": {k: confidential_verify.trained_hash(m, k) for k in B.ADAPTER_FILES}},
        "export": {"artifacts_sha256": files_digest({k: m.files[k] for k in B.artifact_files(B.encrypted(m))})},
        "privacy.spent": m.privacy.model_dump(mode="json") if m.privacy is not None else {"mechanism": None},
    }
    problems = []
    if m.privacy is not None and not any(e.type == "privacy.spent" for e in entries):
        problems.append("the manifest records DP-SGD but the audit chain has no privacy.spent entry")
    opens = [e for e in entries if e.type == "run.start" or (e.type == "run.resume" and "config_sha256" in e.data)]
    for e in opens:
        want = dict(inputs)
        if e is not opens[-1]:
            want.pop("config_sha256")
        if "training_config_sha256" in e.data:
            want["training_config_sha256"] = training_sha
        elif e is not opens[-1]:  # an entry of an older cvm-tune: no config change can be allowed across it
            want["config_sha256"] = inputs["config_sha256"]
        for key, value in (("dataset_id", m.dataset.dataset_id), ("dataset_version", m.dataset.dataset_version)):
            if key in e.data:  # entries of older releases do not name the dataset version
                want[key] = value
        if "parent_manifest_sha256" in e.data or parent is not None:  # a lineage must be committed at the start
            want["parent_manifest_sha256"] = parent
        if any(e.data.get(k) != v for k, v in want.items()):
            problems.append(f"{e.type} entry (seq {e.seq}) commits to different hashes than the manifest")
        problems += _op_chain_problems(e, m)
    for kind, expected in last.items():
        final = [e for e in entries if e.type == kind]
        if final and any(final[-1].data.get(k) != v for k, v in expected.items()):
            problems.append(f"{kind} entry (seq {final[-1].seq}) commits to different hashes than the manifest")
    return problems


def _op_chain_problems(e: AuditEntry, m: B.Manifest) -> list[str]:
    """An opening entry's ``op_chain`` member is the manifest's block (members that are null left out of both); an
    entry of a bundle without one names none."""
    if m.op_chain is None:
        return [f"{e.type} entry (seq {e.seq}) names an op chain the manifest does not have"] if "op_chain" in e.data else []
    want = _present(m.op_chain.model_dump(mode="json", by_alias=True))
    if _present(e.data.get("op_chain")) != want:
        return [f"{e.type} entry (seq {e.seq}) commits to another op chain than the manifest's"]
    return []


def _present(block: Any) -> Any:
    return {k: v for k, v in block.items() if v is not None} if isinstance(block, dict) else block
