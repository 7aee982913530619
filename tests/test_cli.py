"""CLI contract: complete --help, one-line errors with a fix, documented exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def test_simulator_command_serves_the_protocol(tmp_path: Path) -> None:
    """`cvm-tune simulator --socket` as a real process, reached with the dstack SDK."""
    from dstack_sdk import DstackClient

    sock = tmp_path / "d.sock"
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
