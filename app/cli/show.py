"""``cvm-tune show BUNDLE``: what a bundle says it is, in a dozen lines: an export bundle (a nightly or ad-hoc run, a
training-API checkpoint) or a federated round bundle.

Read from the manifest alone, through the bounded JSON parser and the manifest model; nothing is verified, so every
line is the bundle's claim until ``cvm-tune verify`` accepts it. It ends with the exact verify command (with the
simulator's test policy when the manifest says the simulator made it) and how to open the browser verifier on it.
Runs without the training stack.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.cli.args import printable
from app.cli.verify import SIMULATOR_POLICY_FILE
from app.service.verify_page import browser_line
from attestation.bundle import manifest as B
from attestation.errors import BundleError
from attestation.io.safe_yaml import parse_json
from attestation.rounds import manifest as R

SHOW_SCHEMA = "cvm-tune/show/v1"
MAX_MANIFEST = 16 << 20  # as the lineage check reads a manifest
SIMULATOR_REV = "cvm-tune-simulator/"  # app.simulator.agent.REV_PREFIX (importing it needs the training stack)
# where a simulator run leaves its test policy, from the bundle up: exports/<run>/ -> OUT/ (2 levels); a round,
# aggregator/output/rounds/<federation>/round-N/ -> the simulation directory (5); a client bundle, clients/<name>/ in
# that round (7)
POLICY_SEARCH_LEVELS = 7
NOT_VERIFIED = "read from its manifest, NOT verified: `verify it` below checks it"


def _show(args: argparse.Namespace) -> int:
    summary = summarize(args.bundle)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "lines"}, indent=2))
        return 0
    print(printable(f"{args.bundle}  ({NOT_VERIFIED})"))
    for label, value in summary["lines"]:
        print(printable(f"  {label + ':':13} {value}"))
    print(printable(f"verify it: {summary['verify']}"))
    for note in summary["notes"]:
        print(f"  ({note})")
    if summary["kind"] != "round" and (line := browser_line(args.bundle, policy=summary["simulator"])):
        print(printable(line))  # the page does not verify federated rounds
    return 0


def summarize(bundle: Path) -> dict[str, Any]:
    """The summary of ``bundle``: its fields, ``lines`` (label, text) for the console and ``verify``.

    Raises:
        BundleError: not a directory, no manifest, or a manifest that does not read as one (exit 2).
    """
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a directory", fix="pass an exports/<run_id> or round-N bundle directory")
    if (bundle / R.ROUND_MANIFEST).is_file():
        return _round(bundle, _load(bundle / R.ROUND_MANIFEST, R.RoundManifest))
    return _run(bundle, _load(bundle / B.MANIFEST, B.Manifest))


def _load(path: Path, model: type[Any]) -> Any:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise BundleError(f"{path.parent} has no {path.name}: not a cvm-tune bundle",
                          fix="pass an exports/<run_id> or round-N bundle directory") from None
    except OSError as exc:
        raise BundleError(f"cannot read {path}: {exc.strerror}", fix="check the path and its permissions") from None
    doc = parse_json(raw, str(path), BundleError, max_bytes=MAX_MANIFEST)
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise BundleError(f"{path} is not a cvm-tune manifest ({where}: {first['msg']})",
                          fix=f"the bundle is damaged or not a cvm-tune bundle: `cvm-tune verify {path.parent}` "
                          "names every failed check") from None


def _simulated(tee: B.TeeInfo) -> bool:
    return tee.mode == "embedded-simulator" or tee.agent_rev.startswith(SIMULATOR_REV)


def _tee_line(tee: B.TeeInfo) -> str:
    if _simulated(tee):
        return "the cvm-tune simulator (TEST CA: not a TEE, not evidence of one)"
    return f"dstack {tee.agent_version}, app id {tee.app_id}, compose-hash {tee.compose_hash[:16]}…"


def _verify_command(bundle: Path, simulated: bool, extra: list[str], notes: list[str]) -> str:
    """``cvm-tune verify BUNDLE`` with the simulator's test policy where the run left one (its output directory, or
    the simulation directory of a federated round); what else to know goes to ``notes``."""
    words = ["cvm-tune", "verify", str(bundle)]
    if simulated:
        near = [p / SIMULATOR_POLICY_FILE for p in bundle.resolve().parents[:POLICY_SEARCH_LEVELS]]
        policy = next((p for p in near if p.is_file()), None)
        if policy is None:  # none nearby: any copy of the simulator's test policy will do
            notes.append(f"write the simulator's test policy first: cvm-tune simulator -o {SIMULATOR_POLICY_FILE}")
        shown = SIMULATOR_POLICY_FILE if policy is None else policy if bundle.is_absolute() else os.path.relpath(policy)
        words += ["--policy", str(shown)]
        notes.append("made by the simulator: the default policy (Intel's root) rejects it by design")
    return shlex.join(words + extra)


def _run(bundle: Path, m: B.Manifest) -> dict[str, Any]:
    t, d = m.training, m.dataset
    if m.op_chain is not None:
        kind = "training-API checkpoint (cvm-tune api serve)"
    elif m.federation is not None:
        kind = f"federated client run (round {m.federation.round})"
    else:
        kind = "nightly run (service slot)" if m.run_id.startswith("nightly-") else "ad-hoc run (cvm-tune run)"
    objective = "DPO" + (f" (beta {t.dpo.beta:g}, loss {t.dpo.loss_type})" if t.dpo else "") if t.objective == "dpo" else "SFT"
    final = {"step": t.losses[-1][0], "loss": t.losses[-1][1]} if t.losses else None
    conf = m.confidentiality
    recipients = list(conf.recipients) if conf else []
    epsilon = m.privacy.epsilon if m.privacy else (m.op_chain.dp or {}).get("epsilon") if m.op_chain else None
    parent = m.lineage.parent_run_id if m.lineage else None
    extra = []
    if parent and (bundle.parent / parent).is_dir():
        extra += ["--parent", str(bundle.parent / parent)]
    lines = [("run id", m.run_id), ("kind", kind), ("created", m.created_at), ("TEE", _tee_line(m.tee)),
             ("base model", m.base_model.name + (f" ({m.base_model.hub_id})" if m.base_model.hub_id else ""))]
    if m.op_chain is not None:
        oc = m.op_chain
        lines.append(("op chain", f"{oc.ops} ops ({oc.optimizer_steps} optimizer steps), head {oc.head[:16]}…, "
                      f"saved as {oc.checkpoint}"))
    else:
        signer = f", signed by owner key {d.owner_key_id[:16]}…" if d.owner_key_id else ", not owner-signed"
        lines.append(("dataset", f"{d.dataset_id} version {d.dataset_version} ({d.rows} rows"
                      f"{', ' + d.plaintext_format if d.plaintext_format else ''}{signer})"))
    lines += [("objective", objective), ("steps", f"{t.global_step}" + (
        f" (resumed from step {t.resumed_from_step})" if t.resumed_from_step else "")),
        ("final loss", f"{final['loss']:.4f} at step {final['step']}" if final else "none recorded")]
    if m.evaluation is not None:
        ev = m.evaluation
        lines.append(("evaluation", f"{ev.metric} {ev.candidate_loss:.4f} against {ev.parent_loss:.4f} for "
                      f"{ev.parent}: {'promoted' if ev.promote else 'NOT promoted'}"))
    lines.append(("weights", f"age ciphertext to {len(recipients)} recipients: {', '.join(recipients)}" if recipients
                  else "plaintext (no recipients)"))
    lines.append(("privacy", f"DP-SGD, (ε, δ) = ({epsilon:.4g}, {m.privacy.delta:.3g})" if m.privacy else
                  f"DP-SGD, ε = {float(epsilon):.4g}" if epsilon is not None else "no differential privacy"))
    lines.append(("parent", f"continued from {parent}" if parent else "none: trained from the base model"))
    notes: list[str] = []
    if m.op_chain is not None:
        extra += ["--ops", "OPS.jsonl"]
        notes.append("OPS.jsonl: the client's record of the ops it sent, one JSON op a line")
    verify = _verify_command(bundle, _simulated(m.tee), extra, notes)
    if recipients:
        notes.append("a recipient adds --identity KEY to check the plaintext weights too")
    return {"schema": SHOW_SCHEMA, "bundle": str(bundle), "kind": "api" if m.op_chain else "run", "verified": False,
            "run_id": m.run_id, "description": kind, "created_at": m.created_at, "simulator": _simulated(m.tee),
            "base_model": m.base_model.name, "dataset_id": d.dataset_id, "dataset_version": d.dataset_version,
            "objective": t.objective, "steps": t.global_step, "final_loss": final, "recipients": recipients,
            "epsilon": epsilon, "op_chain_ops": m.op_chain.ops if m.op_chain else None, "parent_run_id": parent,
            "promoted": m.evaluation.promote if m.evaluation else None, "verify": verify, "notes": notes,
            "lines": lines}


def _client(bundle: Path, a: R.AdmittedClient) -> tuple[str, B.Manifest | None]:
    """One admitted client's line, with what its own bundle's manifest says (``clients/<name>/``) when it reads."""
    try:
        c = _load(bundle / R.CLIENTS_DIR / a.client / B.MANIFEST, B.Manifest)
    except BundleError as exc:
        return f"run {a.run_id}, weight {a.weight:.3g} (its bundle's manifest: {exc.message})", None
    t = c.training
    loss = f", final loss {t.losses[-1][1]:.4f}" if t.losses else ""
    eps = f", ε {a.privacy_epsilon:.4g}" if a.privacy_epsilon is not None else ""
    return (f"run {a.run_id}, dataset {c.dataset.dataset_id} version {c.dataset.dataset_version} ({c.dataset.rows} "
            f"rows), {t.global_step} steps{loss}, weight {a.weight:.3g}{eps}"), c


def _round(bundle: Path, m: R.RoundManifest) -> dict[str, Any]:
    clients = {a.client: _client(bundle, a) for a in m.admitted}
    read = [c for _, c in clients.values() if c is not None]
    recipients = list(m.confidentiality.recipients) if m.confidentiality else []
    previous = bundle.parent / f"round-{m.round - 1:04d}"
    extra = ["--parent", str(previous)] if m.previous_round_sha256 and previous.is_dir() else []
    strategy = m.strategy.name + "".join(f", {k} {v:g}" for k, v in sorted(m.strategy.params.items()))
    lines = [("federation", m.federation_id), ("kind", f"federated round {m.round} (aggregator)"),
             ("created", m.created_at), ("TEE", _tee_line(m.tee)), ("strategy", strategy),
             ("base model", ", ".join(sorted({c.base_model.name for c in read})) or "unknown (no client manifest reads)"),
             ("objective", ", ".join(sorted({c.training.objective.upper() for c in read})) or "unknown"),
             ("admitted", f"{len(m.admitted)} of at least {m.min_clients}")]
    lines += [(f"- {name}", line) for name, (line, _) in clients.items()]
    lines += [("rejected", f"{len(m.rejected)}" + "".join(f"; {r.client or '?'}: {r.reason}" for r in m.rejected)),
              ("global", f"adapter sha256 {m.global_adapter_sha256[:16]}…" + (
                  f", age ciphertext to {len(recipients)} recipients" if recipients else ", plaintext")),
              ("parent", f"round {m.round - 1} (manifest sha256 {m.previous_round_sha256[:16]}…)"
               if m.previous_round_sha256 else "none: the first round")]
    epsilons = [a.privacy_epsilon for a in m.admitted if a.privacy_epsilon is not None]
    notes: list[str] = []
    verify = _verify_command(bundle, _simulated(m.tee), extra, notes)
    return {"schema": SHOW_SCHEMA, "bundle": str(bundle), "kind": "round", "verified": False,
            "run_id": f"{m.federation_id}/round-{m.round:04d}", "description": f"federated round {m.round}",
            "created_at": m.created_at, "simulator": _simulated(m.tee), "federation_id": m.federation_id,
            "round": m.round, "clients": [a.client for a in m.admitted], "recipients": recipients,
            "base_model": sorted({c.base_model.name for c in read}), "objective": sorted({c.training.objective for c in read}),
            "epsilon": max(epsilons) if epsilons else None, "parent_round": m.round - 1 if m.previous_round_sha256 else None,
            "verify": verify, "notes": notes, "lines": lines}

