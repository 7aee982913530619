"""``training.cpu_threads``: the number of threads torch computes with on the CPU, set before training.

``auto`` takes the CPUs this process may run on: the affinity mask (``os.sched_getaffinity``: taskset, cpuset,
a container's ``--cpuset-cpus``), capped by the cgroup CPU quota rounded up (cgroup v2 ``cpu.max`` from this
process's cgroup up to the root, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: a container's ``--cpus``),
divided among the training processes of a multi-process run, less the CPUs other processes keep busy: the
1-minute load average when training starts, rounded down (``os.getloadavg``), never below one thread. On a
dedicated CVM that subtracts nothing; on a shared machine whose cores are busy, torch's threads would wait on
each other (measured: 2 threads on a busy 2-core machine 10x slower per step than 1, docs/performance.md). A
number overrides it. The choice goes into the run report (``report/report.json``, ``cpu``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_budget(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """``(CPUs this process may use, where that number comes from)``."""
    try:
        n, source = len(os.sched_getaffinity(0)), "sched_getaffinity"
    except (AttributeError, OSError):  # not Linux
        n, source = os.cpu_count() or 1, "cpu_count"
    quota = cgroup_quota(cgroup_root)
    if quota is not None and quota < n:
        n, source = quota, "cgroup cpu quota"
    return max(1, n), source


def cgroup_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The tightest CPU quota over this process's cgroup and its parents, in CPUs rounded up; ``None``: no quota."""
    quotas = [q for q in (_v2_quota(d) for d in _v2_dirs(root)) if q is not None]
    v1 = _v1_quota(root / "cpu")
    if v1 is not None:
        quotas.append(v1)
    return min(quotas) if quotas else None


def _v2_dirs(root: Path) -> list[Path]:
    """This process's cgroup v2 directory and its parents up to ``root`` (only ``root`` when unknown)."""
    rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text(encoding="ascii").splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip("/")
    except OSError:
        pass
    parts = [p for p in rel.split("/") if p and p != ".."]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(cgroup: Path) -> int | None:
    try:
        quota, period = (cgroup / "cpu.max").read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _cpus(quota, period)


def _v1_quota(cpu: Path) -> int | None:
    try:
        quota = (cpu / "cpu.cfs_quota_us").read_text(encoding="ascii").strip()
        period = (cpu / "cpu.cfs_period_us").read_text(encoding="ascii").strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _cpus(quota, period)


def _cpus(quota: str, period: str) -> int | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def busy_cpus() -> int:
    """CPUs other processes keep busy now: the 1-minute load average rounded down (0 where it is unknown)."""
    try:
        return max(0, math.floor(os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0


def resolve(setting: int | str, *, world: int = 1, reserve: int = 0, cgroup_root: Path = CGROUP_ROOT,
            busy: int | None = None) -> dict[str, Any]:
    """What ``setting`` (``"auto"`` or a number) means here: ``{"setting", "threads", "available", "busy",
    "source"}``; ``busy`` defaults to :func:`busy_cpus`. ``reserve``: CPUs ``auto`` also leaves to other work of this
    process (the training API's request handling)."""
    available, source = cpu_budget(cgroup_root)
    busy = busy_cpus() if busy is None else busy
    if setting == "auto":
        threads = max(1, (available - min(busy + reserve, available)) // max(1, world))
    else:
        threads, source = int(setting), "training.cpu_threads"
    return {"setting": setting, "threads": threads, "available": available, "busy": busy, "source": source}


def apply(setting: int | str, *, world: int = 1, reserve: int = 0) -> dict[str, Any]:
    """Resolve ``setting`` and hand it to ``torch.set_num_threads``; returns :func:`resolve`'s record."""
    import torch

    chosen = resolve(setting, world=world, reserve=reserve)
    torch.set_num_threads(chosen["threads"])
    return chosen
