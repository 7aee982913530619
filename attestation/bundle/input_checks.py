"""Bundle checks of what went into a run, beyond the bytes of the bundle: the promotion decision
(``evaluation.decision``), the base model tree (``base_model.tree``), and, when the relying party has them, the
encrypted dataset file and its owner signature (``dataset.file``, ``dataset.owner``). Run by
:func:`attestation.bundle.verify.verify_bundle`.
"""

from __future__ import annotations

import json
from pathlib import Path

from attestation.bundle import manifest as B
from attestation.bundle.dataset_sig import TrailerError, owner_key_id, read_signed_file
from attestation.io.hashing import files_digest, sha256_file, tree_files
from attestation.verdict import QuoteFindings


def evaluation(f: QuoteFindings, m: B.Manifest, config_bytes: bytes | None) -> None:
    """The promotion decision is recomputed from the scores and the bundle config's allowed regression."""
    ev = m.evaluation
    if ev is None:
        return
    problems = []
    if ev.promote != B.promotion_rule(ev.candidate_loss, ev.parent_loss, ev.max_regression):
        problems.append(f"promote={ev.promote} contradicts the scores ({ev.candidate_loss:.4f} vs {ev.parent_loss:.4f} "
                        f"x (1 + {ev.max_regression:g}))")
    try:
        configured = json.loads(config_bytes or b"")["evaluation"]["max_regression"]
    except (ValueError, KeyError, TypeError):
        configured = None
    if configured != ev.max_regression:
        problems.append(f"max_regression {ev.max_regression:g} is not the bundle config's ({configured})")
    f.add("evaluation.decision", "fail" if problems else "pass", "; ".join(problems) or
          f"{'promoted' if ev.promote else 'not promoted'}: eval loss {ev.candidate_loss:.4f} vs {ev.parent_loss:.4f} "
          f"({ev.parent}) on {ev.rows} owner eval rows")


def inputs(f: QuoteFindings, m: B.Manifest, base_model_dir: Path | None, dataset_file: Path | None) -> None:
    problems = []
    if files_digest(m.base_model.files) != m.base_model.tree_sha256:
        problems.append("base_model.tree_sha256 does not match its file list")
    if base_model_dir is not None:
        try:
            if tree_files(base_model_dir) != m.base_model.files:
                problems.append(f"{base_model_dir} differs from the base model in the manifest")
        except (OSError, ValueError) as exc:
            problems.append(f"{base_model_dir} unreadable: {exc}")
    detail = "; ".join(problems) or ("tree hash recomputed" + (f"; {base_model_dir} matches" if base_model_dir else ""))
    f.add("base_model.tree", "fail" if problems else "pass", detail)
    if dataset_file is None:
        f.add("dataset.file", "skip", "no --dataset given: the encrypted dataset hash was not checked")
    else:
        try:
            ok = sha256_file(dataset_file) == m.dataset.encrypted_sha256
            f.add("dataset.file", "pass" if ok else "fail", "encrypted dataset matches" if ok else f"{dataset_file} is not the dataset trained on")
        except (OSError, ValueError) as exc:
            f.add("dataset.file", "fail", f"{dataset_file} unreadable: {exc}")
    dataset_owner(f, m.dataset, dataset_file)


def dataset_owner(f: QuoteFindings, d: B.DatasetInfo, dataset_file: Path | None) -> None:
    if d.owner_public_key is None:
        ok = d.owner_key_id is None and d.commitment is None
        f.add("dataset.owner", "skip" if ok else "fail",
              "the dataset was not owner-signed (format version 1)" if ok else "owner fields without an owner public key")
        return
    problems = []
    if d.owner_key_id != owner_key_id(bytes.fromhex(d.owner_public_key)) or d.commitment is None:
        problems.append("owner_key_id is not the SHA-256 of owner_public_key, or the commitment is missing")
    if dataset_file is not None:
        try:
            signed = read_signed_file(dataset_file)
        except (OSError, TrailerError) as exc:
            problems.append(f"{dataset_file}: {exc}")
        else:
            sig = signed.signature
            if sig.owner_public_key.hex() != d.owner_public_key or sig.commitment != d.commitment:
                problems.append(f"{dataset_file} is signed by another owner key or carries another commitment")
            if (sig.plaintext_sha256, sig.plaintext_size, signed.file_sha256) != (d.plaintext_sha256, d.plaintext_size, d.encrypted_sha256):
                problems.append(f"{dataset_file}: signed plaintext/ciphertext hashes differ from the manifest")
            if (signed.header.get("dataset_id"), signed.header.get("dataset_version")) != (d.dataset_id, d.dataset_version):
                problems.append(f"{dataset_file}: dataset id/version differ from the manifest")
    detail = "; ".join(problems) or (f"owner key {d.owner_key_id[:16]}…" + (
        f"; {dataset_file} signature, commitment and hashes match" if dataset_file is not None else
        " (pass --dataset to check the file's signature)"))
    f.add("dataset.owner", "fail" if problems else "pass", detail)
