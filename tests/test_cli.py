"""CLI contract: complete --help, one-line errors with a fix, documented exit codes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import main

COMMANDS = ["run", "verify", "simulator", "schema", "validate-config"]


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd in out
    assert "Exit codes" in out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: cvm-tune " + cmd in capsys.readouterr().out


def test_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--now", "soon"])
    assert exc.value.code == 2


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training: {max_steps: -1}\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and "training.max_steps" in err[0]
    assert err[1].startswith("fix: ") and len(err) == 2


def test_schema_and_validate_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["additionalProperties"] is False
    repo = Path(__file__).resolve().parent.parent
    assert main(["validate-config", str(repo / "configs" / "dstack.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["tee"]["mode"] == "dstack"


def test_simulator_write_policy(tmp_path: Path) -> None:
    from attestation import load_policy

    assert main(["simulator", "--write-policy", str(tmp_path / "p.yaml")]) == 0
    policy = load_policy(tmp_path / "p.yaml")
    assert policy.uses_test_root and policy.trusted_root.test_only


def test_simulator_command_serves_the_protocol(sock_dir: Path) -> None:
    """`cvm-tune simulator --socket` as a real process, reached with the dstack SDK."""
    from dstack_sdk import DstackClient

    sock = sock_dir / "d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "app", "simulator", "--socket", str(sock)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert "TEST CA" in proc.stdout.readline()
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = DstackClient(str(sock))
        assert len(client.get_key("a", "b").decode_key()) == 32
        assert client.version().rev.startswith("cvm-tune-simulator")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_unexpected_exception_is_one_line_without_traceback(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    def boom(_args: object) -> int:
        raise RuntimeError("surprise")

    monkeypatch.setitem(__import__("app.cli").cli._COMMANDS, "schema", boom)
    assert main(["schema"]) == 70
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: surprise" in err and "Traceback" not in err
    assert main(["--debug", "schema"]) == 70  # --debug adds the traceback, the exit code stays
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: surprise" in err


# ---- one spelling for output options; did-you-mean ----------------------------------------------------------------

def _subparsers(p: argparse.ArgumentParser, path: str = "cvm-tune") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


OLD_OUTPUT_NAMES = {"--output", "--out-dir", "--save", "--write-policy"}


def test_every_output_option_is_spelled_o_out_and_the_old_names_are_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import _parser

    writers = []
    for path, p in _subparsers(_parser()):
        for action in p._actions:
            old = OLD_OUTPUT_NAMES & set(action.option_strings)
            if old and path != "cvm-tune bundles serve":  # its --output names the volume it reads: an input
                writers.append(path)
                assert action.option_strings[:2] == ["-o", "--out"], path
        help_text = p.format_help()
        assert not any(f"{name} " in help_text for name in OLD_OUTPUT_NAMES if path != "cvm-tune bundles serve"), path
    assert len(writers) == 6 and "cvm-tune federated simulate" not in writers  # collateral, simulator, compose-hash, …
    assert "-o DIR, --out DIR" in next(p for path, p in _subparsers(_parser()) if path.endswith("simulate")).format_help()


@pytest.mark.parametrize(("new", "old"), [("-o", "--write-policy"), ("--out", "--write-policy")])
def test_an_old_output_name_is_the_same_option(tmp_path: Path, new: str, old: str) -> None:
    assert main(["simulator", new, str(tmp_path / "a.yaml")]) == 0
    assert main(["simulator", old, str(tmp_path / "b.yaml")]) == 0
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()


def test_a_missing_required_output_names_only_the_new_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["collateral", "quote.bin"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("the following arguments are required: -o/--out")


@pytest.mark.parametrize(("argv", "hint"), [(["verfy", "b"], "did you mean verify?"),
                                            (["bundles", "fecth"], "did you mean fetch?"),
                                            (["federated", "simulate", "-o", "x", "--strategy", "fedprx"],
                                             "did you mean fedprox?")])
def test_a_mistyped_command_or_choice_gets_the_closest(tmp_path: Path, argv: list[str], hint: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert hint in capsys.readouterr().err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_config_key_gets_the_closest_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training: {max_step: 3, lora: {rr: 4}}\noutptu: {dir: x}\n"
                   "federation: {clients: {lab-a: {owner_public_key: [ab]}}}\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: ")
    for hint in ("training.max_step: Extra inputs are not permitted (did you mean max_steps?)",
                 "training.lora.rr: Extra inputs are not permitted (did you mean r?)",
                 "outptu: Extra inputs are not permitted (did you mean output?)",
                 "federation.clients.lab-a.owner_public_key: Extra inputs are not permitted (did you mean "
                 "owner_public_keys?)"):
        assert hint in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]
