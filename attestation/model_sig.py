"""Bundle step ``model.signature``: the OpenSSF model signatures (``model-signing``) of the signed directories.

The manifest's ``signing`` names the public key (bound by the quote through report_data), the GetKey path it was
derived from (the run's own, :func:`run_key_path`: one key per run, so a directory copied from another run fails)
and the signed directories (``adapter``, and ``merged`` when exported). Each ``<dir>/model.sig`` must verify with
the library's key-based verifier under that key, over exactly the files in the directory (an added, removed or
changed file, git files included, or a signature made with any other key, fails). The same check as
``model_signing verify key <dir> --signature <dir>/model.sig --public_key KEY.pem --no-ignore-git-paths``.
``model_signing`` (the sigstore stack) is imported only when a bundle carries signatures, so ``import attestation``
stays light.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attestation.bundle as B
from attestation.verdict import QuoteFindings

CHECK = "model.signature"


def run_key_path(run_id: str) -> str:
    """The GetKey path of run ``run_id``'s model-signing key: ``cvm-tune/model-signing/v1/runs/<run_id>``."""
    return f"{B.SIGNING_GETKEY_PATH}/runs/{run_id}"


def check(f: QuoteFindings, root: Path, manifest: B.Manifest) -> None:
    """Add the ``model.signature`` check for ``root`` (a bundle whose manifest parsed)."""
    signing = manifest.signing
    if signing is None:
        f.add(CHECK, "skip", "the bundle predates model signatures (manifest has no signing)")
        return
    unsigned = sorted({p.split("/")[0] for p in manifest.files if p.startswith("merged/")} - set(signing.signed))
    problems = [f"{d}/ is exported but not signed" for d in unsigned]
    legacy = signing.key_path == B.SIGNING_GETKEY_PATH  # releases before per-run keys: one key per deployment
    if not legacy and signing.key_path != run_key_path(manifest.run_id):
        problems.append(f"signing.key_path {signing.key_path!r} is not this run's ({run_key_path(manifest.run_id)!r})")
    with tempfile.TemporaryDirectory(prefix="cvm-tune-verify-") as tmp:
        key = Path(tmp) / "model-signing.pub.pem"
        key.write_text(signing.public_key_pem)
        for d in signing.signed:
            why = verify_dir(root / d, key)
            if why:
                problems.append(f"{d}/{B.SIGNATURE_NAME}: {why}")
    scope = "the deployment's key (shared by its runs: made before per-run keys)" if legacy else "this run's key"
    detail = "; ".join(problems) or f"{', '.join(d + '/' for d in signing.signed)} signed by {scope} (P-256, in the manifest)"
    f.add(CHECK, "fail" if problems else "pass", detail)


def verify_dir(directory: Path, public_key_pem: Path) -> str | None:
    """None when ``directory/model.sig`` verifies under the key, else why not (one line)."""
    import model_signing

    signature = directory / B.SIGNATURE_NAME
    if not signature.is_file():
        return "missing"
    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public_key_pem).set_hashing_config(
            # one hashing thread: a model directory is a few files, thread start-up costs more than it saves
            model_signing.hashing.Config().use_file_serialization(max_workers=1).set_ignored_paths(
                paths=[B.SIGNATURE_NAME], ignore_git_paths=False)
        ).verify(directory, signature)
    except Exception as exc:  # the library raises ValueError, InvalidSignature, protobuf/JSON errors: all a reject
        return (str(exc).splitlines() or [type(exc).__name__])[0][:300] or type(exc).__name__
    return None
