"""``cvm-tune adapter decrypt`` and ``cvm-tune verify --identity``: reading weights exported as age ciphertext.

Registered by :mod:`app.cli` (which catches errors and maps exit codes); like it, this module prints. A bundle whose
manifest has ``confidentiality`` holds its weight files as age v1 ciphertext (docs/export-bundle.md); a recipient
decrypts them in memory, checks them against the manifest and writes a PEFT directory that loads. Nothing is written
unless every check passes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from app.errors import CiphertextRejected, ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``adapter decrypt`` and the ``--identity`` option of ``verify`` (defined in :mod:`app.cli`)."""
    sub.choices["verify"].add_argument(
        "--identity", type=Path, metavar="KEY", help="age identity file of a recipient (age-keygen): also decrypt the "
        "encrypted weights in memory and check their plaintext hashes and the model signature")
    a = sub.add_parser("adapter", help="read an exported adapter whose weights are encrypted to you",
                       description="Bundles trained on a dataset that names age recipients hold their weights as age "
                       "ciphertext (docs/export-bundle.md).")
    asub = a.add_subparsers(dest="adapter_command", required=True, metavar="ACTION")
    d = asub.add_parser("decrypt", help="write a loadable PEFT directory from an encrypted bundle",
                        description="Check every file of the bundle's adapter/ (or merged/) against manifest.json, "
                        "decrypt the weights in memory with your age identity, check their plaintext hashes and the "
                        "model signature, then write DIR atomically. Exit 0 written, 1 the ciphertext or plaintext is "
                        "not what the manifest binds, 2 usage, 4 the identity is not a recipient. Verify the bundle "
                        "itself first: cvm-tune verify BUNDLE --identity KEY.")
    d.add_argument("bundle", type=Path, metavar="BUNDLE", help="the exports/<run_id> directory")
    d.add_argument("--identity", type=Path, required=True, metavar="KEY", help="your age identity file (age-keygen)")
    d.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="directory to create (absent or empty)")
    d.add_argument("--dir", choices=("adapter", "merged"), default="adapter",
                   help="which model directory (default: adapter)")


def identities(path: Path | None) -> list | None:
    """The age identities of ``--identity`` (None without it)."""
    from attestation.outputs.confidential import load_identities

    return load_identities(path) if path is not None else None


def _decrypt(args: argparse.Namespace) -> int:
    from attestation.bundle import manifest as B
    from attestation.io.hashing import sha256_file
    from attestation.bundle.model_sig import verify_dir

    from app.export.confidential import decrypt_dir

    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory", fix="pass a new or empty directory with -o")
    if not (args.bundle / B.MANIFEST).is_file():
        raise ConfigError(f"{args.bundle} has no {B.MANIFEST}: not an export bundle",
                          fix="pass the exports/<run_id> directory")
    try:
        manifest = B.Manifest.model_validate_json((args.bundle / B.MANIFEST).read_bytes())
    except ValueError:
        raise CiphertextRejected(f"{args.bundle}/{B.MANIFEST} does not parse as a manifest") from None
    info, src = manifest.confidentiality, args.bundle / args.dir
    if info is None:
        raise ConfigError(f"the weights of {args.bundle.name} are not encrypted", fix=f"load {src} as it is")
    ids = identities(args.identity)
    for p in sorted(src.iterdir()) if src.is_dir() else ():
        rel = f"{args.dir}/{p.name}"
        if manifest.files.get(rel) != sha256_file(p):  # altered, truncated or added: before any decryption
            raise CiphertextRejected(f"{rel} is not the file the manifest binds (altered, truncated or added)")
    if not src.is_dir() or not any(rel.startswith(f"{args.dir}/") for rel in info.plaintext_sha256):
        raise ConfigError(f"{args.bundle.name} has no encrypted {args.dir}/", fix="pick --dir adapter")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        staged = decrypt_dir(src, tmp / "d", ids, info.plaintext_sha256, args.dir)
        if manifest.signing is not None:
            with tempfile.TemporaryDirectory() as keydir:
                key = Path(keydir) / "key.pem"
                key.write_text(manifest.signing.public_key_pem)
                if why := verify_dir(staged, key):
                    raise CiphertextRejected(f"{args.dir}/{B.SIGNATURE_NAME} does not verify over the plaintext: {why}")
        os.chmod(staged, 0o755)
        if out.exists():
            out.rmdir()
        os.rename(staged, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"decrypted: {out} ({len([r for r in info.plaintext_sha256 if r.startswith(args.dir + '/')])} weight "
          "file(s) checked against the manifest's plaintext hashes, model signature verified)")
    return 0


COMMANDS = {"adapter": lambda args: {"decrypt": _decrypt}[args.adapter_command](args)}
