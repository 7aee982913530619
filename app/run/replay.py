"""``cvm-tune verify BUNDLE --replay [--dataset FILE --key-file KEY]``: a nightly run re-executed on this machine's
CPU from the bundle's own configuration, base model and dataset, and its weights compared with the bundle's (check
``training.replay``; docs/verifier-spec.md, "Replay").

The replay is the run itself (:func:`app.run.pipeline.run_once`) on a private temporary volume, against the embedded
simulator, with the bundle's ``config.json`` and only what cannot be the same changed: where it writes, where the
dataset and its key are (the party replaying holds them), no output recipients (they encrypt, they do not train) and
torch's CPU threads as the run recorded them. A run on the bundled sample needs no dataset: the sample ships with
cvm-tune. Bit for bit on a CPU with the same libraries and CPU kernels (the manifest's ``backend``); refused, with the
reason, for what cannot be replayed: DP-SGD (its noise is secret by design), a warm start, a federated round.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attestation import Verdict
from attestation.bundle import manifest as B
from attestation.bundle.confidential import trained_hash
from attestation.io.safe_yaml import parse_json
from attestation.verdict import Check

from app.errors import ConfigError

CHECK = "training.replay"
WEIGHTS = "adapter/adapter_model.safetensors"


class _Refused(Exception):
    """This bundle cannot be replayed (the reason is the check's)."""


def replay_run(verdict: Verdict, bundle: Path, *, dataset: Path | None, key_file: Path | None,
               base_model_dir: Path | None, progress: Callable[[str], None] = lambda _m: None) -> Verdict:
    """``verdict`` with ``training.replay`` added.

    Raises:
        ConfigError: the run's dataset is not the bundled sample and ``dataset``/``key_file`` were not both given.
        ModuleNotFoundError: the training stack is not installed (exit 2).
    """
    import torch  # noqa: F401  (first: without the training stack, say so before anything runs)

    try:
        m = B.Manifest.model_validate(parse_json((bundle / B.MANIFEST).read_bytes(), "manifest.json", ValueError))
        cfg_doc = parse_json((bundle / B.CONFIG).read_bytes(), "config.json", ValueError)
    except (OSError, ValueError) as exc:
        return _with(verdict, "fail", f"the bundle cannot be read: {str(exc).splitlines()[0]}")
    try:
        cfg = _config(m, cfg_doc, dataset, key_file, base_model_dir)
        detail = _run(m, cfg, progress)
    except _Refused as exc:
        return _with(verdict, "fail", str(exc))
    return _with(verdict, "pass", detail)


def _with(verdict: Verdict, status: str, detail: str) -> Verdict:
    return dataclasses.replace(verdict, checks=(*verdict.checks, Check(CHECK, status, detail)))  # type: ignore[arg-type]


def _config(m: B.Manifest, doc: Any, dataset: Path | None, key_file: Path | None, base_dir: Path | None) -> Any:
    from app.config import Config

    if m.op_chain is not None:
        raise _Refused("a training-API checkpoint: replay its ops with --ops OPS.jsonl --replay")
    if m.privacy is not None:
        raise _Refused("the run trained with DP-SGD: its noise came from the CVM's CSPRNG and is known to nobody, so "
                       "its weights cannot be replayed (privacy.dp checks its accounting)")
    if m.lineage is not None or getattr(m, "federation", None) is not None:
        raise _Refused("the run started from an earlier adapter (a warm start or a federated round): replaying it "
                       "from the base model cannot give its weights")
    try:
        cfg = Config.model_validate(doc)
    except ValueError as exc:
        raise _Refused(f"the bundle's config.json is not a configuration this cvm-tune reads: {str(exc).splitlines()[0]}")
    if cfg.dataset.source != "bundled-sample" and (dataset is None or key_file is None):
        raise ConfigError("replaying a run needs its dataset and key: pass --dataset FILE --key-file KEY",
                          fix="cvm-tune verify BUNDLE --replay --dataset DATASET.cvmds --key-file DATASET.key")
    if cfg.base_model.source != "tiny-llama" and base_dir is None:
        raise ConfigError("replaying a run on a local base model needs it: pass --base-model DIR",
                          fix="cvm-tune verify BUNDLE --replay --base-model DIR …")
    update: dict[str, Any] = {
        "tee": cfg.tee.model_copy(update={"mode": "embedded-simulator"}),
        "export": cfg.export.model_copy(update={"recipients": ()}),
        "training": cfg.training.model_copy(update={"cpu_threads": m.backend.cpu_threads or cfg.training.cpu_threads}),
    }
    if cfg.dataset.source != "bundled-sample":
        update["dataset"] = cfg.dataset.model_copy(update={
            "source": "encrypted-file", "path": Path(dataset).resolve(),  # type: ignore[arg-type]
            "key": cfg.dataset.key.model_copy(update={"source": "file", "file": Path(key_file).resolve()})})  # type: ignore[arg-type]
    if base_dir is not None:
        update["base_model"] = cfg.base_model.model_copy(update={"path": Path(base_dir).resolve()})
    return cfg.model_copy(update=update)


def _run(m: B.Manifest, cfg: Any, progress: Callable[[str], None]) -> str:
    from app.errors import CvmTuneError
    from app.run.pipeline import run_once

    expected = trained_hash(m, WEIGHTS)
    with tempfile.TemporaryDirectory(prefix="cvm-tune-replay-") as tmp:
        run_cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": Path(tmp) / "out",
                                                                                 "scratch_dir": None})})
        progress("replay: re-running the training on this machine (the embedded simulator stands in for the TEE)")
        try:
            result = run_once(run_cfg, progress=lambda line: progress(f"replay: {line}"))
        except CvmTuneError as exc:
            raise _Refused(f"the replayed run failed: {exc.message}") from None
        r = B.Manifest.model_validate(json.loads((result.bundle_dir / B.MANIFEST).read_bytes()))
    if r.dataset.plaintext_sha256 != m.dataset.plaintext_sha256:
        raise _Refused(f"the dataset given decrypts to plaintext {r.dataset.plaintext_sha256[:16]}…, the run's was "
                       f"{m.dataset.plaintext_sha256[:16]}…: not the dataset the bundle names")
    got = trained_hash(r, WEIGHTS)
    steps = f"{r.training.global_step} steps"
    if got != expected:
        raise _Refused(f"the run replayed from the base model and this dataset ({steps}) gives weights with sha256 "
                       f"{got[:16]}…, the bundle's are {expected[:16]}… (made with torch threads "
                       f"{m.backend.cpu_threads or 'unrecorded'} and {', '.join(f'{k} {v}' for k, v in sorted(m.backend.libraries.items()) if k in ('torch', 'transformers', 'peft', 'trl'))})")
    return (f"the run replayed from the base model and its dataset on this CPU ({steps}, {m.backend.cpu_threads or '?'} "
            f"torch threads): weights bit-identical, sha256 {got[:16]}…")
