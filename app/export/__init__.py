"""Export helpers: code identity, library versions, the signed model directories and the manifest bytes.

The pipeline stages a bundle with these, binds ``manifest.json`` into the quote's report_data and
publishes the directory atomically (``app.fsutil.staged_dir``); the layout is documented in
``attestation.bundle.manifest``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation.bundle import model_sig
from attestation.io.hashing import files_digest, sha256_file

import app
from app.export import signing
from app.errors import ExportError

LIBRARIES = ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "dstack-sdk", "dcap-qvl", "cryptography")


def source_digest() -> str:
    """Tree hash of the running cvm-tune code (every .py file of ``app`` and ``attestation``)."""
    import attestation

    files: dict[str, str] = {}
    for pkg in (Path(app.__file__).parent, Path(attestation.__file__).parent):
        for path in sorted(pkg.rglob("*.py")):
            files[f"{pkg.name}/{path.relative_to(pkg).as_posix()}"] = sha256_file(path)
    return files_digest(files)


def library_versions(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Installed versions of the libraries that shape the result (plus what the backend reports)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    out.update(extra or {})
    return dict(sorted(out.items()))


def manifest_bytes(fields: dict[str, Any]) -> bytes:
    """Validate against the manifest schema and serialise (sorted keys, 2-space indent, newline).

    The verifier hashes these exact bytes, so they are produced once and never re-serialised.
    """
    manifest = B.Manifest.model_validate(fields)
    data = manifest.model_dump(mode="json", by_alias=True)
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class ModelDirs:
    """The signed model directories of a staged bundle (what the manifest records for them)."""

    signing: dict[str, Any]  # manifest ``signing``
    files: dict[str, str]  # manifest ``files`` entries for the tokenizer, merged and signature files
    confidentiality: dict[str, Any] | None = None  # manifest ``confidentiality`` (app.export.confidential)

    @property
    def public_key_pem(self) -> str:
        return self.signing["public_key_pem"]


def finish_model_dirs(stage: Path, *, run_id: str, base_dir: Path, get_key: Callable[[str, str], bytes],
                      merged: bool, max_shard_size: str) -> ModelDirs:
    """Complete ``stage/adapter`` (the base tokenizer), write ``stage/merged`` when asked, and sign each directory.

    The adapter files themselves are already there (the trainer's, committed by the ``train.done`` audit entry).

    Raises:
        ExportError: the tokenizer or the merged model could not be written, or signing failed.
        KeySourceError, TeeError: the signing key could not be derived.
    """
    from transformers import AutoTokenizer

    adapter = stage / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    tokenizer.save_pretrained(str(adapter))  # tokenizer*.json, special tokens, chat template: never adapter_*
    _check_names(adapter)
    signed = ["adapter"]
    if merged:
        _write_merged(stage / "merged", base_dir, adapter, tokenizer, max_shard_size)
        signed.append("merged")
    key_path = model_sig.run_key_path(run_id)
    key = signing.derive_key(get_key, key_path)
    for d in signed:
        signing.sign_dir(key, stage / d)
    files = {f"{d}/{p.name}": sha256_file(p) for d in signed for p in sorted((stage / d).iterdir())}
    files = {k: v for k, v in files.items() if k not in B.ADAPTER_FILES}
    return ModelDirs({"scheme": "model-signing/ec-key", "key_path": key_path,
                      "public_key_pem": signing.public_key_pem(key), "signed": signed}, files)


def _write_merged(out: Path, base_dir: Path, adapter: Path, tokenizer: Any, max_shard_size: str) -> None:
    """base + LoRA merged (``merge_and_unload``) on the CPU, in the base's dtype, as sharded safetensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto", local_files_only=True)
    model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    out.mkdir()
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(out))
    _check_names(out)


def _check_names(directory: Path) -> None:
    """Only plain files with names the manifest can list (one level: ``attestation.bundle.manifest.LISTED_FILE``)."""
    if odd := sorted(p.name for p in directory.iterdir() if not p.is_file() or not B.LISTED_NAME.fullmatch(p.name)):
        raise ExportError(f"{directory.name}/ holds entries a bundle cannot list: {odd}",
                          fix="report this (an unexpected transformers/peft version)")
