"""The data owner's commands: ``cvm-tune keys new | age`` and ``cvm-tune dataset encrypt | inspect | release``.

Registered by :mod:`app.cli` (which catches errors and maps exit codes); like it, this module
prints. Nothing here prints dataset content or key bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from app.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``keys`` and ``dataset`` to the top-level subparsers."""
    k = sub.add_parser("keys", help="data owner: create a signing key pair or an age identity",
                       description="Create the data owner's Ed25519 key pair (signs datasets and key grants), or an "
                       "age X25519 identity whose recipient may read confidential weights.")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kn = ksub.add_parser("new", help="write PREFIX.key (private, 0600) and PREFIX.pub (64 hex: pin it in the CVM config)")
    kn.add_argument("-o", "--out", type=Path, required=True, metavar="PREFIX", help="path prefix of the two files (never overwritten)")
    ka = ksub.add_parser("age", help="write an age identity file (0600) and print its recipient (age1…)",
                         description="Write a new age X25519 identity in the format age-keygen writes (comments, then "
                         "AGE-SECRET-KEY-1…), or print the recipient of an existing one. The recipient goes to "
                         "`dataset encrypt --recipient` or export.recipients; the file to `--identity`.")
    what = ka.add_mutually_exclusive_group(required=True)
    what.add_argument("-o", "--out", type=Path, metavar="FILE", help="identity file to create (0600, never overwritten)")
    what.add_argument("-y", "--recipient-of", type=Path, metavar="FILE", help="print the recipient of this identity "
                      "file (as age-keygen -y)")

    d = sub.add_parser("dataset", help="data owner: encrypt, inspect, release the key to an attested CVM",
                       description="The data owner's side: encrypt and sign a dataset (JSONL, Parquet or Arrow), inspect an encrypted "
                       "file, release its key to a CVM whose quote passes your policy.")
    dsub = d.add_subparsers(dest="dataset_command", required=True, metavar="ACTION")
    e = dsub.add_parser("encrypt", help="encrypt and sign a JSONL, Parquet or Arrow file (format version 2)",
                        description="Stream-encrypt IN (bounded memory) and sign it with the owner key. IN is JSONL, "
                        "or a table (.parquet; Arrow IPC .arrow/.feather/.ipc) whose rows are validated first.")
    e.add_argument("input", type=Path, metavar="IN", help="IN.jsonl, IN.parquet, IN.arrow or IN.feather")
    e.add_argument("-o", "--out", type=Path, required=True, metavar="OUT", help="encrypted file to create (replaced atomically)")
    e.add_argument("--owner-key", type=Path, required=True, metavar="KEY", help="owner private key (PREFIX.key)")
    e.add_argument("--key-file", type=Path, required=True, metavar="FILE",
                   help="dataset key file: used if it exists, else a fresh random key is written there (0600)")
    e.add_argument("--dataset-id", required=True, metavar="ID", help="dataset name (stored in the clear, signed)")
    e.add_argument("--dataset-version", type=int, required=True, metavar="N",
                   help="version (stored in the clear, signed); the CVM refuses versions older than the last it trained on")
    e.add_argument("--chunk-size", type=int, default=1 << 20, metavar="N", help="plaintext bytes per chunk (default 1 MiB)")
    e.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="clear-text header metadata (repeatable)")
    e.add_argument("--recipient", action="append", default=[], metavar="age1…",
                   help="age X25519 recipient (repeatable): every weight file trained on this dataset is exported only "
                   "as age ciphertext to these recipients and the CVM's own key (signed into the header)")

    i = dsub.add_parser("inspect", help="show an encrypted file's header, size and signer (no key, no plaintext)")
    i.add_argument("file", type=Path, metavar="FILE")
    i.add_argument("--owner-public-key", metavar="HEX|FILE", help="also check the signer is this owner key")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    r = dsub.add_parser("release", help="verify a CVM's key request and write a grant for it",
                        description="Verify the quote in a CVM's key request under your policy (compose_hashes "
                        "required) and, only if it passes, wrap the dataset key to the CVM and sign the grant. "
                        "Exit 0 released, 1 refused (failed checks listed), 2 input error.")
    r.add_argument("request", type=Path, metavar="REQUEST", help="the CVM's key-release/request.json")
    r.add_argument("--policy", type=Path, required=True, metavar="FILE", help="your verification policy (YAML)")
    r.add_argument("--dataset", type=Path, required=True, metavar="FILE", help="the encrypted dataset the key is for")
    r.add_argument("--key-file", type=Path, required=True, metavar="FILE", help="its dataset key file")
    r.add_argument("--owner-key", type=Path, required=True, metavar="KEY", help="owner private key (signs the grant)")
    r.add_argument("-o", "--out", type=Path, required=True, metavar="GRANT", help="grant file to write")
    r.add_argument("--now", type=int, metavar="UNIX_SECONDS", help="verification time (default: now)")
    r.add_argument("--collateral", type=Path, metavar="FILE", help="fresh collateral instead of the request's")


def _keys(args: argparse.Namespace) -> int:
    from app.dataset.owner import new_age_identity, new_owner_key, owner_key_id

    if args.keys_command == "age":
        if args.recipient_of is not None:
            from attestation.outputs.confidential import load_identities

            for identity in load_identities(args.recipient_of):
                print(identity.to_public())
            return 0
        recipient = new_age_identity(args.out)
        print(f"age identity: {args.out} (private, 0600: whoever holds it reads the weights encrypted to it)")
        print(f"recipient: {recipient}")
        return 0

    key_path, pub_path, pub = new_owner_key(args.out)
    print(f"owner key: {key_path} (private, 0600: keep it offline)")
    print(f"public key: {pub_path}")
    print(f"pin the public key in the CVM config: dataset: {{owner_public_key: {pub.hex()}}}")
    print(f"its owner key id (a name that manifests show, not a key to pin): {owner_key_id(pub)}")
    return 0


def _dataset(args: argparse.Namespace) -> int:
    return {"encrypt": _encrypt, "inspect": _inspect, "release": _release}[args.dataset_command](args)


def _dataset_key(path: Path) -> tuple[bytes, bool]:
    from app.dataset import KeyFileSource, write_key_file

    if path.exists() or path.is_symlink():
        return KeyFileSource(path).dataset_key(), False
    key = os.urandom(32)
    write_key_file(path, key)
    return key, True


def _encrypt(args: argparse.Namespace) -> int:
    from app.dataset import encrypt_file
    from app.dataset.owner import load_owner_key

    meta = {}
    for item in args.meta:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--meta {item!r} is not KEY=VALUE", fix="pass metadata as --meta KEY=VALUE (repeatable)")
        meta[name] = value
    if args.recipient:
        from attestation.outputs.confidential import DATASET_META_KEY, parse_recipients

        try:
            meta[DATASET_META_KEY] = " ".join(parse_recipients(args.recipient))
        except ValueError as exc:
            raise ConfigError(f"--recipient: {exc}",
                              fix="pass a recipient printed by `cvm-tune keys age` (age1…)") from None
    owner = load_owner_key(args.owner_key)
    if not args.input.is_file():
        raise ConfigError(f"{args.input} is not a file", fix="pass the plaintext JSONL, Parquet or Arrow file")
    from app.dataset.tabular import check_file

    content_type, checked = check_file(args.input)  # every row validated, by the CVM's rules, before anything is written
    key, created = _dataset_key(args.key_file)
    res = encrypt_file(args.input, args.out, key, dataset_id=args.dataset_id, dataset_version=args.dataset_version,
                       chunk_size=args.chunk_size, metadata=meta or None, owner_key=owner, content_type=content_type)
    if checked is not None:
        print(checked)
    if created:
        print(f"new dataset key: {args.key_file} (0600; needed to release the key to a CVM)")
    print(f"encrypted: {args.out} ({res.ciphertext_size} bytes, {res.chunks} chunks, format version {res.header.format_version})")
    print(f"dataset {args.dataset_id!r} v{args.dataset_version}; ciphertext sha256 {res.ciphertext_sha256}")
    if res.signature is not None:
        print(f"signed by owner key {res.signature.owner_key_id}; commitment {res.signature.commitment}")
    if res.header.recipients:
        print(f"weights trained on it are exported only as age ciphertext to {len(res.header.recipients)} recipient(s) "
              "and the CVM's own key")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from app.dataset import read_header, tabular
    from app.dataset.owner import load_public_key, signer_mismatch
    from app.errors import DatasetSignatureError, DataError
    from app.fsutil import open_regular
    from attestation.bundle.dataset_sig import TrailerError, read_signed_file

    try:
        with open_regular(args.file) as fh:
            header = read_header(fh)
        size = args.file.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read {args.file}: {exc.strerror}", fix="check the path") from exc
    info: dict = {"file": str(args.file), "size": size, "format_version": header.format_version,
                  "dataset_id": header.dataset_id, "dataset_version": header.dataset_version,
                  "chunk_size": header.chunk_size, "content_type": header.content_type,
                  "plaintext_format": tabular.format_name(header.content_type), "metadata": header.metadata,
                  "signed": header.format_version == 2}
    if header.format_version == 2:
        try:
            signed = read_signed_file(args.file)
        except TrailerError as exc:
            raise DatasetSignatureError(f"{args.file.name}: {exc}") from None
        sig = signed.signature
        info.update({"owner_public_key": sig.owner_public_key.hex(), "owner_key_id": sig.owner_key_id,
                     "commitment": sig.commitment, "plaintext_size": sig.plaintext_size,
                     "plaintext_sha256": sig.plaintext_sha256, "file_sha256": signed.file_sha256,
                     "signature": "valid; the file's content is what the owner signed"})
        if args.owner_public_key is not None and sig.owner_public_key != load_public_key(args.owner_public_key):
            raise signer_mismatch(args.file.name, sig.owner_public_key, load_public_key(args.owner_public_key))
    elif args.owner_public_key is not None:
        from app.errors import UnsignedDatasetError

        raise UnsignedDatasetError(f"{args.file.name} is format version 1: it carries no owner signature")
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        for k, v in info.items():
            print(f"{k}: {v}")
    return 0


def _release(args: argparse.Namespace) -> int:
    from attestation import load_policy

    from app.dataset import KeyFileSource
    from app.dataset.owner import load_owner_key
    from app.dataset.release import release_key
    from app.fsutil import atomic_write_bytes

    try:
        request = args.request.read_bytes()
        collateral = args.collateral.read_bytes() if args.collateral else None
    except OSError as exc:
        raise ConfigError(f"cannot read {exc.filename}: {exc.strerror}", fix="check the path") from exc
    if args.out.exists():
        raise ConfigError(f"{args.out} exists: refusing to overwrite a grant", fix="choose another -o path")
    policy = load_policy(args.policy)
    now = args.now if args.now is not None else int(time.time())
    rel = release_key(request, policy=policy, now=now, dataset=args.dataset, dataset_key=KeyFileSource(args.key_file).dataset_key(),
                      owner_key=load_owner_key(args.owner_key), collateral=collateral)
    atomic_write_bytes(args.out, rel.grant)
    req = rel.request
    print(f"quote verified under policy '{policy.name}': compose-hash {req['compose_hash'][:16]}…, app-id {req['app_id']}"
          + (" — TEST CA (simulator): NOT evidence of a TEE" if policy.uses_test_root else ""))
    print(f"released the key of {req['dataset_id']!r} v{req['dataset_version']} to CVM key {req['public_key'][:16]}…")
    print(f"grant: {args.out} (place it where the CVM's dataset.key.grant_file points and run again)")
    return 0


COMMANDS = {"keys": _keys, "dataset": _dataset}
