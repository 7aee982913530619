"""What a newcomer meets first: the test command's own set-up, a busy port, a busy volume, a missing directory, the
owner key id pinned where the public key belongs, configuration overrides on the command line, and a training log
that says how fast and how long.

Each refusal is one ``error:`` line plus a ``fix:`` line, its documented exit code, and nothing written."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from app.errors import ConfigError, DatasetSignatureError, StateError

REPO = Path(__file__).resolve().parent.parent


def _one_error(err: str) -> str:
    """The error line of a refusal (exactly one ``error:`` line and one ``fix:`` line, no traceback)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert [ln.split(":", 1)[0] for ln in lines] == ["error", "fix"], err
    assert "Traceback" not in err
    return lines[0]


# ---- the README's test command installs what the tests drive ----------------------------------------------------------

def test_the_test_tools_script_names_what_it_cannot_install(tmp_path: Path) -> None:
    """Without apt-get (another distribution) and with a program missing, the script stops with the programs to
    install and the fix, before it touches npm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "dirname", "id", "mktemp", "cp", "rm"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "CHROMIUM": str(tmp_path / "no-chromium"), "HOME": str(tmp_path)}
    proc = subprocess.run(["sh", str(REPO / "requirements" / "test-tools.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "error: the tests need these programs: nodejs npm chromium age" in proc.stderr
    assert "fix: install them" in proc.stderr and "npm's cache" not in proc.stderr


def test_install_sh_runs_the_test_tools_for_the_test_lock_only() -> None:
    script = (REPO / "requirements" / "install.sh").read_text()
    assert 'if [ "$(basename "$lock")" = "test.lock" ]; then\n    sh "$(dirname "$0")/test-tools.sh"\nfi' in script


# ---- a port in use: checked before anything loads ---------------------------------------------------------------------

@pytest.fixture
def busy_port() -> tuple[str, int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield "127.0.0.1", taken.getsockname()[1]


def _token(tmp_path: Path) -> Path:
    tok = tmp_path / "token"
    assert main(["bundles", "token", str(tok)]) == 0
    return tok


def test_bundles_serve_on_a_port_in_use_is_a_usage_error(busy_port: tuple[str, int], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    host, port = busy_port
    tok, out = _token(tmp_path), tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    code = main(["bundles", "serve", "--output", str(out), "--token-file", str(tok), "--host", host,
                 "--port", str(port)])
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code == 2
    assert _one_error(err) == f"error: {host}:{port} is already in use by another process"
    assert list(out.iterdir()) == []


def test_bundles_serve_without_its_output_volume_is_a_usage_error(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    tok = _token(tmp_path)
    capsys.readouterr()
    missing = tmp_path / "data" / "output"
    code = main(["bundles", "serve", "--output", str(missing), "--token-file", str(tok), "--host", "127.0.0.1",
                 "--port", "0"])
    assert code == 2 and "is not a directory" in _one_error(capsys.readouterr().err)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("host, says", [("192.0.2.1", "is not an address of this machine"),
                                        ("no-such-host.invalid", "does not resolve")])
def test_an_address_that_cannot_be_listened_on_is_named(host: str, says: str) -> None:
    from app.netaddr import require_free_address

    with pytest.raises(ConfigError) as exc:
        require_free_address(host, 8000, "--host")
    assert type(exc.value) is ConfigError and says in exc.value.message


def test_api_serve_on_a_port_in_use_exits_2_before_the_model_loads(busy_port: tuple[str, int], tmp_path: Path) -> None:
    host, port = busy_port
    env = {**os.environ, "CVM_TUNE_API_KEYS": "tml-" + "a" * 40}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "app", "api", "serve", "--listen", f"{host}:{port}", "--plain-http",
                           "--config", str(_config(tmp_path))], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr) == f"error: {host}:{port} is already in use by another process"
    assert proc.stdout == "" and time.monotonic() - started < 30  # no model, no guest agent, no volume touched
    assert not (tmp_path / "out").exists()


# ---- a busy output volume: `run` fails, says who holds it, writes nothing ----------------------------------------------

def _config(tmp_path: Path, **training: object) -> Path:
    import yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 2, **training}}))
    return cfg


def test_run_on_a_volume_another_process_holds_exits_7_and_writes_nothing(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from app.state import run_lock

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from app.state import run_lock\nwith run_lock(Path(sys.argv[1])):\n"
                               "    print('held', flush=True)\n    time.sleep(60)\n", str(out)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n"
        before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        code = main(["run", "--config", str(_config(tmp_path))])
        printed = capsys.readouterr()
        assert code == StateError.exit_code == 7
        assert _one_error(printed.err) == (f"error: the output volume {out} is in use by another cvm-tune process "
                                           f"(pid {holder.pid})")
        assert "Export bundle" not in printed.out and "skipped" not in printed.out
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait()
    with run_lock(out):  # released with its holder: the next run may go
        pass


# ---- configuration overrides and the training log --------------------------------------------------------------------

@pytest.mark.parametrize("override, says", [
    ("training.max_steps", "is not KEY=VALUE"),
    ("training.no_such_field=1", "training.no_such_field: Extra inputs are not permitted"),
    ("training.max_steps=[1", "--set training.max_steps is not valid YAML"),
    ("training.max_steps.deeper=1", "training.max_steps is a value, not a section"),
])
def test_a_bad_override_is_a_usage_error_and_nothing_runs(override: str, says: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--config", str(_config(tmp_path)), "--set", override])
    assert code == 2 and says in _one_error(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_run_takes_max_steps_and_set_and_logs_pace_and_eta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--config", str(_config(tmp_path, max_steps=30)), "--max-steps", "1",
                 "--set", "training.learning_rate=0.0003"])
    out = capsys.readouterr().out
    assert code == 0, out
    step = next(ln for ln in out.splitlines() if ln.startswith("  step 1/1  loss "))
    assert "tokens/s  elapsed 0:" in step and step.endswith("ETA 0:00"), step
    bundle = Path(next(ln for ln in out.splitlines() if ln.startswith("Export bundle: ")).split(": ", 1)[1].split()[0])
    training = json.loads((bundle / "config.json").read_text())["training"]  # the attested config (manifest-bound)
    assert (training["max_steps"], training["learning_rate"]) == (1, 0.0003)
    assert json.loads((bundle / "manifest.json").read_text())["training"]["global_step"] == 1


# ---- the owner key id pinned where the public key belongs ------------------------------------------------------------

def test_keys_new_says_which_value_to_pin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attestation.bundle.dataset_sig import owner_key_id

    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    out = capsys.readouterr().out
    pub = (tmp_path / "acme.pub").read_text().strip()
    assert f"pin the public key in the CVM config: dataset: {{owner_public_key: {pub}}}" in out
    assert f"its owner key id (a name that manifests show, not a key to pin): {owner_key_id(bytes.fromhex(pub))}" in out


def test_the_owner_key_id_pinned_as_the_public_key_is_recognised(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from attestation.bundle.dataset_sig import owner_key_id

    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    enc = tmp_path / "rows.cvmds"
    assert main(["dataset", "encrypt", str(rows), "-o", str(enc), "--owner-key", str(tmp_path / "acme.key"),
                 "--key-file", str(tmp_path / "rows.key"), "--dataset-id", "d", "--dataset-version", "1"]) == 0
    key_id = owner_key_id(bytes.fromhex((tmp_path / "acme.pub").read_text().strip()))
    capsys.readouterr()
    assert main(["dataset", "inspect", str(enc), "--owner-public-key", key_id]) == DatasetSignatureError.exit_code
    err = capsys.readouterr().err
    assert "is that key's owner key id, not the public key" in _one_error(err) and "content of the owner's .pub" in err
    # the pipeline's reader says the same of a CVM config that pins the key id (dataset.owner_public_key)
    from app.dataset import open_encrypted

    key = bytes.fromhex((tmp_path / "rows.key").read_text().strip())
    with pytest.raises(DatasetSignatureError) as exc, enc.open("rb") as f:
        open_encrypted(f, key, owner_public_key=bytes.fromhex(key_id))
    assert type(exc.value) is DatasetSignatureError and "owner key id, not the public key" in exc.value.message
    other = bytes(32)  # simply another key: no such hint
    with pytest.raises(DatasetSignatureError) as exc, enc.open("rb") as f:
        open_encrypted(f, key, owner_public_key=other)
    assert f"not by the pinned key {owner_key_id(other)[:16]}" in exc.value.message


# ---- a long $TMPDIR, and a SIGTERM, leave nothing behind ----------------------------------------------------------------

def test_the_embedded_simulator_runs_under_a_long_tmpdir(tmp_path: Path) -> None:
    """A socket path under a $TMPDIR this long would not fit in sun_path: the simulator's goes to /tmp instead."""
    from app.config import TeeSettings
    from app.simulator.server import MAX_SOCKET_PATH
    from app.tee import open_guest_agent

    long_tmp = tmp_path / ("t" * (MAX_SOCKET_PATH - len(str(tmp_path)) - 20))
    long_tmp.mkdir()
    env_before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(long_tmp)
    import tempfile

    tempfile.tempdir = None  # read $TMPDIR again
    try:
        with open_guest_agent(TeeSettings()) as agent:
            assert agent.identity().app_id
            assert not str(agent.endpoint).startswith(str(long_tmp))
    finally:
        if env_before is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = env_before
        tempfile.tempdir = None
    assert list(long_tmp.iterdir()) == []


def test_sigterm_stops_bundles_serve_with_exit_0_and_leaves_no_temp_directory(tmp_path: Path) -> None:
    import signal

    tok, out, temp = _token(tmp_path), tmp_path / "out", tmp_path / "temp"
    out.mkdir()
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "app", "bundles", "serve", "--output", str(out), "--token-file",
                             str(tok), "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(temp)}, cwd=tmp_path)
    try:
        assert "bundle server (read-only) on http://127.0.0.1:" in proc.stdout.readline()
        assert [p.name.startswith("cvm-tune-") for p in temp.iterdir()] == [True]  # its private cache directory
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert list(temp.iterdir()) == []
