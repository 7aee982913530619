"""Bundle steps for confidential outputs (``confidentiality`` in the manifest; docs/verifier-spec.md §14).

 C1 ``confidential.outputs``   (anyone) every weight file is age v1 ciphertext named ``<name>.age`` with one X25519
                               stanza per listed recipient; none is left in plaintext; the CVM's key and every
                               recipient the dataset's owner named are listed; with the dataset file, its signed
                               header names exactly those
 C2 ``confidential.plaintext`` (a recipient: ``--identity``) each ``<name>.age`` decrypts in memory to the bytes whose
                               SHA-256 the manifest binds to ``<name>``
 B16 ``model.signature``       over the plaintext: each ``model.sig`` passes ``model_signing``'s own key-based
                               verification under the manifest's key over exactly the directory's files, weight
                               files counted under their plaintext name by their (C2-checked) plaintext hash
                               (:func:`attestation.bundle.model_sig.verify_dir`; no plaintext is written)

Bundles without ``confidentiality`` go to :func:`attestation.bundle.model_sig.check` unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation.outputs import confidential as C
from attestation.bundle import model_sig
from attestation.io.hashing import read_regular, sha256_hex
from attestation.io.safe_yaml import parse_json
from attestation.verdict import QuoteFindings

OUTPUTS = "confidential.outputs"
PLAINTEXT = "confidential.plaintext"


def check(f: QuoteFindings, root: Path, m: B.Manifest, identities: list[Any] | None,
          dataset_file: Path | None = None) -> None:
    """Add C1, C2 and B16 for a bundle whose manifest parsed (B16 alone without ``confidentiality``)."""
    info = m.confidentiality
    owner, unreadable = None, None
    if dataset_file is not None:
        try:
            owner = dataset_recipients(dataset_file)
        except (OSError, ValueError) as exc:
            unreadable = f"{dataset_file}: the dataset file's clear header cannot be read: {str(exc)[:200]}"
    if info is None:
        if unreadable or owner:
            f.add(OUTPUTS, "fail", unreadable or
                  f"the dataset's owner named {len(owner or ())} recipient(s) but the weights are in plaintext")
        model_sig.check(f, root, m)
        return
    f.add(OUTPUTS, *(("fail", unreadable) if unreadable else _outputs(root, m, info, owner)))
    if not identities:
        f.add(PLAINTEXT, "skip", "the weights are encrypted: a recipient checks them with --identity KEY")
        f.add(model_sig.CHECK, "skip", "the signature covers the plaintext: a recipient checks it with --identity KEY")
        return
    plain, problems = {}, []
    for rel, digest in sorted(info.plaintext_sha256.items()):
        age = C.ciphertext_name(rel)
        data = C.decrypt(_read(root / age), identities)
        if data is None:
            problems.append(f"{age}: does not decrypt with the identity given (not a recipient, or damaged)")
        elif sha256_hex(data) != digest:
            problems.append(f"{age}: decrypts to bytes of SHA-256 {sha256_hex(data)[:16]}…, not the manifest's "
                            f"plaintext hash of {rel}")
        else:
            plain[rel] = digest
        del data
    f.add(PLAINTEXT, "fail" if problems else "pass", "; ".join(problems[:3]) or
          f"{len(plain)} weight file(s) decrypted in memory match their plaintext hashes")
    if problems:
        f.add(model_sig.CHECK, "fail", "not checked: a weight file did not decrypt to its bound plaintext")
        return
    model_sig.check(f, root, m, plain)  # the plaintext bundle's check, encrypted files counted by plaintext hash


def trained_hash(m: B.Manifest, rel: str) -> str:
    """What the ``train.done`` audit entry records for adapter file ``rel``: its plaintext hash when encrypted."""
    return (m.confidentiality.plaintext_sha256.get(rel) if m.confidentiality else None) or m.files[rel]


def _outputs(root: Path, m: B.Manifest, info: C.ConfidentialityInfo, owner: tuple[str, ...] | None) -> tuple[str, str]:
    problems = C.naming_problems(m.files, True)  # the manifest's schema check rejects these first
    sealed = {plain for rel in m.files if (plain := C.plaintext_name(rel))}  # weight files listed as <name>.age
    if clear := sorted((sealed | {B.WEIGHTS}) - set(info.plaintext_sha256)):
        problems.append(f"weight file(s) not encrypted: {clear[:3]}")
    if odd := sorted(set(info.plaintext_sha256) - sealed):
        problems.append(f"plaintext hashes for files the manifest does not list: {[C.ciphertext_name(r) for r in odd[:3]]}")
    for age in sorted(C.ciphertext_name(rel) for rel in set(info.plaintext_sha256) & sealed):
        n = C.x25519_stanzas(_read(root / age, 1 << 16))
        if n is None:
            problems.append(f"{age} is not an age v1 file to X25519 recipients")
        elif n != len(info.recipients):
            problems.append(f"{age} has {n} X25519 stanzas, not one per listed recipient ({len(info.recipients)})")
    if missing := sorted(set(info.dataset_recipients) - set(info.recipients)):
        problems.append(f"dataset recipient(s) missing: {missing[:3]}")
    if owner is not None and tuple(owner) != info.dataset_recipients:
        problems.append("the dataset's signed header names other recipients than the manifest's dataset_recipients")
    if problems:
        return "fail", "; ".join(problems[:4])
    extra = len(info.recipients) - len(info.dataset_recipients) - 1
    who = (f"{len(info.recipients)} recipient(s): {len(info.dataset_recipients)} named by the dataset's owner, "
           f"{extra} added by the operator's configuration, the CVM's key")
    return "pass", f"{len(info.plaintext_sha256)} weight file(s) are age ciphertext to {who}"


def _read(path: Path, limit: int | None = None) -> bytes:
    try:
        return read_regular(path, limit or None)
    except OSError:
        return b""


def dataset_recipients(path: Path) -> tuple[str, ...]:
    """The recipients a dataset file's clear (owner-signed) header names (verifier-spec §14); () when it names none.

    Raises:
        OSError: the file cannot be read.
        ValueError: the clear header is malformed: not the magic and a format version 1 or 2, a header_len outside
            1 to 65 536 or past the end of the file, not a UTF-8 JSON object, ``metadata`` not an object, its
            ``cvm-tune.recipients`` not a string of age X25519 recipients.
    """
    with open(path, "rb") as fh:
        head = fh.read(12)
        if len(head) < 12 or head[:7] != b"CVMTDS\x00" or head[7] not in (1, 2):
            raise ValueError("not a cvm-tune dataset file (magic CVMTDS, 0x00, format version 1 or 2)")
        size = int.from_bytes(head[8:12], "big")
        if not 1 <= size <= 65536:
            raise ValueError(f"header_len {size} is outside 1 to 65536")
        raw = fh.read(size)
    if len(raw) != size:
        raise ValueError("the file ends inside its clear header")
    header = parse_json(raw, "dataset header", ValueError)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError("the header's metadata is not an object")
    value = metadata.get(C.DATASET_META_KEY, "")
    if not isinstance(value, str):
        raise ValueError(f"metadata {C.DATASET_META_KEY} is not a string")
    return C.parse_recipients(value)
