"""A run's confidential weights: who may read them, and the RAM directory their plaintext lives in.

Before training, :func:`prepare` takes the recipients the dataset's owner signed into its header (as the dataset
stage authenticated it: ``Dataset.recipients``), adds ``export.recipients`` and the CVM's own key
(``app.export.confidential``), creates a private RAM directory next to the trainer's scratch and points the trainer's
final adapter there (``app.training.checkpoints.adapter_home``). A promoted parent whose weights are encrypted is
decrypted into that directory, checked against its manifest's plaintext hash, for the warm start and the evaluation
gate. The directory is removed when the run ends.
"""

from __future__ import annotations

import dataclasses
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.config import Config
from app.export.confidential import Plan, cvm_identities, decrypt_dir, make_plan
from app.fsutil import atomic_write_bytes
from app.training.checkpoints import ADAPTER_IN_RAM


def describe(plan: Plan | None) -> str:
    """The run's line on who can read its weights (the recipients are public keys: safe to print)."""
    if plan is None:
        return "weights: exported in the clear (no recipients: the dataset names none and export.recipients is empty)"
    others = [r for r in plan.recipients if r != plan.cvm_recipient and r not in plan.dataset_recipients]
    return (f"weights: exported only as age ciphertext to {len(plan.recipients)} recipient(s): "
            f"{len(plan.dataset_recipients)} named by the dataset's owner, {len(others)} by the operator (export.recipients, "
            f"or a secure round's aggregator) and "
            f"the CVM's own key ({plan.cvm_recipient[:16]}…); the recipients: {', '.join(plan.recipients)}")


def prepare(cfg: Config, agent: Any, ds: Any, run_dir: Path, scratch: Path, stack: ExitStack,
            parent: Any, federation: Any = None) -> tuple[Plan | None, Any]:
    """The run's plan (None: plaintext weights, as before) and the parent to warm-start from (decrypted in RAM
    when its weights are encrypted). ``federation`` (``app.federated.round_input.RoundInput``): a secure round adds
    the aggregator's recipient."""
    ram = scratch.with_name(scratch.name + "-plain")
    shutil.rmtree(ram, ignore_errors=True)  # a crash may have left one
    ram.mkdir(mode=0o700)
    stack.callback(shutil.rmtree, ram, True)
    extra = getattr(federation, "aggregator_recipient", None)  # secure aggregation: the attested aggregator's key
    plan = make_plan(agent.get_key, ds.recipients,
                     tuple(sorted({*cfg.export.recipients, *([extra] if extra else [])})), ram)
    marker = run_dir / ADAPTER_IN_RAM
    if plan is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, str(ram).encode(), mode=0o600)
    else:
        marker.unlink(missing_ok=True)
    block = parent.manifest.get("confidentiality") if parent is not None else None
    if block:
        # the parent may be encrypted to this CVM's recipient of before a KMS key rotation: its identity of then
        identities = [Plan((), (), "", ram, i).identities()[0] for i in cvm_identities(agent, block.get("cvm_recipient"))]
        plain = decrypt_dir(parent.bundle / "adapter", ram / "parent-adapter", identities, block["plaintext_sha256"],
                            "adapter")
        parent = dataclasses.replace(parent, plain_adapter=plain)
    return plan, parent
