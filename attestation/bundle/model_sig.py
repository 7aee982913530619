"""Bundle step ``model.signature``: the OpenSSF model signatures (``model-signing``) of the signed directories.

The manifest's ``signing`` names the public key (bound by the quote through report_data), the GetKey path it was
derived from (the run's own, :func:`run_key_path`: one key per run, so a directory copied from another run fails)
and the signed directories (``adapter``, and ``merged`` when exported). Each ``<dir>/model.sig`` must verify with
the library's key-based verifier under that key, over exactly the files in the directory (an added, removed or
changed file, git files included, or a signature made with any other key, fails). The same check as
``model_signing verify key <dir> --signature <dir>/model.sig --public_key KEY.pem --no-ignore-git-paths``.
Confidential bundles (:mod:`attestation.bundle.confidential`) go through the same verifier, with one difference:
the signature covers the plaintext, so each age-encrypted weight file (``<name>.age`` on disk) is counted as
``<name>``, by its plaintext SHA-256 (already checked by decrypting it in memory), in place of the hash of its bytes
on disk; no plaintext is written.
``model_signing`` (the sigstore stack) is imported only when a bundle carries signatures, so ``import attestation``
stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import attestation.bundle.manifest as B
from attestation.outputs.confidential import AGE_SUFFIX
from attestation.verdict import QuoteFindings

CHECK = "model.signature"
_STDOUT_LOCK = threading.Lock()


def run_key_path(run_id: str) -> str:
    """The GetKey path of run ``run_id``'s model-signing key: ``cvm-tune/model-signing/v1/runs/<run_id>``."""
    return f"{B.SIGNING_GETKEY_PATH}/runs/{run_id}"


def check(f: QuoteFindings, root: Path, manifest: B.Manifest, plaintext: Mapping[str, str] | None = None) -> None:
    """Add the ``model.signature`` check for ``root`` (a bundle whose manifest parsed).

    ``plaintext`` (a confidential bundle, its weight files decrypted and checked): bundle-relative plaintext name →
    plaintext SHA-256 of each encrypted file (stored as ``<name>.age``); such a bundle must carry signatures.
    """
    signing = manifest.signing
    if signing is None:
        if plaintext is not None:
            f.add(CHECK, "fail", "a confidential bundle must carry model signatures (manifest has no signing)")
        else:
            f.add(CHECK, "skip", "the bundle predates model signatures (manifest has no signing)")
        return
    unsigned = sorted({p.split("/")[0] for p in manifest.files if p.startswith("merged/")} - set(signing.signed))
    problems = [f"{d}/ is exported but not signed" for d in unsigned]
    legacy = signing.key_path == B.SIGNING_GETKEY_PATH  # releases before per-run keys: one key per deployment
    if not legacy and signing.key_path != run_key_path(manifest.run_id):
        problems.append(f"signing.key_path {signing.key_path!r} is not this run's ({run_key_path(manifest.run_id)!r})")
    problems += signed_dir_problems(root, signing, plaintext)
    scope = "the deployment's key (shared by its runs: made before per-run keys)" if legacy else "this run's key"
    over = " over the decrypted plaintext" if plaintext is not None else ""
    detail = "; ".join(problems) or f"{', '.join(d + '/' for d in signing.signed)} signed by {scope} (P-256, in the manifest){over}"
    f.add(CHECK, "fail" if problems else "pass", detail)


def signed_dir_problems(root: Path, signing: B.SigningInfo, plaintext: Mapping[str, str] | None = None) -> list[str]:
    """``<dir>/model.sig: why`` for each of ``signing.signed`` under ``root`` that does not verify under the
    manifest's key; ``plaintext`` (bundle-relative plaintext name → SHA-256 hex) counts those encrypted files
    (``<name>.age``) by plaintext."""
    with tempfile.TemporaryDirectory(prefix="cvm-tune-verify-") as tmp:
        key = Path(tmp) / "model-signing.pub.pem"  # the library reads the public key from a path
        key.write_text(signing.public_key_pem)
        return [f"{d}/{B.SIGNATURE_NAME}: {why}" for d in signing.signed if (why := verify_dir(
            root / d, key, {rel[len(d) + 1:]: h for rel, h in (plaintext or {}).items() if rel.startswith(d + "/")}))]


def verify_dir(directory: Path, public_key_pem: Path, plaintext: Mapping[str, str] | None = None) -> str | None:
    """None when ``directory/model.sig`` verifies under the key, else why not (one line).

    ``plaintext`` maps files of ``directory`` (relative plaintext names) that are encrypted on disk, as
    ``<name>.age``, to the SHA-256 (hex) of their plaintext, which the caller has checked: the signature is compared
    against those names and digests for them.
    """
    import model_signing

    signature = directory / B.SIGNATURE_NAME
    if not signature.is_file():
        return "missing"
    # The library print()s a warning for signatures without a key hint (its older format): stdout carries
    # `verify --json`, so the warning goes to stderr (the lock: sys.stdout is process-wide, restore in order).
    try:
        with _STDOUT_LOCK, contextlib.redirect_stdout(sys.stderr):
            hashing = _plaintext_hashing(dict(plaintext)) if plaintext else model_signing.hashing.Config()
            model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public_key_pem).set_hashing_config(
                # one hashing thread: a model directory is a few files, thread start-up costs more than it saves
                hashing.use_file_serialization(max_workers=1).set_ignored_paths(paths=[B.SIGNATURE_NAME],
                                                                                ignore_git_paths=False)
            ).verify(directory, signature)
    except Exception as exc:  # the library raises ValueError, InvalidSignature, protobuf/JSON errors: all a reject
        why = (str(exc).strip().splitlines() or [""])[0]
        return (why if isinstance(exc, ValueError) and why else f"{type(exc).__name__}: {why}".rstrip(": "))[:300]
    return None


def _plaintext_hashing(plaintext: dict[str, str]):  # -> model_signing.hashing.Config (imported lazily)
    """The library's hashing configuration, but the manifest it builds counts each ``<name>.age`` file whose
    ``<name>`` is in ``plaintext`` as ``<name>``, by its plaintext SHA-256 (the library's ``Manifest`` equality
    compares exactly these name → digest pairs). A file under the plaintext name itself counts by its own bytes."""
    from model_signing import hashing, manifest

    class PlaintextHashing(hashing.Config):
        def hash(self, model_path, *, files_to_hash=None):  # type: ignore[no-untyped-def]
            actual = super().hash(model_path, files_to_hash=files_to_hash)  # the bytes on disk: ciphertext for weights
            kind = manifest.SerializationType.from_args(actual.serialization_type)
            names = {str(rd.identifier) for rd in actual.resource_descriptors()}
            items = []
            for rd in actual.resource_descriptors():
                plain = str(rd.identifier).removesuffix(AGE_SUFFIX)
                if plain in plaintext and plain != rd.identifier and plain not in names:
                    items.append(kind.new_item(plain, dataclasses.replace(
                        rd.digest, algorithm="sha256", digest_value=bytes.fromhex(plaintext[plain]))))
                else:
                    items.append(kind.new_item(rd.identifier, rd.digest))
            return manifest.Manifest(actual.model_name, items, kind)

    return PlaintextHashing()
