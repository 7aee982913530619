"""``cvm-tune verify BUNDLE --ops OPS.jsonl --replay``: the client's record of a training-API model's ops re-executed
from the base model on this machine's CPU, by the server's own engine, and the result compared with the bundle's
weights (check ``op_chain.replay``; docs/verifier-spec.md, "Replay").

A bundle made on a CPU must replay **bit for bit**: the manifest's ``op_chain.determinism`` records what that needs
(device, torch threads), the library versions are the manifest's ``backend`` block, and the LoRA initialisation is
seeded by the model's LoRA seed. A bundle made on a GPU is compared within :data:`GPU_ATOL` + :data:`GPU_RTOL` per
weight, and the check says so. A model trained with DP-SGD cannot be replayed: its noise came from the CVM's CSPRNG,
by design known to nobody. What replay proves: the weights are what exactly these ops give from the base model, so
no op outside the record changed them.

A replay runs the bundle's own computation (its custom losses, its ops) on the verifier's machine, so it runs only
for a bundle that verified: every other check of the verdict passed (an unsigned or tampered bundle is not
re-executed). It then runs under the limits the server enforced (the bundle's ``config.json`` ``api`` block:
tokens per request and per datum, LoRA rank; the token ids, losses, lengths and custom-loss bounds of the server's
own checks) and within a budget: :data:`OP_S` seconds an op, :data:`TOTAL_S` in all, a LoRA whose state fits in the
free memory and ops whose pass holds at most half of it (:func:`app.api.engine.packed.budget`). Anything the server would
refuse, or that fails or passes the budget, fails the check with the reason (exit 1), never the verifier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from attestation import Verdict
from attestation.bundle import manifest as B
from attestation.io.safe_yaml import parse_json
from attestation.outputs import op_chain
from attestation.verdict import Check

from app.api.proof.replay_limits import MODEL, ReplayFailed, check_lora, server_limits, server_op, short, torch_threads

CHECK = "op_chain.replay"
WEIGHTS = "adapter/adapter_model.safetensors"
TINY = "cvm-tune/tiny-llama"
GPU_ATOL, GPU_RTOL = 1e-3, 1e-2  # a GPU-made bundle: |replayed - bundle| <= GPU_ATOL + GPU_RTOL * |bundle| per weight
PASS_ROWS_MAX = 128  # the most rows a server pads a pass to (app.api.engine.packed.rows_min)
OP_S = 300.0  # wall-clock budget of one op (a custom loss checks it node by node, every op once it ran)
TOTAL_S = 3600.0  # wall-clock budget of the whole replay


def replay_check(verdict: Verdict, bundle: Path, ops_file: Path, *, base_model_dir: Path | None,
                 progress: Callable[[str], None] = lambda _m: None) -> Verdict:
    """``verdict`` with ``op_chain.replay`` added: pass when the ops, replayed, give the bundle's weights.

    Raises:
        ModuleNotFoundError: the training stack is not installed (the verifier alone cannot replay: exit 2).
    """
    import peft  # noqa: F401  (first: without the training stack, say so before anything runs)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    failed = [c.name for c in verdict.checks if c.status == "fail"]
    if failed:  # the bundle's computation runs here only once the bundle verified
        names = ", ".join(failed[:4]) + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
        check = Check(CHECK, "fail", f"not replayed: the bundle failed {names}; only a bundle that verified is "
                                     "re-executed")
    else:
        try:
            detail = _replay(verdict, Path(bundle), Path(ops_file), base_model_dir, progress)
            check = Check(CHECK, "pass", detail)
        except ReplayFailed as exc:
            check = Check(CHECK, "fail", str(exc))
        except Exception as exc:  # what a verified bundle holds that the replay cannot use: not reproduced, exit 1
            check = Check(CHECK, "fail", f"the replay failed: {type(exc).__name__}: {str(exc)[:300]}")
    return dataclasses.replace(verdict, checks=(*verdict.checks, check))


def _replay(verdict: Verdict, bundle: Path, ops_file: Path, base_dir: Path | None, progress: Callable[[str], None]) -> str:
    chain = next((c for c in verdict.checks if c.name == op_chain.CHECK), None)
    if chain is None or chain.status != "pass":
        raise ReplayFailed("nothing to replay: the ops do not hash to the bundle's op chain (op_chain.ops)")
    try:
        m = B.Manifest.model_validate(parse_json((bundle / B.MANIFEST).read_bytes(), "manifest.json", ValueError))
    except (OSError, ValueError) as exc:
        raise ReplayFailed(f"the bundle's manifest cannot be read: {str(exc).splitlines()[0]}") from None
    oc = m.op_chain
    if oc is None:
        raise ReplayFailed("the bundle records no op chain")
    if oc.dp is not None:
        raise ReplayFailed("the model was trained with DP-SGD: its noise came from the CVM's CSPRNG and is known to "
                           "nobody, so its weights cannot be replayed (privacy.dp checks its accounting)")
    det = oc.determinism or {}
    exact = det.get("device") == "cpu"
    rows = pass_rows(det)
    threads = torch_threads(det)
    limits = server_limits(bundle)
    lora = check_lora(oc.lora, limits.max_lora_rank)
    expected = _expected_hash(m)
    try:
        ops = op_chain.read_ops(ops_file)
    except (OSError, ValueError) as exc:  # read once already by op_chain.ops, which passed
        raise ReplayFailed(f"the ops cannot be read again: {exc}") from None
    with _base(m, base_dir, progress) as base, _threads(threads):
        got, tensors = _run(base, oc, ops, m.base_model.name, progress, rows, lora=lora, limits=limits)
    digest = hashlib.sha256(got).hexdigest()
    libs = ", ".join(f"{k} {v}" for k, v in sorted(m.backend.libraries.items()))
    if exact:
        if digest != expected:
            import torch

            here = torch.backends.cpu.get_cpu_capability()
            kernels = "" if det.get("cpu_capability") in (None, here) else (
                f"; note: made with {det.get('cpu_capability')} CPU kernels, replayed with {here}")
            raise ReplayFailed(f"{len(ops)} ops replayed from the base model give weights with sha256 {digest[:16]}…, "
                               f"the bundle's are {expected[:16]}… (made with {libs}: the server applied something "
                               f"else, or this machine's libraries differ{kernels})")
        return (f"{len(ops)} ops replayed from the base model on this CPU ({det.get('torch_threads')} torch threads): "
                f"weights bit-identical, sha256 {digest[:16]}…")
    worst = _tolerance(bundle, m, tensors)
    return (f"{len(ops)} ops replayed on this CPU; the bundle was made on {det.get('device') or 'an unrecorded device'}: "
            f"weights agree within |Δ| <= {GPU_ATOL:g} + {GPU_RTOL:g}·|w| (largest |Δ| {worst:.3g}), not bit-exact")


def pass_rows(det: dict[str, Any]) -> int | None:
    """``determinism.pass_rows``: the rows the server padded its packed passes to (0: it made none; None: not
    recorded, a bundle made before the server padded them).

    Raises:
        ReplayFailed: not a row count in [0, PASS_ROWS_MAX] (a replay would pad that far).
    """
    rows = det.get("pass_rows")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= PASS_ROWS_MAX):
        raise ReplayFailed(f"the manifest's op_chain.determinism.pass_rows {rows!r} is not a row count in [0, "
                           f"{PASS_ROWS_MAX}]")
    return rows


def _expected_hash(m: B.Manifest) -> str:
    if m.confidentiality is not None:
        plain = m.confidentiality.plaintext_sha256
        key = next((k for k in plain if k.removesuffix(".age") == WEIGHTS), None)
        if key is None:
            raise ReplayFailed(f"the manifest binds no plaintext hash for {WEIGHTS}")
        return plain[key]
    if WEIGHTS not in m.files:
        raise ReplayFailed(f"the bundle has no {WEIGHTS}")
    return m.files[WEIGHTS]


@contextlib.contextmanager
def _base(m: B.Manifest, given: Path | None, progress: Callable[[str], None]) -> Iterator[Path]:
    """The base model's directory: ``given`` (its tree hash is ``inputs.base_model``'s check), or the built-in tiny
    model built afresh and checked against the manifest's tree hash."""
    if given is not None:
        yield Path(given)
        return
    if m.base_model.name != TINY:
        raise ReplayFailed(f"the base model is {m.base_model.name}: pass its local copy with --base-model DIR")
    from attestation.io.hashing import tree_digest

    from app.training import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="cvm-tune-replay-") as tmp:
        built = Path(tmp) / "tiny-llama"
        progress("replay: building the built-in tiny base model")
        build_tiny_model(built)
        if tree_digest(built)[0] != m.base_model.tree_sha256:
            raise ReplayFailed("the built-in tiny model built here does not have the bundle's base-model tree hash "
                               "(another cvm-tune version?): pass the base model with --base-model DIR")
        yield built


@contextlib.contextmanager
def _threads(n: Any) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(base: Path, oc: B.OpChainInfo, ops: list[dict[str, Any]], base_name: str,
         progress: Callable[[str], None], pass_rows: int | None = None, *, lora: dict[str, Any] | None = None,
         limits: Any = None) -> tuple[bytes, dict[str, Any]]:
    """Replay ``ops`` on a fresh engine: the adapter bytes and tensors they give. ``pass_rows``: what the server
    padded its passes to (the manifest's; 0: it made none; None, a bundle made before it was recorded: no padding).
    A pass here is padded at least as far (more rows than needed change no row's bits). ``lora``: the checked
    ``oc.lora``; ``limits``: the server's (:func:`server_limits`; None: the defaults).

    Raises:
        ReplayFailed: an op the server would refuse, one that fails, or past the time or memory budget.
    """
    import time

    import torch

    from app.api.engine.admission import admit, free_memory
    from app.api.engine.engine import Engine
    from app.api.errors import ApiError
    from app.config.api import ApiSettings

    limits = limits if limits is not None else ApiSettings()  # what a bundle without config.json's limits had
    lora = lora if lora is not None else check_lora(oc.lora, limits.max_lora_rank)
    engine = Engine(base, "hf")
    engine.base_name = base_name
    engine.packed = engine.packed and pass_rows != 0
    engine.pad_rows = max(pass_rows, engine.pad_rows) if pass_rows else 1
    start = time.monotonic()
    try:
        try:
            admit(engine, lora, 1)  # its adapter, gradient and Adam state fit in the free memory
            model = engine.create(MODEL, lora)
        except ApiError as exc:
            raise ReplayFailed(f"the bundle's LoRA {short(lora)} would be refused by the server: {exc}") from None
        custom = _custom_losses(oc.custom_losses)
        budget = _pass_budget(engine, free_memory(engine.device))
        progress(f"replay: {len(ops)} ops")
        for i, op in enumerate(ops, start=1):
            began = time.monotonic()
            if began - start > TOTAL_S:
                raise ReplayFailed(f"the replay passed its time budget ({TOTAL_S:g} s) before op {i} of {len(ops)}")
            try:
                if op["op"] == "forward_backward":
                    fb = server_op(op, custom, engine.vocab, limits)
                    need = fb.n_tokens * budget[1]
                    if need > budget[0]:
                        raise ReplayFailed(f"op {i} (forward_backward) needs about {need >> 20} MiB, past this "
                                           f"machine's budget of {budget[0] >> 20} MiB a pass")
                    for loss in custom.values():
                        loss.deadline = began + OP_S
                    engine.forward_backward(fb)
                elif op["op"] == "optim_step":
                    engine.optim_step(MODEL, dict(op["adam_params"]))
                else:
                    _load(engine, model, op, i)
            except ApiError as exc:
                raise ReplayFailed(f"op {i} ({op['op']}) would be refused by the server: {exc}") from None
            except (ReplayFailed, KeyboardInterrupt):
                raise
            except Exception as exc:  # the ops of a verified bundle the engine cannot run: its own failure
                raise ReplayFailed(f"op {i} ({op['op']}) fails: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from None
            if time.monotonic() - began > OP_S:
                raise ReplayFailed(f"op {i} ({op['op']}) took {time.monotonic() - began:.0f} s, past the replay's "
                                   f"budget of {OP_S:g} s an op")
        if model.op_head != oc.head:  # the record hashed to it; the engine must have linked the same ops
            raise ReplayFailed(f"the replayed chain ends at {model.op_head[:16]}…, not the bundle's {oc.head[:16]}…")
        from peft import get_peft_model_state_dict

        tensors = {k: v.detach().cpu().to(torch.float32).clone()
                   for k, v in get_peft_model_state_dict(engine.model, adapter_name=model.adapter).items()}
        return engine.adapter_bytes(model), tensors
    finally:
        engine.stop()


def _pass_budget(engine: Any, free: int | None) -> tuple[int, int]:
    """(bytes a replayed op's pass may hold, bytes a token of it holds): the server's pass budget on this machine
    (:func:`app.api.engine.packed.budget`, half the free memory) and :func:`app.api.engine.packed.token_bytes`."""
    from app.api.engine import packed

    return packed.budget(free), packed.token_bytes(engine.model)


def _custom_losses(docs: dict[str, Any] | None) -> dict[str, Any]:
    """The custom losses of the manifest, rebuilt as the server rebuilt them (their ids were checked by
    op_chain.ops), with the server's bounds.

    Raises:
        ReplayFailed: a loss the server would refuse.
    """
    from app.api.engine.custom_loss import Loss
    from app.api.errors import ApiError

    out = {}
    for key, doc in (docs or {}).items():
        try:
            loss = Loss(doc)
        except ApiError as exc:
            raise ReplayFailed(f"custom loss {key[:16]}… would be refused by the server: {exc}") from None
        loss.id = key
        out[key] = loss
    return out


def _load(engine: Any, model: Any, op: dict[str, Any], i: int) -> None:
    """A ``load`` in the record: the state it loads is the replay's own state at that point (the chain says so);
    its weights must be the ones the load names. A gradient the saved state's last ops left pending is dropped (a
    save keeps none; the server refused a load into a model with one of its own, whose ops are not in this record).
    The optimizer starts afresh unless the load kept it."""
    from app.api.engine.history import fresh_optimizer

    if hashlib.sha256(engine.adapter_bytes(model)).hexdigest() != op["weights_sha256"]:
        raise ReplayFailed(f"op {i} (load) names weights {op['weights_sha256'][:16]}…, but the ops before it give "
                           "other weights")
    params = engine._params(model.adapter)
    for p in params:
        p.grad = None
    model.pending, model.pending_loss = 0, 0.0
    if not op["optimizer"]:
        model.optimizer = fresh_optimizer(params)
    model.op_head, model.ops = op_chain.link(op["checkpoint_head"], op), int(op["checkpoint_ops"]) + 1


def _tolerance(bundle: Path, m: B.Manifest, replayed: dict[str, Any]) -> float:
    """The largest |Δ| between the replayed weights and the bundle's plaintext ones, failing beyond the tolerance."""
    import torch
    from safetensors.torch import load_file

    if m.confidentiality is not None:
        raise ReplayFailed("a GPU-made confidential bundle is compared weight by weight: its weights are ciphertext "
                           "here (replay of encrypted weights within a tolerance is not supported)")
    theirs = load_file(str(bundle / WEIGHTS))
    if set(theirs) != set(replayed):
        raise ReplayFailed("the replayed adapter and the bundle's have different tensors")
    worst = 0.0
    for k, w in theirs.items():
        w32, r = w.to(torch.float32), replayed[k]
        if w32.shape != r.shape:
            raise ReplayFailed(f"{k}: shape {tuple(r.shape)} replayed, {tuple(w32.shape)} in the bundle")
        diff = (r - w32).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if bool((diff > GPU_ATOL + GPU_RTOL * w32.abs()).any()):
            raise ReplayFailed(f"{k}: replayed weights differ from the bundle's beyond |Δ| <= {GPU_ATOL:g} + "
                               f"{GPU_RTOL:g}·|w| (largest |Δ| {float(diff.max()):.3g})")
    return worst
