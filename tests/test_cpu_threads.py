"""``training.cpu_threads``: auto = the CPUs this process may use (affinity, cgroup quota), set before training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.config import load_config
from app.errors import ConfigError
from app.training import threads as T


def _cgroup(root: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return root


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)


@pytest.mark.parametrize(("v2", "v1", "threads", "source"), [
    (None, None, 8, "sched_getaffinity"),  # no cgroup files: the affinity mask
    ("max 100000", None, 8, "sched_getaffinity"),  # v2 without a quota
    ("150000 100000", None, 2, "cgroup cpu quota"),  # --cpus 1.5: rounded up
    ("50000 100000", None, 1, "cgroup cpu quota"),
    ("1600000 100000", None, 8, "sched_getaffinity"),  # a quota above the mask: the mask
    (None, ("300000", "100000"), 3, "cgroup cpu quota"),  # cgroup v1
    (None, ("-1", "100000"), 8, "sched_getaffinity"),  # v1 without a quota
    ("garbage", ("x", "100000"), 8, "sched_getaffinity"),  # unreadable: ignored
])
def test_auto_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path: Path, eight_cpus: None, v2: str | None,
                                                              v1: tuple[str, str] | None, threads: int,
                                                              source: str) -> None:
    root = _cgroup(tmp_path / "cg", v2, v1)
    assert threads_of("auto", root) == (threads, source)
    assert T.resolve("auto", cgroup_root=root, busy=0)["available"] == threads


def threads_of(setting: int | str, root: Path, world: int = 1, busy: int = 0) -> tuple[int, str]:
    chosen = T.resolve(setting, world=world, cgroup_root=root, busy=busy)
    return chosen["threads"], chosen["source"]


def test_auto_leaves_the_cpus_other_processes_keep_busy(tmp_path: Path, eight_cpus: None) -> None:
    root = _cgroup(tmp_path / "cg", "200000 100000")  # 2 CPUs
    assert threads_of("auto", root, busy=0) == (2, "cgroup cpu quota")
    assert threads_of("auto", root, busy=1) == (1, "cgroup cpu quota")
    assert threads_of("auto", root, busy=5) == (1, "cgroup cpu quota")  # never 0
    assert threads_of(2, root, busy=5) == (2, "training.cpu_threads")  # a number is taken as it is


def test_busy_cpus_is_the_load_average_rounded_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T.os, "getloadavg", lambda: (1.93, 0.5, 0.2))
    assert T.busy_cpus() == 1

    def unknown() -> tuple[float, float, float]:
        raise OSError("no load average")

    monkeypatch.setattr(T.os, "getloadavg", unknown)
    assert T.busy_cpus() == 0


def test_processes_share_the_cpus_and_a_number_wins(tmp_path: Path, eight_cpus: None) -> None:
    root = _cgroup(tmp_path / "cg", "400000 100000")
    assert threads_of("auto", root, world=2) == (2, "cgroup cpu quota")
    assert threads_of("auto", root, world=8) == (1, "cgroup cpu quota")  # never 0
    assert T.resolve(3, cgroup_root=root, busy=1) == {"setting": 3, "threads": 3, "available": 4, "busy": 1,
                                                      "source": "training.cpu_threads"}


def test_a_reserve_leaves_cpus_to_other_work_of_this_process_but_not_to_a_number(tmp_path: Path,
                                                                              eight_cpus: None) -> None:
    root = _cgroup(tmp_path / "cg", "400000 100000")
    assert T.resolve("auto", cgroup_root=root, busy=1, reserve=1)["threads"] == 2  # 4 CPUs, 1 busy, 1 for the server
    assert T.resolve("auto", cgroup_root=root, busy=3, reserve=1)["threads"] == 1  # never 0
    assert T.resolve(3, cgroup_root=root, busy=1, reserve=1)["threads"] == 3


@pytest.mark.parametrize("value", ["0", "-1", "5000", "true", "'2'", "1.5", "many", "null"])
def test_bad_values_are_config_errors(tmp_path: Path, value: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(f"training: {{cpu_threads: {value}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "training.cpu_threads" in err.value.message


def test_good_values(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    for value, expected in (("auto", "auto"), ("1", 1), ("16", 16)):
        p.write_text(f"training: {{cpu_threads: {value}}}\n")
        assert load_config(p).training.cpu_threads == expected


def test_run_applies_and_reports_the_count(tmp_path: Path) -> None:
    """A run with cpu_threads: 1 trains with one torch thread; the report says so (and why)."""
    import torch

    from app.cli import main

    before = torch.get_num_threads()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"output": {"dir": str(tmp_path / "out")},
                               "training": {"max_steps": 2, "save_steps": 2, "cpu_threads": 1}}))
    try:
        assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    report = json.loads((tmp_path / "out" / "exports" / "r1" / "report" / "report.json").read_text())
    assert report["cpu"]["threads"] == 1 and report["cpu"]["setting"] == 1
    assert report["cpu"]["source"] == "training.cpu_threads" and report["cpu"]["available"] >= 1
