"""A newcomer's machine stays clean and the output stays ours: ``cvm-tune run`` and ``cvm-tune federated simulate
--secure-aggregation``, run as a user runs them (a fresh process, output to pipes, ``$HOME`` and ``$TMPDIR`` empty
directories), print no third-party warning, progress bar, Flower banner or colour code, and leave nothing in ``$HOME``
or ``$TMPDIR`` (docs/federated.md, "Run it on one machine").

Both commands run once (module fixture): a 2-step run, and the secure simulation block of docs/federated.md as it is
written there (2 owners, 1 round of 1 step), with the `cvm-tune verify` that follows it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from attestation.rounds import manifest as R

REPO = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[")
NOISE = re.compile(r"Warning|WARNING|it/s\]|\d+%\|[^|]*\||Starting AttestedStrategy|\[ROUND \d|ClientAppActor")


def _secure_block() -> list[list[str]]:
    """The commands of docs/federated.md's "Try secure aggregation on one machine" block (``cvm-tune`` dropped)."""
    text = (REPO / "docs" / "federated.md").read_text(encoding="utf-8")
    block = re.search(r"^### Try secure aggregation on one machine\n\n```sh\n(.*?)^```", text, flags=re.S | re.M)
    assert block is not None
    lines = [shlex.split(line) for line in block.group(1).splitlines()]
    assert [line[:3] for line in lines] == [["cvm-tune", "federated", "simulate"], ["cvm-tune", "verify", lines[1][2]]]
    return [line[1:] for line in lines]


@pytest.fixture(scope="module")
def ran() -> Iterator[dict[str, object]]:
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    root = Path(tempfile.mkdtemp(prefix="cvm-tune-clean-", dir="/tmp"))  # short: ray's sockets live below $TMPDIR
    home, tmp, work = root / "home", root / "tmp", root / "work"
    for d in (home, tmp, work):
        d.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "TMPDIR": str(tmp), "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1", "LANG": "C.UTF-8"}  # nothing else: the commands must set what they need
    cfg = work / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(work / "out")}, "training": {"max_steps": 2, "save_steps": 2}}))
    simulate, verify = _secure_block()
    procs = {}
    for name, argv in (("run", ["run", "--config", str(cfg)]), ("simulate", simulate), ("verify", verify)):
        procs[name] = subprocess.run([sys.executable, "-m", "app", *argv], cwd=work, env=env, capture_output=True,
                                     text=True, timeout=600)
    left = {d.name: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for d in (home, tmp)}
    try:
        yield {"procs": procs, "left": left, "work": work}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_both_commands_succeed_and_leave_nothing_in_home_or_tmpdir(ran: dict) -> None:
    for name, p in ran["procs"].items():
        assert p.returncode == 0, f"{name}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert ran["left"] == {"home": [], "tmp": []}


@pytest.mark.parametrize("name", ["run", "simulate", "verify"])
def test_output_is_ours_without_warnings_bars_banners_or_colour(ran: dict, name: str) -> None:
    p = ran["procs"][name]
    for stream in (p.stdout, p.stderr):
        assert not ANSI.search(stream)
        assert [line for line in stream.splitlines() if NOISE.search(line)] == []
    assert p.stderr == ""


def test_secure_simulation_prints_where_each_round_went_and_its_counts(ran: dict) -> None:
    from app.cli.federated import round_summary

    out = ran["procs"]["simulate"].stdout
    bundle = ran["work"] / "fed-secure" / "aggregator" / "output" / "rounds" / "simulation" / "round-0001"
    assert f"round 1: 2 admitted, 0 rejected: {bundle}\n" in out and bundle.is_absolute()
    assert "with secure aggregation" in out and "Verdict (simulator-test-policy.yaml): ACCEPTED" in out
    assert "SKIP round.aggregate: " in ran["procs"]["verify"].stdout  # the updates are ciphertext to the aggregator
    m = json.loads((bundle / R.ROUND_MANIFEST).read_bytes())
    assert m["aggregator_recipient"] and m["confidentiality"]["plaintext_sha256"] == m["global_adapter_sha256"]
    lines = round_summary(bundle)
    assert lines[0].startswith("admitted: 2: ")
    assert sorted(re.findall(r"(owner-\w) \(\d+ tokens, weight 0\.\d{3}\)", lines[0])) == ["owner-a", "owner-b"]
    assert lines[1] == "rejected: 0"
    assert lines[2].startswith("aggregate: fedavg of 2 update(s) weighted by trainable tokens; global adapter sha256 "
                               f"{m['global_adapter_sha256'][:16]}…, stored as age ciphertext to ")
