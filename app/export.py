"""Export helpers: code identity, library versions, the model card and the manifest bytes.

The pipeline stages a bundle with these, binds ``manifest.json`` into the quote's report_data and
publishes the directory atomically (``app.fsutil.staged_dir``); the layout is documented in
``attestation.bundle``.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from attestation import bundle as B
from attestation.hashing import files_digest, sha256_file

import app

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


def model_card(*, run_id: str, base_model: str, base_tree: str, dataset: dict[str, Any], backend: str,
               steps: int, last_loss: float | None, simulated: bool) -> bytes:
    """README.md of the bundle: what this adapter is and how to check it. No dataset content."""
    warning = (
        "\n> **Simulated attestation.** This bundle was produced against the cvm-tune guest-agent simulator: its quote is\n"
        "> signed by a TEST CA and is **not** evidence of a TEE. The default verification policy rejects it.\n"
        if simulated
        else ""
    )
    loss = f"{last_loss:.4f}" if last_loss is not None else "n/a"
    owner = f"signed by owner key `{dataset['owner_key_id']}`" if dataset.get("owner_key_id") else "not owner-signed"
    return f"""# LoRA adapter `{run_id}`
{warning}
| | |
|---|---|
| base model | `{base_model}` (tree sha256 `{base_tree}`) |
| dataset | `{dataset['dataset_id']}` v{dataset['dataset_version']}, {dataset['rows']} rows, ciphertext sha256 `{dataset['encrypted_sha256']}`, {owner} |
| training | backend `{backend}`, {steps} optimizer steps, last logged loss {loss} |

Files: `adapter/` (PEFT LoRA: load with `PeftModel.from_pretrained(base, "adapter")`), `manifest.json` (provenance and
the sha256 of every file here), `quote.bin` / `quote.hex` (Intel TDX quote; report_data = SHA-512 of
`cvm-tune-manifest-v1:` + manifest.json), `event_log.json`, `audit.jsonl`, `collateral.json`.

Verify before use:

```
cvm-tune verify {run_id}        # from the exports/ directory; add --policy FILE for your own policy
```

proof.t16z.com can check `quote.hex`, but not the binding to manifest.json, the audit events or the file hashes.
""".encode()
