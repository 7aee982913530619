"""Admission: a model more is loaded only while there is room for it (``api.max_models``, free memory); at
capacity the request is refused with 503 and what to do. No model is ever evicted to make room."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.api.errors import BadRequest, Unavailable


def admit(engine: Any, lora: dict[str, Any], limit: int, dp: bool = False) -> None:
    """Refuse one model more when ``limit`` models are loaded, or when its adapter, gradient and Adam state (and
    DP sums) would not fit in the free memory with a tenth of it to spare. Models are never evicted for room.

    Raises:
        BadRequest: a LoRA seed torch does not take (its adapter could not be created: a 400, not a server error).
        Unavailable: at capacity (503), with what to do.
    """
    seed = lora.get("seed")
    if seed is not None and not (isinstance(seed, int) and -(1 << 63) <= seed < (1 << 64)):
        raise BadRequest(f"LoRA seed {str(seed)[:40]} is not one torch takes (an integer in -2^63 .. 2^64 - 1)")
    if len(engine.models) >= limit:
        raise Unavailable(f"this server has {len(engine.models)} models loaded (api.max_models): unload_model one "
                          "you no longer train, or retry later")
    targets = engine.lora_config(lora).target_modules
    dims = [(m.in_features, m.out_features) for n, m in engine.model.base_model.model.named_modules()
            if n.rsplit(".", 1)[-1] in targets and hasattr(m, "in_features")]
    need = 4 * (5 if dp else 4) * lora["rank"] * sum(i + o for i, o in dims)
    free = free_memory(engine.device)
    if free is not None and free * 0.9 < need:
        raise Unavailable(f"a model more needs about {need >> 20} MiB and {free >> 20} MiB are free on "
                          f"{engine.device}: unload_model a model you no longer train, or retry later")


def free_memory(device: str) -> int | None:
    """Bytes free for a model more: the GPU's free memory, or the system's available memory (None: unknown)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024
