"""Confidential weights: the CVM's age key, the recipients of a run, and the encrypted model directories.

A run whose dataset header names age recipients (``cvm-tune dataset encrypt --recipient``), or whose configuration
adds some (``export.recipients``), writes every weight file of its bundle only as age v1 ciphertext to those
recipients plus the CVM's own key, named ``<name>.age`` (``attestation.outputs.confidential``: derivation, names,
manifest block, verifier steps); decrypting one gives back ``<name>``. The
plaintext model directories are built, signed and hashed in a RAM directory (the scratch's sibling) and encrypted
from there into the staged bundle, so no plaintext weight byte reaches the output volume. The CVM's identity is
derived from GetKey when needed and kept in memory only.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyrage
from attestation.outputs import confidential as C
from attestation.io.hashing import sha256_file, sha256_hex
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.errors import CiphertextRejected, KeySourceError, NotARecipientError
from app.export import ModelDirs

GETKEY_PURPOSE = "cvm-tune-outputs"


def cvm_identity(get_key: Callable[[str, str], bytes]) -> str:
    """The CVM's age identity (``AGE-SECRET-KEY-1…``): HKDF of GetKey(:data:`attestation.outputs.confidential.CVM_KEY_PATH`).

    Raises:
        KeySourceError: GetKey returned fewer than 32 bytes.
        TeeError: raised by ``get_key`` when the guest agent fails.
    """
    material = get_key(C.CVM_KEY_PATH, GETKEY_PURPOSE)
    if not isinstance(material, bytes | bytearray) or len(material) < 32:
        raise KeySourceError(f"GetKey({C.CVM_KEY_PATH}) returned no usable key material (need at least 32 bytes)")
    secret = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=C.CVM_KEY_INFO).derive(bytes(material))
    return C.identity_from_secret(secret)


def cvm_identities(agent: Any, recipient: str | None = None) -> list[str]:
    """The CVM's age identity, then, after a KMS key rotation, its identities under older key epochs (newest first;
    ``app.keys_epoch.older_epochs``): outputs encrypted to an earlier recipient of this CVM still open. With
    ``recipient`` (the public half named in a manifest) the search stops at the identity that matches it.
    Epochs the KMS refuses are skipped; an agent that reports no epochs gives the current identity alone.

    Raises:
        KeySourceError, TeeError: GetKey failed for the current epochs.
    """
    from app.keys_epoch import older_epochs
    from app.tee import GuestAgent

    if not isinstance(agent, GuestAgent):  # a stand-in agent (tests): no epochs
        return [cvm_identity(agent.get_key)]
    raw, current = agent.get_key_at(C.CVM_KEY_PATH, GETKEY_PURPOSE)
    found = [cvm_identity(lambda _p, _u: raw)]
    if current is None or C.recipient_of(found[0]) == recipient:
        return found
    from app.errors import TeeError

    for epochs in older_epochs(current):
        try:
            old, _ = agent.get_key_at(C.CVM_KEY_PATH, GETKEY_PURPOSE, epochs)
        except TeeError:  # not authorised for that epoch any more, or the agent ignores the selectors
            continue
        found.append(cvm_identity(lambda _p, _u, old=old: old))
        if C.recipient_of(found[-1]) == recipient:
            break
    return found


@dataclass(frozen=True)
class Plan:
    """Who can read tonight's weights, and where their plaintext may live (RAM)."""

    recipients: tuple[str, ...]  # sorted: the dataset's, the configuration's and the CVM's
    dataset_recipients: tuple[str, ...]
    cvm_recipient: str
    ram: Path  # a private directory on a RAM file system (app.run.confidential)
    identity: str = field(repr=False)  # the CVM's secret identity: memory only

    def identities(self) -> list[Any]:
        return [pyrage.x25519.Identity.from_str(self.identity)]

    def block(self, plaintext: dict[str, str]) -> dict[str, Any]:
        """The manifest's ``confidentiality``."""
        return {"scheme": C.SCHEME, "recipients": list(self.recipients), "dataset_recipients": list(self.dataset_recipients),
                "cvm_recipient": self.cvm_recipient, "cvm_key_path": C.CVM_KEY_PATH, "plaintext_sha256": plaintext}


def make_plan(get_key: Callable[[str, str], bytes], dataset_recipients: tuple[str, ...],
              config_recipients: tuple[str, ...], ram: Path) -> Plan | None:
    """A plan when the dataset or the configuration names recipients; None (plaintext bundle) otherwise."""
    if not dataset_recipients and not config_recipients:
        return None
    identity = cvm_identity(get_key)
    cvm = C.recipient_of(identity)
    return Plan(tuple(sorted({*dataset_recipients, *config_recipients, cvm})), tuple(dataset_recipients), cvm, ram, identity)


def encrypt_file(src: Path, dst: Path, recipients: tuple[str, ...]) -> str:
    """Stream ``src`` (plaintext, in RAM) as age ciphertext to ``dst``; returns the plaintext's SHA-256."""
    digest = sha256_file(src)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        pyrage.encrypt_io(fin, fout, [pyrage.x25519.Recipient.from_str(r) for r in recipients])
    return digest


def model_dirs(plan: Plan, stage: Path, adapter_dir: Path, finish: Callable[[Path], ModelDirs]) -> ModelDirs:
    """Build the model directories in RAM with ``finish`` (tokenizer, merged/, signatures over the plaintext), then
    write them into ``stage`` with every weight file encrypted as ``<name>.age`` (the manifest hashes it under that
    name, its plaintext hash under ``<name>``); the RAM copy is removed whatever happens."""
    plain = Path(tempfile.mkdtemp(prefix="export-", dir=plan.ram))
    try:
        (plain / "adapter").mkdir()
        for p in Path(adapter_dir).iterdir():
            shutil.copyfile(p, plain / "adapter" / p.name)
        dirs = finish(plain)
        plaintext = {}
        for d in dirs.signing["signed"]:
            (stage / d).mkdir()
            for p in sorted((plain / d).iterdir()):
                if C.is_weight_file(f"{d}/{p.name}"):
                    plaintext[f"{d}/{p.name}"] = encrypt_file(p, stage / d / C.ciphertext_name(p.name), plan.recipients)
                else:
                    shutil.copyfile(p, stage / d / p.name)
    finally:
        shutil.rmtree(plain, ignore_errors=True)
    stored = [C.stored_name(rel, True) for rel in dirs.files]  # merged shards as <name>.age
    files = {rel: sha256_file(stage / rel) for rel in stored}
    return ModelDirs(dirs.signing, files, plan.block(plaintext))


def decrypt_dir(src: Path, dst: Path, identities: list[Any], plaintext_sha256: dict[str, str], prefix: str) -> Path:
    """Copy model directory ``src`` of a bundle to ``dst`` (a new directory) with its weight files (``<name>.age``)
    decrypted in memory, checked against ``plaintext_sha256`` (keys ``<prefix>/<name>``) and written as ``<name>``;
    plain files are copied as they are.

    Raises:
        NotARecipientError: no identity opens a weight file whose ciphertext is intact.
        CiphertextRejected: a weight file decrypts to other bytes than the manifest binds, or one the manifest binds
            is not in ``src`` as ``<name>.age``.
    """
    dst.mkdir()
    names = {p.name for p in Path(src).iterdir()}
    if missing := sorted(r for r in plaintext_sha256 if r.startswith(prefix + "/") and
                         C.ciphertext_name(r.split("/", 1)[1]) not in names):
        raise CiphertextRejected(f"{C.ciphertext_name(missing[0])} is missing: the manifest binds the plaintext of "
                                 f"{missing[0]}, stored as age ciphertext under that name")
    for p in sorted(Path(src).iterdir()):
        rel = C.plaintext_name(f"{prefix}/{p.name}")
        if rel is None or rel not in plaintext_sha256:
            shutil.copyfile(p, dst / p.name)
            continue
        data = C.decrypt(p.read_bytes(), identities)
        if data is None:
            raise NotARecipientError(f"{prefix}/{p.name} does not decrypt with the identity given")
        if sha256_hex(data) != plaintext_sha256[rel]:
            raise CiphertextRejected(f"{prefix}/{p.name} decrypts to bytes other than the manifest's plaintext hash")
        (dst / rel.split("/", 1)[1]).write_bytes(data)
        del data
    return dst


def card_section(block: dict[str, Any] | None) -> bytes:
    """The model card's "Who can read the weights" section (empty for a plaintext bundle)."""
    if block is None:
        return b""
    owner = "".join(f"- `{r}` (named by the dataset's owner)\n" for r in block["dataset_recipients"])
    extra = "".join(f"- `{r}` (added by the configuration, `export.recipients`)\n" for r in block["recipients"]
                    if r not in block["dataset_recipients"] and r != block["cvm_recipient"])
    return (
        "\n## Who can read the weights\n\n"
        f"Every weight file ({', '.join(f'`{C.ciphertext_name(p)}`' for p in sorted(block['plaintext_sha256']))}) "
        "is age v1 ciphertext to these recipients only:\n\n" + owner + extra +
        f"- `{block['cvm_recipient']}` (this deployment's CVM, key derived from GetKey inside the TEE: warm start, "
        "evaluation and resume)\n\n"
        "A recipient decrypts one with `age -d -i key.txt -o NAME NAME.age` (the original file), or writes a "
        "loadable PEFT directory with "
        "`cvm-tune adapter decrypt BUNDLE --identity key.txt -o DIR`; `cvm-tune verify BUNDLE --identity key.txt` also "
        "checks the plaintext hashes and the model signature. The signature covers the plaintext: run the "
        "`model_signing verify key` command above on the directory `adapter decrypt` writes, not on the bundle's "
        "`adapter/`.\n").encode()
