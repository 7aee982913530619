"""A run never publishes a bundle that fails its own verification; a resume after a change outside
``training``/``base_model`` stays verifiable; a resume after a change that shapes the adapter is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

import app.training
from app.cli import main
from app.config import Config
from app.tee import GuestAgent
from attestation.bundle import manifest as B


def _cfg(tmp: Path, **output: object) -> Path:
    data = {"output": {"dir": str(tmp / "out"), **output}, "training": {"max_steps": 8, "save_steps": 4}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _stop_after(monkeypatch: pytest.MonkeyPatch, step: int):
    real = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real(dataclasses.replace(req, stop_after_step=step)))
    return real


def _exports(tmp: Path) -> list[Path]:
    return sorted((tmp / "out" / "exports").iterdir())


def _policy(tmp: Path) -> list[str]:
    return ["--policy", str(tmp / "out" / "simulator-test-policy.yaml")]


def test_training_config_hash_is_recomputable_from_the_bundle_config() -> None:
    cfg = Config()
    assert B.training_config_sha256(cfg.canonical_json()) == __import__("hashlib").sha256(cfg.training_json()).hexdigest()
    assert B.training_config_sha256(b"{not json") == "invalid"


def test_resume_after_a_change_outside_training_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _stop_after(monkeypatch, 4)
    assert main(["run", "--config", str(_cfg(tmp_path)), "--run-id", "r1"]) == 6
    monkeypatch.setattr(app.training, "train", real)
    assert main(["run", "--config", str(_cfg(tmp_path, keep_checkpoints=7)), "--run-id", "r1"]) == 0
    (bundle,) = _exports(tmp_path)
    entries = [json.loads(line) for line in (bundle / B.AUDIT).read_text().splitlines()]
    start, resume = (e for e in entries if e["type"] in ("run.start", "run.resume"))
    assert start["data"]["config_sha256"] != resume["data"]["config_sha256"]
    assert start["data"]["training_config_sha256"] == resume["data"]["training_config_sha256"]
    assert main(["verify", str(bundle), *_policy(tmp_path)]) == 0


def test_resume_after_a_training_change_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _stop_after(monkeypatch, 4)
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 6
    doc = yaml.safe_load(cfg.read_text())
    doc["training"]["learning_rate"] = 1e-3
    cfg.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 7
    assert "started with other inputs" in capsys.readouterr().err
    assert _exports(tmp_path) == []


def test_a_bundle_failing_its_own_verification_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    real_quote = GuestAgent.quote

    def broken(self: GuestAgent, rd: bytes) -> tuple[bytes, str]:  # the export's quote is over other report_data
        exporting = any(frame.function == "export_bundle" for frame in inspect.stack())
        return real_quote(self, bytes(64) if exporting else rd)

    monkeypatch.setattr(GuestAgent, "quote", broken)
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 7
    err = capsys.readouterr().err
    assert "fails its own verification" in err and "report_data" in err
    assert _exports(tmp_path) == []  # nothing published, no temp left
    from app.state import RunDB

    run = RunDB(tmp_path / "out").run("r1")
    assert run is not None and run.status == "running"  # resumable
    monkeypatch.setattr(GuestAgent, "quote", real_quote)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 0
    (bundle,) = _exports(tmp_path)
    types = [json.loads(line)["type"] for line in (bundle / B.AUDIT).read_text().splitlines()]
    assert types.count("export") == 2 and types[-1] == "export" and "run.abort" in types
    assert main(["verify", str(bundle), *_policy(tmp_path)]) == 0


def test_lock_survives_removal_of_the_state_directory(tmp_path: Path) -> None:
    import shutil

    from app.state import Locked, run_lock

    out = tmp_path / "out"
    out.mkdir()
    with run_lock(out) as info:
        assert info.read_text().strip() == str(__import__("os").getpid())
        shutil.rmtree(out / "state")  # a stray rm cannot hand out a second lock
        with pytest.raises(Locked):
            with run_lock(out):
                pass
    with run_lock(out):  # released on exit
        pass


# --- every bad input gets its documented exit code, and nothing is written ---------------------------------------

@pytest.fixture
def demo(demo_bundle: tuple[Path, Path]) -> tuple[Path, Path]:
    return demo_bundle


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")} if root.exists() else set()


def _write(tmp: Path, text: str | bytes, name: str = "c.yaml") -> str:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


CONFIG_CASES = {
    "not UTF-8": b"output: {dir: \xff\xfe}\n",
    "100k deep": "a: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "33 levels deep": "a: " + "[" * 33 + "]" * 33 + "\n",
    "duplicate key": "training: {max_steps: 3}\ntraining: {max_steps: 4}\n",
    "duplicate nested key": "training: {max_steps: 3, max_steps: 4}\n",
    "learning_rate .inf": "training: {learning_rate: .inf}\n",
    "learning_rate .nan": "training: {learning_rate: .nan}\n",
    "max_steps true": "training: {max_steps: true}\n",
    "max_steps 1e32": "training: {max_steps: 1e32}\n",
    "batch 1e20": "training: {per_device_batch_size: 100000000000000000000}\n",
    "over 1 MiB": "# " + "x" * (1 << 20) + "\n",
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_exit_2_and_writes_nothing(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, CONFIG_CASES[case])
    before = _files(tmp_path)
    for command in ("run", "validate-config", "status"):
        assert main([command, "--config", cfg] if command != "validate-config" else [command, cfg]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err
    assert _files(tmp_path) == before


def test_bad_paths_and_arguments(tmp_path: Path, demo: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import os

    bundle, policy = demo
    key = tmp_path / "k"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")

    configs = iter(range(100))

    def run_cfg(**sections: object) -> list[str]:
        data = {"output": {"dir": str(tmp_path / "out")}, **sections}
        return ["run", "--config", _write(tmp_path, yaml.safe_dump(data), f"run{next(configs)}.yaml")]

    def dataset(path: Path) -> dict:
        return {"source": "encrypted-file", "path": str(path), "key": {"source": "file", "file": str(key)}}

    cases = [
        (run_cfg(dataset=dataset(tmp_path / "missing.cvmds")), 3, "does not exist"),
        (run_cfg(dataset=dataset(tmp_path)), 2, "is a directory: set dataset.dataset_id"),
        (run_cfg(dataset=dataset(tmp_path / "fifo")), 3, "is a FIFO"),  # refused without blocking
        (["run", "--config", _write(tmp_path, f"output: {{dir: {tmp_path / 'file'}}}\n", "f.yaml")], 2, "not a directory"),
        (["status", "--config", _write(tmp_path, f"output: {{dir: {tmp_path / 'file'}}}\n", "f.yaml")], 2, "not a directory"),
        (run_cfg(output={"dir": str(tmp_path / "out"), "scratch_dir": str(tmp_path / "no" / "such")}), 2, "never creates it"),
        (run_cfg(output={"dir": str(tmp_path / "out"), "scratch_dir": str(tmp_path)}), 2, "not in RAM"),
        (["verify", str(bundle), "--policy", str(policy), "--dataset", str(tmp_path / "missing.cvmds")], 2, "missing"),
        (["verify", str(bundle), "--policy", str(policy), "--base-model", str(tmp_path / "missing")], 2, "missing"),
        (["verify", str(bundle), "--now", "99999999999999999999"], 2, "outside"),
        (["verify-quote", str(bundle / "quote.bin"), "--now", "-1"], 2, "outside"),
        (["status", "-n", "99999999999999999999"], 2, "outside"),
        (["status", "-n", "-1"], 2, "outside"),
        (["--debug", "run"] + run_cfg(dataset={**dataset(tmp_path / "x"), "key": {"source": "file", "file": str(tmp_path / "nokey")}})[1:], 4, "key file"),
        (["--debug", "verify", str(tmp_path / "nonexistent")], 2, "not a directory"),
    ]
    before = _files(tmp_path)
    assert {'k', 'fifo', 'file', 'run0.yaml'} <= before
    for argv, code, words in cases:
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code
        err = capsys.readouterr().err
        assert (rc, words in err) == (code, True), (argv, err)
        assert ("Traceback" in err) == ("--debug" in argv), argv
    after = _files(tmp_path)
    assert {f for f in after - before if not f.startswith("out/")} <= {"out"}  # nothing outside the volume, no scratch
    assert not [f for f in after if f.startswith(("out/exports/", "out/runs/", "out/datasets/"))]  # nothing run or exported


def test_status_reads_without_creating_the_volume_and_reports_a_damaged_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    cfg = _write(tmp_path, f"output: {{dir: {out}}}\n")
    assert main(["status", "--config", cfg]) == 0 and not out.exists()
    from app.state import RunDB

    db = RunDB(out)
    for i in range(40):  # enough rows for the table to span several pages
        db.upsert(f"run-{i:03}", slot=f"2026-11-{i:03}", slot_time="t", status="succeeded", reason="x" * 300)
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    path = out / "state" / "runs.sqlite"
    data = bytearray(path.read_bytes())
    data[4096:] = bytes(b ^ 0x5A for b in data[4096:])  # every page after the schema page flipped
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["status", "--config", cfg]) == 7
    err = capsys.readouterr().err
    assert err.startswith("error: run database") and "Traceback" not in err


BUNDLE_DAMAGE = {
    "empty quote.bin": lambda b: (b / "quote.bin").write_bytes(b""),
    "10 MB quote.bin": lambda b: (b / "quote.bin").write_bytes(bytes(10 << 20)),
    "empty directory adapter/sub": lambda b: (b / "adapter" / "sub").mkdir(),
    "empty directory extra": lambda b: (b / "extra").mkdir(),
    "manifest 100k deep": lambda b: (b / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
    "manifest 40 deep": lambda b: (b / "manifest.json").write_text("[" * 40 + "]" * 40),
}


@pytest.mark.parametrize("case", sorted(BUNDLE_DAMAGE))
def test_damaged_bundle_is_rejected_not_an_internal_error(case: str, tmp_path: Path, demo: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    bundle, policy = demo
    copy = tmp_path / bundle.name
    shutil.copytree(bundle, copy)
    assert main(["verify", str(copy), "--policy", str(policy)]) == 0
    BUNDLE_DAMAGE[case](copy)
    capsys.readouterr()
    assert main(["verify", str(copy), "--policy", str(policy)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("REJECTED") and "FAIL" in out


def test_rerunning_an_exported_run_names_its_bundle(tmp_path: Path, demo: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bundle, _ = demo
    cfg = _write(tmp_path, yaml.safe_dump({"output": {"dir": str(bundle.parent.parent)}, "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", cfg, "--run-id", bundle.name]) == 7
    err = capsys.readouterr().err
    assert str(bundle) in err and "new --run-id" in err


def test_verify_into_a_closed_pipe_keeps_the_verdict(demo: tuple[Path, Path], tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    bundle, policy = demo
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    script = ("import sys; from app.cli import main; sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1, closefd=False); "
              "sys.exit(main(sys.argv[1:]))")
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", script, "verify", str(bundle), "--policy", str(policy)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        p.stdout.close()  # the reader is gone before the verdict is printed
        err = p.stderr.read().decode()
        assert p.wait(60) == 0, err
        assert "internal error" not in err and "Traceback" not in err


def test_deleted_version_record_is_rebuilt_from_the_audit_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    from importlib import resources

    from app.dataset import encrypt_file, write_key_file

    key = os.urandom(32)
    write_key_file(tmp_path / "key", key)
    sample = Path(str(resources.files("app") / "data" / "sample.jsonl"))
    for version in (1, 2):
        encrypt_file(sample, tmp_path / f"v{version}.cvmds", key, dataset_id="rows", dataset_version=version)

    def run(version: int) -> int:
        cfg = {"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 1, "save_steps": 1},
               "dataset": {"source": "encrypted-file", "path": str(tmp_path / f"v{version}.cvmds"),
                           "key": {"source": "file", "file": str(tmp_path / "key")}}}
        return main(["run", "--config", _write(tmp_path, yaml.safe_dump(cfg))])

    assert run(2) == 0
    versions = tmp_path / "out" / "state" / "dataset-versions.json"
    versions.unlink()  # tampered state: the rollback record removed
    exports = _files(tmp_path / "out" / "exports")
    capsys.readouterr()
    assert run(1) == 3  # DatasetRollbackError: the chain still says v2 was trained
    out, err = capsys.readouterr()
    assert "rebuilt 1 dataset version(s) from the audit chain" in out and "older than v2" in err
    assert _files(tmp_path / "out" / "exports") == exports
    assert json.loads(versions.read_text())["datasets"]["rows"]["version"] == 2


def test_latest_pointer_replaced_by_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    real = _stop_after(monkeypatch, 4)
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 6
    latest = tmp_path / "out" / "runs" / "r1" / "checkpoints" / "LATEST"
    latest.unlink()
    latest.mkdir()  # tampered: the pointer is now a directory
    monkeypatch.setattr(app.training, "train", real)
    capsys.readouterr()
    rc = main(["run", "--config", str(cfg), "--run-id", "r1"])
    err = capsys.readouterr().err
    assert rc == 7 and "LATEST" in err and "internal error" not in err
    assert _exports(tmp_path) == []


def test_disk_full_while_training_or_building_the_model_is_a_state_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import torch
    import transformers

    def full(*_a: object, **_k: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: "
                           "file write failed")

    monkeypatch.setattr(torch, "save", full)  # the optimizer state of the first checkpoint cannot be written
    assert main(["run", "--config", str(_cfg(tmp_path))]) == 7
    err = capsys.readouterr().err
    assert "writing a checkpoint or the adapter failed" in err and "free space" in err
    assert _exports(tmp_path) == []
    monkeypatch.undo()

    def no_space(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", no_space)
    out2 = tmp_path / "second"
    out2.mkdir()
    assert main(["run", "--config", str(_cfg(out2))]) == 7
    err = capsys.readouterr().err
    assert "building the tiny base model" in err and "No space left on device" in err
    assert not (out2 / "out" / "models" / "tiny-llama").exists()


def test_a_policy_root_that_does_not_anchor_the_chains_is_rejected_without_calling_dcap_qvl(
        tmp_path: Path, demo: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the CLI fuzz suite: with this root (two subject bytes changed), dcap-qvl's certificate library hit an
    assertion in its CRL path and aborted the whole process. The chains are checked first; dcap-qvl never sees it."""
    bundle, policy = demo
    doc = yaml.safe_load(policy.read_text())
    der = bytearray.fromhex(doc["trusted_root"]["der_hex"])
    der[95] ^= 162
    der[213] ^= 215
    doc["trusted_root"]["der_hex"] = der.hex()
    bad = tmp_path / "policy.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["verify", str(bundle), "--policy", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "quote.signature: not checked" in out


def test_stale_simulator_socket_dirs_are_removed_live_ones_kept(sock_dir: Path) -> None:
    import socket

    from app.simulator.sockets import remove_stale_simulator_dirs

    stale, live, fresh = (sock_dir / f"cvm-tune-sim-{n}" for n in ("stale", "live", "fresh"))
    for d in (stale, live, fresh):
        d.mkdir()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(stale / "dstack.sock"))
    dead.close()  # what a kill -9 leaves: the socket file, nobody listening
    alive = socket.socket(socket.AF_UNIX)
    alive.bind(str(live / "dstack.sock"))
    alive.listen()
    try:
        assert remove_stale_simulator_dirs(sock_dir) == ["cvm-tune-sim-stale"]
        assert live.is_dir() and fresh.is_dir() and not stale.exists()
    finally:
        alive.close()


def test_a_simulator_too_busy_to_answer_is_not_judged_stale(sock_dir: Path) -> None:
    """Liveness is the owner's lock: a socket that does not answer (a loaded machine) is kept while the lock is held,
    and removed once the owner is gone."""
    import socket

    from app.simulator.sockets import SIM_DIR_PREFIX, hold_owner_lock, remove_stale_simulator_dirs

    busy = sock_dir / f"{SIM_DIR_PREFIX}busy"
    busy.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(busy / "dstack.sock"))  # bound, not listening: a connect is refused, as under load it times out
    try:
        with hold_owner_lock(busy):
            assert remove_stale_simulator_dirs(sock_dir) == []
            assert (busy / "dstack.sock").exists()
        assert remove_stale_simulator_dirs(sock_dir) == [busy.name]  # the owner let go: now it is stale
        assert not busy.exists()
    finally:
        sock.close()


def test_a_simulator_directory_being_set_up_is_never_judged_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's clean-up running at the worst moment, when the new owner is about to take its lock, keeps
    the directory: ``owner.lock`` never exists unlocked (an unlocked one reads as a dead owner)."""
    import fcntl

    from app.simulator.sockets import SIM_DIR_PREFIX, hold_owner_lock, remove_stale_simulator_dirs

    new = tmp_path / f"{SIM_DIR_PREFIX}new"
    new.mkdir()
    real, removed = fcntl.flock, []

    def flock(fd: int, op: int) -> None:
        if not op & fcntl.LOCK_NB:  # the owner's blocking lock: first, a concurrent clean-up
            removed.extend(remove_stale_simulator_dirs(tmp_path))
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with hold_owner_lock(new):
        assert removed == [] and new.is_dir()
        assert remove_stale_simulator_dirs(tmp_path) == [] and sorted(p.name for p in new.iterdir()) == ["owner.lock"]


def test_status_lists_ad_hoc_runs(tmp_path: Path, demo: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bundle, _ = demo
    cfg = _write(tmp_path, yaml.safe_dump({"output": {"dir": str(bundle.parent.parent)}}))
    capsys.readouterr()
    assert main(["status", "--config", cfg]) == 0
    text = capsys.readouterr().out
    assert "no runs yet" not in text and "ad-hoc runs (cvm-tune run)" in text
    assert f"{bundle.name}  exported" in text and str(bundle) in text
    assert main(["status", "--config", cfg, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in doc["adhoc_runs"]] == [bundle.name] and doc["runs"] == []
