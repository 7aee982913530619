"""``cvm-tune adapter decrypt`` and ``cvm-tune verify --identity``: reading weights exported as age ciphertext.

Registered by :mod:`app.cli` (which catches errors and maps exit codes); like it, this module prints. A bundle whose
manifest has ``confidentiality`` holds its weight files as age v1 ciphertext named ``<name>.age``
(docs/export-bundle.md); a recipient decrypts them in memory and writes a PEFT directory that loads, each weight file
under its original name (``adapter_model.safetensors.age`` -> ``adapter_model.safetensors``). ``adapter decrypt``
first runs the verifier exactly as ``verify --identity`` does; nothing is written unless the bundle verifies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from app.errors import CiphertextRejected, ConfigError, NotARecipientError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``adapter decrypt`` and the ``--identity`` option of ``verify`` (defined in :mod:`app.cli`)."""
    from app.cli import MAX_UNIX_SECONDS
    from app.cli.args import bounded_int

    sub.choices["verify"].add_argument(
        "--identity", type=Path, metavar="KEY", help="age identity file of a recipient (age-keygen): also decrypt the "
        "encrypted weights in memory and check their plaintext hashes and the model signature")
    a = sub.add_parser("adapter", help="read an exported adapter whose weights are encrypted to you",
                       description="Bundles trained on a dataset that names age recipients hold their weights as age "
                       "ciphertext (docs/export-bundle.md).")
    asub = a.add_subparsers(dest="adapter_command", required=True, metavar="ACTION")
    d = asub.add_parser("decrypt", help="write a loadable PEFT directory from an encrypted bundle",
                        description="Verify the bundle as `cvm-tune verify BUNDLE --identity KEY --policy FILE` "
                        "does (every check: quote, manifest, file hashes, the weights' plaintext hashes and the model "
                        "signature over the plaintext), then decrypt adapter/ (or merged/) with your age identity and "
                        "write DIR atomically, each NAME.age as NAME. Exit 0 written, 1 the bundle does not verify "
                        "with this identity under the policy (nothing written), 2 usage, 4 the identity is not a "
                        "recipient (the manifest's recipients listed).")
    d.add_argument("bundle", type=Path, metavar="BUNDLE", help="the exports/<run_id> directory")
    d.add_argument("--identity", type=Path, required=True, metavar="KEY", help="your age identity file (age-keygen)")
    d.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="directory to create (absent or empty)")
    d.add_argument("--dir", choices=("adapter", "merged"), default="adapter",
                   help="which model directory (default: adapter)")
    d.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy the bundle must verify under, as for "
                   "`cvm-tune verify` (default: built-in, Intel root, UpToDate only)")
    d.add_argument("--now", type=bounded_int(0, MAX_UNIX_SECONDS), metavar="UNIX_SECONDS",
                   help="verification time (default: now)")
    d.add_argument("--collateral", type=Path, metavar="FILE", help="use this collateral JSON instead of the bundle's")


def identities(path: Path | None) -> list | None:
    """The age identities of ``--identity`` (None without it).

    Raises:
        IdentityError: not a regular file (a FIFO would block the read, a device never end it), or unreadable.
    """
    from attestation.outputs.confidential import IdentityError, load_identities

    if path is None:
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise IdentityError(f"cannot read the identity file {path}: {type(exc).__name__}") from None
    if not stat.S_ISREG(mode):
        raise IdentityError(f"the identity file {path} is not a regular file (a FIFO, device or directory)")
    return load_identities(path)


def _decrypt(args: argparse.Namespace) -> int:
    """Verify the bundle exactly as ``cvm-tune verify BUNDLE --identity KEY`` does (the same function, options and
    verdict); only an accepted bundle is decrypted, into a private staging directory renamed to ``-o``."""
    from attestation import load_policy, read_collateral_file, verify_bundle
    from attestation.bundle import manifest as B
    from attestation.bundle.verify import file_problems

    from app.export.confidential import decrypt_dir

    out: Path = args.out
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ConfigError(f"{out} exists and is not an empty directory (or is a symlink)",
                          fix="pass a new or empty directory with -o")
    if not (args.bundle / B.MANIFEST).is_file():
        raise ConfigError(f"{args.bundle} has no {B.MANIFEST}: not an export bundle",
                          fix="pass the exports/<run_id> directory")
    try:
        raw = (args.bundle / B.MANIFEST).read_bytes()
        manifest = B.Manifest.model_validate_json(raw)
    except ValueError:
        raise CiphertextRejected(f"{args.bundle}/{B.MANIFEST} does not parse as a manifest") from None
    info, src = manifest.confidentiality, args.bundle / args.dir
    if info is None:
        raise ConfigError(f"the weights of {args.bundle.name} are not encrypted", fix=f"load {src} as it is")
    if not src.is_dir() or not any(rel.startswith(f"{args.dir}/") for rel in info.plaintext_sha256):
        raise ConfigError(f"{args.bundle.name} has no encrypted {args.dir}/", fix="pick --dir adapter")
    ids = identities(args.identity)
    mine = sorted({str(i.to_public()) for i in ids or []})
    if ids is not None and not set(mine) & set(info.recipients):  # no --policy makes this identity read the weights
        named = ", ".join(r + (" (the CVM's own)" if r == info.cvm_recipient else "") for r in info.recipients)
        raise NotARecipientError(f"the identity in {args.identity} ({', '.join(mine) or 'no identity'}) is not among "
                                 f"the recipients {args.bundle.name}'s manifest names: {named}")
    verdict = verify_bundle(args.bundle, policy=load_policy(args.policy), now=args.now or int(time.time()),
                            collateral=read_collateral_file(args.collateral) if args.collateral else None,
                            identities=ids)
    if not verdict.accepted or (args.bundle / B.MANIFEST).read_bytes() != raw:
        print(verdict.summary())
        for c in verdict.failed:
            print(f"FAIL {c.name}: {c.detail}")
        raise CiphertextRejected(f"{args.bundle} does not verify with this identity (the checks above): no "
                                 "plaintext written", fix="pass the --policy the bundle is to be trusted under (a "
                                 "bundle the cvm-tune simulator made: the simulator-test-policy.yaml its run wrote)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {type(exc).__name__}", fix="pass a directory you can write") from None
    try:
        staged = decrypt_dir(src, tmp / "d", ids or [], info.plaintext_sha256, args.dir)
        plain = {p.name: manifest.files.get(f"{args.dir}/{p.name}", "") for p in staged.iterdir()
                 if f"{args.dir}/{p.name}" not in info.plaintext_sha256}
        if bad := file_problems(staged, plain):  # what is written is what was verified (weights: decrypt_dir)
            raise CiphertextRejected(f"{args.dir}/ changed while it was decrypted: {'; '.join(bad[:3])}")
        os.chmod(staged, 0o755)
        if out.exists():
            out.rmdir()
        os.rename(staged, out)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {type(exc).__name__}", fix="pass a new or empty directory with -o") \
            from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len([r for r in info.plaintext_sha256 if r.startswith(args.dir + "/")])
    print(f"decrypted: {out} (the bundle verified with this identity; {n} weight file(s) written under their "
          "original names as the plaintext the manifest binds)")
    return 0


COMMANDS = {"adapter": lambda args: {"decrypt": _decrypt}[args.adapter_command](args)}
