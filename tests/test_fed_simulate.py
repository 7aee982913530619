"""``cvm-tune federated simulate``: one command writes the owners' keys, signed datasets and configs, runs attested
rounds on Flower's in-process simulation engine, verifies the last round bundle, and leaves nothing running.

One full simulation (module fixture: 3 owners, 2 rounds, 2 steps each); a round that fails makes the command fail
with its documented code; bad arguments exit 2 and write nothing."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from attestation.rounds import manifest as R

RAY_PROCESSES = ("raylet", "gcs_server", "plasma_store", "default_worker", "ray::")


@contextlib.contextmanager
def _registered() -> Iterator[None]:
    """``app.cli`` with the ``federated`` command, whether or not ``app/cli/__init__.py`` registers it yet."""
    from app import cli
    from app.cli import federated as cli_federated

    if "federated" in cli._COMMANDS:
        yield
        return
    build = cli._parser

    def parser() -> argparse.ArgumentParser:
        p = build()
        cli_federated.add_parsers(next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)))
        return p

    with pytest.MonkeyPatch.context() as m:
        m.setattr(cli, "_parser", parser)
        m.setitem(cli._COMMANDS, "federated", cli_federated.COMMANDS["federated"])
        yield


def _main(argv: list[str]) -> int:
    """``cvm-tune ARGV``'s exit code (a usage error is argparse's SystemExit(2))."""
    from app.cli import main

    with _registered():
        try:
            return main(argv)
        except SystemExit as exc:
            return int(exc.code or 0)


def _ray_children() -> list[str]:
    names = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(p.cmdline())[:120])
    return [n for n in names if any(r in n for r in RAY_PROCESSES)]


def _assert_nothing_running() -> None:
    import ray

    assert not ray.is_initialized()
    assert _ray_children() == []


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """The documented command once: (its --out, exit code, stdout)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    out = tmp_path_factory.mktemp("simulate") / "fed"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = _main(["federated", "simulate", "--out", str(out), "--max-steps", "2"])
    return out, rc, buf.getvalue()


def test_simulate_runs_verified_rounds_and_leaves_nothing_running(simulated: tuple[Path, int, str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out, rc, text = simulated
    assert rc == 0, text
    _assert_nothing_running()
    rounds = sorted((out / "aggregator" / "output" / "rounds" / "simulation").glob("round-*"))
    assert [p.name for p in rounds] == ["round-0001", "round-0002"]
    for p in rounds:
        m = json.loads((p / R.ROUND_MANIFEST).read_bytes())
        assert sorted(a["client"] for a in m["admitted"]) == ["owner-a", "owner-b", "owner-c"] and m["rejected"] == []
    policy = out / "simulator-test-policy.yaml"
    assert f"round 2: 3 admitted, 0 rejected: {rounds[1]}\n" in text and rounds[1].is_absolute()
    live = [ln.split(":")[0] for ln in text.splitlines() if ln.startswith("round ")]  # each round as it happened
    assert live == ["round 1/2", "round 1", "round 2/2", "round 2"], text
    assert "Verdict (simulator-test-policy.yaml): ACCEPTED" in text
    from app.cli.federated import round_summary

    summary = round_summary(rounds[1])
    assert summary[0].startswith("admitted: 3: ") and summary[1] == "rejected: 0"
    clients = re.findall(r"(owner-\w) \(\d+ tokens, weight 0\.\d{3}\)", summary[0])
    assert sorted(clients) == ["owner-a", "owner-b", "owner-c"]
    assert summary[2].startswith("aggregate: fedavg of 3 update(s) weighted by trainable tokens; global adapter sha256 ")
    assert summary[2].endswith(f"({rounds[1] / 'adapter' / 'adapter_model.safetensors'})")
    verify = f"cvm-tune verify {rounds[1]} --policy {policy}"
    assert f"Verify again: {verify}" in text
    # the printed command, as a user runs it, and the link between the two rounds
    assert _main(verify.split()[1:]) == 0
    assert _main(["verify", str(rounds[1]), "--parent", str(rounds[0]), "--policy", str(policy)]) == 0
    assert "link: this round continued the previous one" in capsys.readouterr().out
    # each owner's dataset is signed by its own key and holds only ciphertext
    sample = (Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl").read_bytes().splitlines()[0]
    for name in ("owner-a", "owner-b", "owner-c"):
        data = next((out / "clients" / name / "data").glob("*.cvmds")).read_bytes()
        assert sample not in data and (out / "owners" / f"{name}.key").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_a_round_that_admits_too_few_clients_fails_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every client is given the wrong dataset key: each CVM's run fails, the aggregator admits nobody, and the
    command exits 6 with the round's reason (no traceback, no round bundle, ray shut down)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    from app.federated import simulate

    real = simulate.prepare

    def wrong_keys(plan: simulate.Plan) -> simulate.Prepared:
        prepared = real(plan)
        for cfg in prepared.client_configs:
            (cfg.parent / "dataset.key").write_text("ab" * 32 + "\n")
        return prepared

    monkeypatch.setattr(simulate, "prepare", wrong_keys)
    out = tmp_path / "fed"
    assert _main(["federated", "simulate", "--out", str(out), "--clients", "2", "--rounds", "1"]) == 6
    err = capsys.readouterr().err
    assert "error: round 1: 0 client bundle(s) admitted, federation.min_clients is 2" in err
    assert "the client failed: owner-a: WrongKeyError: the key does not open this dataset" in err
    assert err.splitlines()[-1].startswith("fix: ")
    assert "Traceback" not in err
    assert not (out / "aggregator" / "output" / "rounds" / "simulation").exists()
    _assert_nothing_running()


@pytest.mark.parametrize(("raised", "code", "message"), [
    ("round", 6, "error: round 1: 0 client bundle(s) admitted, federation.min_clients is 3 (owner-a: the client "
                 "failed: a reason over two lines)\n"),
    ("engine", 6, "error: Flower's simulation engine stopped: RuntimeError: Simulation Runtime crashed.\n"),
])
def test_a_failure_in_the_engine_fails_the_command_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str], raised: str,
                                                                 code: int, message: str) -> None:
    """What the ServerApp raises (a failed round) keeps its code, on one line; anything else the engine raises is a
    training error (6), never an internal error (70) or a traceback; ray is shut down either way."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    import flwr.simulation

    from app.errors import RoundFailedError

    def engine(**kw: Any) -> None:
        if raised == "round":
            raise RoundFailedError("round 1: 0 client bundle(s) admitted, federation.min_clients is 3 "
                                   "(owner-a: the client failed: a reason\n   over two lines)")
        raise RuntimeError("An error was encountered. Ending simulation.") from RuntimeError("Simulation Runtime crashed.")

    monkeypatch.setattr(flwr.simulation, "run_simulation", engine)
    assert _main(["federated", "simulate", "--out", str(tmp_path / "fed")]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("fix: ")
    _assert_nothing_running()


def test_round_summary_escapes_what_a_client_sent_and_reads_nothing_it_cannot(simulated: tuple[Path, int, str],
                                                                               tmp_path: Path) -> None:
    from app.cli.federated import round_summary

    rounds = sorted((simulated[0] / "aggregator" / "output" / "rounds" / "simulation").glob("round-*"))
    m = json.loads((rounds[-1] / R.ROUND_MANIFEST).read_bytes())
    m["rejected"] = [{"client": "evil\x1b[2J", "node_id": 7, "reason": "replayed\nround 9: 0 admitted"}]
    copy = tmp_path / "round"
    copy.mkdir()
    (copy / R.ROUND_MANIFEST).write_text(json.dumps(m))
    lines = round_summary(copy)
    assert lines[1] == "rejected: 1: evil\\x1b[2J: replayed\\nround 9: 0 admitted"
    assert all(line.isprintable() for line in lines)
    (copy / R.ROUND_MANIFEST).write_text("{")
    assert round_summary(copy) == [] and round_summary(tmp_path / "missing") == []


def test_a_round_bundle_that_fails_verification_fails_the_command(simulated: tuple[Path, int, str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The command trusts nothing it did not verify: a damaged last round bundle exits 7 (state/export)."""
    from app.federated import simulate
    from app.federated.server_app import FederationResult

    src, rc, _ = simulated
    assert rc == 0
    rounds = tmp_path / "rounds"
    shutil.copytree(src / "aggregator" / "output" / "rounds" / "simulation", rounds)
    raw = bytearray((rounds / "round-0002" / R.GLOBAL_ADAPTER).read_bytes())
    raw[-1] ^= 1
    (rounds / "round-0002" / R.GLOBAL_ADAPTER).write_bytes(bytes(raw))
    prepared = simulate.Prepared(src / "aggregator" / "config.yaml", (), src / "simulator-test-policy.yaml", rounds)
    monkeypatch.setattr(simulate, "prepare", lambda plan: prepared)
    monkeypatch.setattr(simulate, "run_rounds", lambda p, progress=None: FederationResult(
        [(1, rounds / "round-0001"), (2, rounds / "round-0002")], []))
    assert _main(["federated", "simulate", "--out", str(tmp_path / "fed")]) == 7
    err = capsys.readouterr().err
    assert f"error: the round bundle {rounds / 'round-0002'} failed verification: " in err
    assert "round.aggregate" in err and "fix: see the failed checks: cvm-tune verify" in err


@pytest.mark.parametrize("args", [
    ["--clients", "1"], ["--clients", "9"], ["--rounds", "0"], ["--rounds", "6"], ["--strategy", "fedsgd"],
    ["--max-steps", "0"], ["--clients", "x"], ["--min-clients", "4"], ["--min-clients", "0"],
], ids=lambda a: " ".join(a))
def test_bad_arguments_exit_2_and_write_nothing(tmp_path: Path, args: list[str]) -> None:
    assert _main(["federated", "simulate", "--out", str(tmp_path / "fed"), *args]) == 2
    assert _tree(tmp_path) == []


def test_out_must_be_new_or_empty_and_is_never_touched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    before = _tree(tmp_path)
    for name, why in (("full", "is not empty"), ("file", "is not a directory"), ("link", "is not a directory")):
        assert _main(["federated", "simulate", "--out", str(tmp_path / name)]) == 2
        assert why in capsys.readouterr().err
    assert _main(["federated", "simulate"]) == 2  # --out is required
    assert _main(["federated"]) == 2
    assert _tree(tmp_path) == before and (tmp_path / "file").read_text() == "mine"


def test_without_ray_the_command_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any, **kw: Any) -> Any:
        return None if name == "ray" else real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert _main(["federated", "simulate", "--out", str(tmp_path / "fed")]) == 6
    err = capsys.readouterr().err
    assert "needs ray, which is not installed" in err and "requirements/cpu.lock" in err
    assert _tree(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedprox", "fedyogi"])
def test_simulate_with_the_other_strategies(tmp_path: Path, strategy: str) -> None:
    """fedprox (clients record mu) and fedyogi (from a fresh initial adapter the clients pin) end verified too."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    out = tmp_path / "fed"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = _main(["federated", "simulate", "--out", str(out), "--clients", "2", "--strategy", strategy,
                    "--max-steps", "2"])
    assert rc == 0
    last = out / "aggregator" / "output" / "rounds" / "simulation" / "round-0002"
    assert json.loads((last / R.ROUND_MANIFEST).read_bytes())["strategy"]["name"] == strategy
    _assert_nothing_running()
