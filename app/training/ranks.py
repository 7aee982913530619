"""Which training process this is: rank helpers shared by the backend and the launcher.

Outside a worker started by :func:`app.training.launch.train_distributed` there is one process of rank 0, and
``barrier``/``any_rank`` cost nothing. Kept apart from ``launch`` so that the backend (which a worker runs) and the
launcher (which imports the backend) do not import each other.
"""

from __future__ import annotations

import os
from typing import Any

WORKER_ENV = "CVM_TUNE_WORKER"


def in_worker() -> bool:
    """True inside a worker started by :func:`train_distributed`."""
    return os.environ.get(WORKER_ENV) == "1"


def world_size() -> int:
    """Number of training processes (1 outside a worker)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if in_worker() else 1


def rank() -> int:
    """This worker's global rank (0 outside a worker)."""
    return int(os.environ.get("RANK", "0")) if in_worker() else 0


def local_rank() -> int:
    """This worker's device index (0 outside a worker)."""
    return int(os.environ.get("LOCAL_RANK", "0")) if in_worker() else 0


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if world_size() > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def any_rank(flag: bool, device: Any) -> bool:
    """True when ``flag`` is true on any rank (an all-reduce; just ``flag`` in one process)."""
    if world_size() <= 1:
        return flag
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
