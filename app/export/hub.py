"""``cvm-tune publish``: a verified export bundle as a Hugging Face Hub model repository (outside the CVM).

The repository is the PEFT adapter at its root (adapter_config.json, weights, tokenizer, ``model.sig``), the bundle's
model card as its README.md, ``merged/`` when exported, and every other bundle file under ``attestation/`` (manifest,
quote, event log, audit, collateral, config, app-compose, GPU evidence, run report). No file is changed: a relying
party re-assembles the bundle (``attestation/`` + README.md + merged/ + the root's other files as ``adapter/``) and
verifies it, or checks the root with ``model_signing verify key`` (ignoring ``attestation``, ``merged``, ``README.md``).
A confidential bundle's weight files stay age ciphertext named ``<name>.age`` (as in the bundle), so the Hub's loaders
never take them for weights. The bundle is verified first under the given policy; a rejected bundle is never
uploaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from attestation.bundle import manifest as B

from app.errors import ConfigError, ExportError

ATTESTATION_DIR = "attestation"


def check_repo_id(repo_id: str) -> str:
    """``OWNER/NAME`` as the Hub accepts it.

    Raises:
        ConfigError: not a valid Hub model repo id.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(f"--repo {repo_id!r} is not a Hub repo id: {exc}", fix="pass --repo OWNER/NAME") from None
    if repo_id.count("/") != 1:
        raise ConfigError(f"--repo {repo_id!r} has no owner", fix="pass --repo OWNER/NAME (your user or organisation)")
    return repo_id


def stage_repo(bundle: Path, dest: Path) -> Path:
    """Copy ``bundle`` into ``dest`` (new or empty) in the repository layout; returns ``dest``.

    Raises:
        ConfigError: ``dest`` exists and is not an empty directory.
    """
    bundle, dest = Path(bundle), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest} is not an empty directory", fix="pass a new directory to stage the repository in")
    dest.mkdir(parents=True, exist_ok=True)
    for src in sorted(bundle.rglob("*")):
        if not src.is_file():
            continue
        rel = src.relative_to(bundle)
        if rel.parts[0] == "adapter":
            target = dest / Path(*rel.parts[1:])
        elif rel.parts[0] == "merged" or rel.as_posix() == B.MODEL_CARD:
            target = dest / rel
        else:
            target = dest / ATTESTATION_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    return dest


def upload(folder: Path, repo_id: str, *, private: bool, message: str, endpoint: str | None = None) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` as one commit with ``huggingface_hub``; returns its URL.

    The token is huggingface_hub's usual one: ``HF_TOKEN`` or the one ``hf auth login`` stored. ``endpoint``: the
    Hub's URL (default: huggingface_hub's, ``HF_ENDPOINT`` or https://huggingface.co).

    Raises:
        ConfigError: no token is configured.
        ExportError: the Hub refused or could not be reached.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if get_token() is None:
        raise ConfigError("no Hugging Face token", fix="set HF_TOKEN or run `hf auth login` (a token with write access)")
    api = HfApi(endpoint=endpoint)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=folder,
                                 commit_message=message)
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
        raise ExportError(f"upload to {repo_id} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          fix="check the repo name, the token's write access and the network (HF_HUB_OFFLINE unset)") from exc
    return str(info.commit_url)
