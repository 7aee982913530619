"""Multi-GPU training (DDP): one worker process per device; the pipeline's process alone attests.

``training.gpu.devices: N`` (N > 1) makes :func:`app.training.train` call :func:`train_distributed`:

1. The newest usable sealed checkpoint is decrypted once, here, into a private scratch directory
   that all workers share as their ``output_dir`` (``backend.restore``), before any worker starts.
2. N workers are spawned (``torch.multiprocessing``, start method ``spawn``) with torchrun's
   environment contract: ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
   ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (+ ``CVM_TUNE_WORKER=1``). transformers/accelerate read
   them and run DDP: NCCL on CUDA (rank i on GPU i), gloo on a machine without CUDA (tests).
3. Each worker runs ``backend.train`` on the same request. The request, rows included, reaches the
   workers through the spawn pipe: plaintext is never written to disk and the dataset is decrypted
   once. Callbacks cannot cross a process boundary, so rank 0 sends its log metrics and audit events
   (sealed checkpoints) on a queue and this process calls ``req.on_log`` / ``req.on_event``; a stop
   request (``req.on_step_end``, polled here) reaches the workers through a shared event, and the
   ranks agree on it at each step boundary (:func:`any_rank`) so they stop and seal together.
4. Rank 0 seals checkpoints (after a barrier, so every rank's ``rng_state_<rank>.pth`` is covered)
   and exports the adapter; this process returns rank 0's :class:`TrainResult`. The audit events,
   the export bundle and the quote stay with the caller: exactly one process talks to the guest
   agent, and nothing in the pipeline needs rank gating.
5. A worker that runs out of memory reports it; all workers are stopped and started again with a
   smaller plan by the same :func:`app.training.batch.run_with_backoff` rules as one process
   (train OOM before the first step: micro-batch halved, accumulation doubled; eval OOM: eval
   micro-batch halved, then the run resumes from its last checkpoint).

Why not re-execute the whole CLI under torchrun: every rank would decrypt the dataset, ask the guest
agent for keys and need rank-0 gating around audit events, export and quote. Confidential-computing
caveat (docs/gpu.md, "Multi-GPU"): on Hopper, CC-mode DDP traffic crosses encrypted bounce buffers and
is slow; in multi-GPU protected-PCIe mode NVLink traffic is not encrypted.

This module imports no torch at import time (spawned workers import it after setting their env).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import Any

from app import errors as E
from app.errors import TrainingError

from . import LossDiverged, TrainingInterrupted, TrainingStopped, TrainRequest, TrainResult
from .backend import checkpoint_key, restore, scratch_dir, select_backend
from .backend import train as backend_train
from .ranks import WORKER_ENV, in_worker

_POLL_S = 0.2


def refuse_foreign_launcher() -> None:
    """cvm-tune must not itself run under torchrun/accelerate launch: each rank would attest and export.

    Raises:
        TrainingError: ``WORLD_SIZE`` > 1 in a process that this module did not start.
    """
    if not in_worker() and int(os.environ.get("WORLD_SIZE", "1") or "1") > 1:
        raise TrainingError("cvm-tune was started by a distributed launcher (WORLD_SIZE > 1)",
                            fix="run `cvm-tune run` as one process and set training.gpu.devices to the number of GPUs")


def worker_env(rank_: int, world: int, port: int) -> dict[str, str]:
    """The environment of worker ``rank_`` (torchrun's names; one node)."""
    return {WORKER_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank_),
            "LOCAL_RANK": str(rank_), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank_), "ROLE_WORLD_SIZE": str(world)}


def free_port() -> int:
    """A free TCP port on the loopback interface for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train_distributed(req: TrainRequest) -> TrainResult:
    """Train on ``req.settings.gpu.devices`` processes; see the module docstring.

    Raises:
        TrainingError: not enough GPUs, a worker failed (its error class and message are kept),
            or OOM back-off is exhausted.
        TrainingInterrupted: the ``stop_after_step`` hook fired in the workers.
    """

    import torch

    from .batch import initial_plan, retry_budget, run_with_backoff
    from .batch import summary as batch_summary
    from .options import check_options

    s = req.settings
    world = s.gpu.devices
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < world:
        raise TrainingError(f"training.gpu.devices is {world} but {torch.cuda.device_count()} CUDA device(s) are visible",
                            fix="lower training.gpu.devices or expose more GPUs to the container")
    check_options(select_backend(s.backend, devices=world), s, cuda=cuda)
    key = checkpoint_key(req)
    # Callables do not cross the spawn pipe: the workers get a request without them (see _run_workers).
    child_req = dataclasses.replace(req, checkpoint_key=key, on_log=None, on_batch_change=None, on_event=None,
                                    on_step_end=None)

    def attempt(plan: Any) -> TrainResult:
        with scratch_dir(req.scratch_dir) as scratch:  # each attempt resumes from the sealed checkpoints afresh
            choice = restore(req, key, scratch)
            return _run_workers(child_req, plan, world, req, scratch, choice)

    result, final, records = run_with_backoff(initial_plan(s), attempt, retries=retry_budget(s),
                                              probing=s.gpu.auto_batch_size, on_change=req.on_batch_change)
    return dataclasses.replace(result, batch=batch_summary(final, s, world, records))


def _run_workers(req: TrainRequest, plan: Any, world: int, parent: TrainRequest, scratch: Any, choice: Any) -> TrainResult:
    """Start the ranks on ``req`` (no callables) and serve ``parent``'s callbacks until they finish."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, stop = ctx.SimpleQueue(), ctx.Event()
    port = free_port()
    procs = mp.start_processes(_worker, args=(world, port, req, plan, queue, stop, scratch, choice), nprocs=world,
                               join=False, start_method="spawn")
    messages: list[tuple[Any, ...]] = []
    failure: BaseException | None = None
    last_step = [0]

    def drain() -> None:
        while not queue.empty():
            msg = queue.get()
            if msg[0] == "log":
                last_step[0] = msg[1]["step"]
                if parent.on_log is not None:
                    parent.on_log(msg[1])
            elif msg[0] == "event":
                if parent.on_event is not None:
                    parent.on_event(msg[1], msg[2])
            else:
                messages.append(msg)

    try:
        while True:
            drain()
            if parent.on_step_end is not None and not stop.is_set() and parent.on_step_end(last_step[0]) is not None:
                stop.set()  # the ranks agree on it at their next step boundary, seal and stop
            try:
                if procs.join(timeout=_POLL_S):
                    break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # the others are stopped by join()
                failure = exc
                break
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
                p.join(10)
        for name in procs.error_files:  # torch's pytorch-errorfile-*.pickle in $TMPDIR: a failed rank's traceback
            with contextlib.suppress(OSError):
                os.unlink(name)
    drain()
    if failure is not None:
        raise _worker_error(failure, messages)
    for msg in messages:
        if msg[0] == "result":
            return msg[1]
    raise TrainingError("the training workers finished without a result from rank 0")


def _worker_error(failure: BaseException, messages: list[tuple[Any, ...]]) -> E.CvmTuneError:
    """The error to raise in the parent: the failing rank's own error, rebuilt from its report."""
    from .batch import OutOfMemory

    failed_rank = getattr(failure, "error_index", None)
    reports = [m[2] for m in messages if m[0] == "error"]
    reports.sort(key=lambda r: (r["rank"] != failed_rank, r["rank"]))
    if not reports:
        first = str(failure).strip().splitlines()
        return TrainingError(f"training worker failed: {first[-1] if first else type(failure).__name__}")
    r = reports[0]
    if r["oom"] is not None:
        return OutOfMemory(r["message"], **r["oom"])
    cls = {"TrainingInterrupted": TrainingInterrupted, "TrainingStopped": TrainingStopped,
           "LossDiverged": LossDiverged}.get(r["cls"]) or getattr(E, r["cls"], None)
    if not (isinstance(cls, type) and issubclass(cls, E.CvmTuneError)):
        cls = TrainingError
    return cls(r["message"], fix=r["fix"])


def _worker(index: int, world: int, port: int, req: TrainRequest, plan: Any, queue: Any, stop: Any, scratch: Any,
            choice: Any) -> None:
    """One DDP rank (runs in a spawned process)."""
    os.environ.update(worker_env(index, world, port))
    from .batch import OutOfMemory

    req = dataclasses.replace(req, on_step_end=lambda _step: "stop requested" if stop.is_set() else None)
    if index == 0:
        req = dataclasses.replace(req, on_log=lambda m: queue.put(("log", m)),
                                  on_event=lambda t, d: queue.put(("event", t, d)))
    try:
        result = backend_train(req, plan=plan, scratch=scratch, choice=choice)
    except BaseException as exc:
        oom = ({"phase": exc.phase, "first_step": exc.first_step, "at_step": exc.at_step}
               if isinstance(exc, OutOfMemory) else None)
        queue.put(("error", index, {"rank": index, "cls": type(exc).__name__, "oom": oom,
                                    "message": getattr(exc, "message", str(exc).splitlines()[0] if str(exc) else ""),
                                    "fix": getattr(exc, "fix", None)}))
        _end_process_group(wait_for_all=False)  # the other ranks may be gone: no barrier
        raise
    _end_process_group(wait_for_all=True)  # rank 0 has exported the adapter when every rank passes the barrier
    queue.put(("result", result) if index == 0 else ("done", index))


def _end_process_group(*, wait_for_all: bool) -> None:
    """Destroy this worker's process group while its interpreter is whole.

    Left to interpreter exit, Gloo's worker threads can still hold work objects whose teardown needs the
    GIL, and the process dies with SIGABRT ("terminate called without an active exception"; seen once in
    the 2-process CPU test, described in pytorch/pytorch PR #179291).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait_for_all:
            dist.barrier()
    finally:
        dist.destroy_process_group()
