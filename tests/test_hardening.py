"""Hostile-run findings: the lock cannot be side-stepped, every bad input gets its documented exit code
and nothing is written for it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from app.cli import main
from app.config import Config
from app.scheduler import serve
from app.state import Locked, RunDB, run_lock


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")} if root.exists() else set()


# --- the single-run lock -----------------------------------------------------------------------------------


def test_deleting_state_lock_does_not_release_the_run_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = Config.model_validate({"output": {"dir": str(tmp_path / "out")}})
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with run_lock(cfg.output.dir):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    try:
        lock_file = tmp_path / "out" / "state" / "lock"
        lock_file.unlink()  # a stray rm while a run holds the lock
        lock_file.write_text("999999\n")  # even replaced by another file
        assert serve(cfg, once=True, progress=lambda _m: None) == "skipped: locked"
        cfg_file = tmp_path / "cfg.yaml"
        cfg_file.write_text(f"output:\n  dir: {tmp_path / 'out'}\n")
        assert main(["run", "--config", str(cfg_file)]) == 0
        assert "skipped: locked" in capsys.readouterr().out
        with pytest.raises(Locked):
            with run_lock(cfg.output.dir):
                pass
    finally:
        release.set()
        t.join()
    assert not RunDB(cfg.output.dir).recent()  # the refused ones wrote nothing
    assert not list((tmp_path / "out" / "runs").glob("*")) if (tmp_path / "out" / "runs").exists() else True
    with run_lock(cfg.output.dir):  # released with its holder
        assert (tmp_path / "out" / "state" / "lock").read_text() == f"{os.getpid()}\n"


# --- bad input: exact exit code, one error line and a fix, nothing written --------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _two_lines(err: str, *words: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("fix: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], err


BAD_CONFIGS = {
    "inf": (b"training:\n  learning_rate: .inf\n", "learning_rate"),
    "nan": (b"training:\n  learning_rate: .nan\n", "finite"),
    "bool-as-int": (b"training:\n  max_steps: true\n", "true/false"),
    "duplicate-key": (b"training:\n  max_steps: 3\n  max_steps: 4\n", "duplicate key 'max_steps'"),
    "huge-float": (b"training:\n  max_steps: 1.0e+32\n", "out of range"),
    "huge-int": (b"training:\n  per_device_batch_size: 100000000000000000000\n", "out of range"),
    "non-utf8": (b"training:\n  seed: \xff\xfe\n", "not UTF-8"),
    "deep": (b"a: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested deeper"),
    "big": (b"# padding\n" * 200_000, "larger than"),
    "alias": (b"a: &x [1]\nb: *x\n", "alias"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_exit_2_and_writes_nothing(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body, words = BAD_CONFIGS[name]
    body = body.replace(b"training:", f"output:\n  dir: {tmp_path / 'out'}\ntraining:".encode(), 1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(body)
    before = _tree(tmp_path)
    for cmd in (["validate-config", str(cfg)], ["run", "--config", str(cfg)], ["status", "--config", str(cfg)]):
        rc, _out, err = _run(capsys, *cmd)
        assert rc == 2, (cmd, err)
        _two_lines(err, words)
    assert _tree(tmp_path) == before


def test_config_fifo_is_refused_without_blocking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    rc, _out, err = _run(capsys, "validate-config", str(fifo))
    assert rc == 2
    _two_lines(err, "not a regular file")


def test_output_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").write_text("not a directory")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\n")
    before = _tree(tmp_path)
    for cmd in ("run", "status", "serve"):
        rc, _out, err = _run(capsys, cmd, "--config", str(cfg), *(["--once"] if cmd == "serve" else []))
        assert rc == 2, (cmd, err)
        _two_lines(err, "is not a directory")
    assert _tree(tmp_path) == before


def test_status_never_creates_the_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\n")
    for extra in ([], ["--json"], ["--health"]):
        rc, out, _err = _run(capsys, "status", "--config", str(cfg), *extra)
        assert rc == (1 if extra == ["--health"] else 0)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ["status", "-n", "99999999999999999999"], ["status", "-n", "-1"], ["status", "-n", "0"],
    ["verify", "x", "--now", "99999999999999999999"], ["verify-quote", "x", "--now", "99999999999999999999"],
    ["verify", "x", "--now", "-5"],
])
def test_numeric_arguments_are_range_checked(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "outside" in capsys.readouterr().err
    assert _tree(tmp_path) == set()


def test_damaged_run_database_is_a_state_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    db = RunDB(out)
    for i in range(400):  # several pages
        db.upsert(f"nightly-{i:04d}", slot=f"s{i:04d}", slot_time="2026-11-20T02:00:00Z", status="succeeded",
                  reason="x" * 200)
    db.close()
    path = out / "state" / "runs.sqlite"
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page:4 * page] = bytes([0xA5]) * page  # a flipped page in the table's B-tree
    path.write_bytes(bytes(data))
    for name in ("runs.sqlite-wal", "runs.sqlite-shm"):
        (out / "state" / name).unlink(missing_ok=True)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {out}\n")
    rc, _out, err = _run(capsys, "status", "--config", str(cfg))
    assert rc == 7
    _two_lines(err, "run database")


def test_debug_keeps_the_exit_code_and_adds_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = _run(capsys, "--debug", "verify", str(tmp_path / "nonexistent"))
    assert rc == 2 and "Traceback" in err and "error: " in err
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\ndataset:\n  source: encrypted-file\n  path: {tmp_path / 'd.cvmds'}\n"
                   f"  key:\n    source: file\n    file: {tmp_path / 'missing.key'}\n")
    rc, _out, err = _run(capsys, "--debug", "run", "--config", str(cfg))
    assert rc == 4 and "Traceback" in err
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 4 and "Traceback" not in err


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo"])
def test_dataset_path_that_is_not_a_file_is_a_data_error(kind: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from app.dataset import write_key_file

    key = tmp_path / "k.key"
    write_key_file(key, os.urandom(32))
    ds = tmp_path / "d.cvmds"
    if kind == "directory":
        ds.mkdir()
    elif kind == "fifo":
        os.mkfifo(ds)  # open() would block forever (while holding the lock)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\ndataset:\n  source: encrypted-file\n  path: {ds}\n"
                   f"  key:\n    source: file\n    file: {key}\n")
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 3
    _two_lines(err, "dataset")
    assert list((tmp_path / "out" / "exports").iterdir()) == []
    assert not list((tmp_path / "out" / "runs").iterdir())


def test_scratch_dir_must_exist_and_be_ram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.fsutil import filesystem_type, scratch_dir

    missing = tmp_path / "no" / "such" / "scratch"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\n  scratch_dir: {missing}\n")
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 2
    _two_lines(err, "does not exist")
    assert not (tmp_path / "no").exists()  # never created
    assert _tree(tmp_path / "out") <= {"state", "state/lock"}  # only the run lock was taken: nothing else written
    disk = tmp_path / "disk-scratch"
    disk.mkdir()
    if filesystem_type(disk) in ("tmpfs", "ramfs"):
        pytest.skip("the test's temp directory is itself a tmpfs")
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\n  scratch_dir: {disk}\n")
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 2
    _two_lines(err, "not tmpfs")
    assert _tree(tmp_path / "out") <= {"state", "state/lock"} and list(disk.iterdir()) == []
    out = (tmp_path / "out").resolve()
    assert scratch_dir(disk, out, unsafe_ok=True).parent == disk.resolve()  # the explicit opt-in
    if Path("/dev/shm").is_dir() and filesystem_type(Path("/dev/shm")) == "tmpfs":
        assert scratch_dir(None, out).parent == Path("/dev/shm").resolve()


def test_stale_simulator_temp_dirs_are_removed(tmp_path: Path) -> None:
    from app.fsutil import remove_dead_pid_dirs

    dead = tmp_path / "cvm-tune-sim-999999999-abc"  # no such pid
    alive = tmp_path / f"cvm-tune-sim-{os.getpid()}-def"
    other = tmp_path / "cvm-tune-simx"
    for d in (dead, alive, other):
        d.mkdir()
    (dead / "dstack.sock").write_text("")
    assert remove_dead_pid_dirs(tmp_path, "cvm-tune-sim-") == [dead.name]
    assert not dead.exists() and alive.exists() and other.exists()


# --- bundles and verifier inputs ----------------------------------------------------------------------------


def _copy(bundle: Path, tmp: Path) -> Path:
    import shutil

    dst = tmp / bundle.name
    shutil.copytree(bundle, dst)
    return dst


@pytest.mark.parametrize("extra", ["adapter/sub", "extra", "report/deeper/still"])
def test_bundle_with_an_empty_directory_is_rejected(extra: str, sim_bundle: dict, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    b = _copy(sim_bundle["dir"], tmp_path)
    (b / extra).mkdir(parents=True)
    rc, out, _err = _run(capsys, "verify", str(b), "--policy", str(sim_bundle["policy"]))
    assert rc == 1 and f"unexpected directory {extra.split('/')[0] if extra.startswith('extra') else extra}" in out


@pytest.mark.parametrize("size", [0, 100, 10 << 20])
def test_bundle_quote_bin_damaged_or_oversized_is_rejected(size: int, sim_bundle: dict, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    b = _copy(sim_bundle["dir"], tmp_path)
    original = (b / "quote.bin").read_bytes()
    (b / "quote.bin").write_bytes((original * (size // len(original) + 1))[:size])
    rc, out, err = _run(capsys, "verify", str(b), "--policy", str(sim_bundle["policy"]))
    assert rc == 1 and "FAIL quote.parse" in out and "Traceback" not in err
    if size > 4 << 20:
        assert "too large" in out


def test_bundle_quote_bin_fifo_does_not_block(sim_bundle: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _copy(sim_bundle["dir"], tmp_path)
    (b / "quote.bin").unlink()
    os.mkfifo(b / "quote.bin")
    rc, out, _err = _run(capsys, "verify", str(b), "--policy", str(sim_bundle["policy"]))
    assert rc == 1 and "symlink or special file" in out


def test_deep_manifest_is_an_input_error(sim_bundle: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _copy(sim_bundle["dir"], tmp_path)
    (b / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, _out, err = _run(capsys, "verify", str(b), "--policy", str(sim_bundle["policy"]))
    assert rc == 2
    _two_lines(err, "nested deeper")


def test_deep_policy_and_event_log_are_input_errors(sim_bundle: dict, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    rc, _out, err = _run(capsys, "verify", str(sim_bundle["dir"]), "--policy", str(policy))
    assert rc == 2
    _two_lines(err, "nested deeper")
    log = tmp_path / "log.json"
    log.write_text("[" * 100_000 + "]" * 100_000)
    rc, _out, err = _run(capsys, "verify-quote", str(sim_bundle["dir"] / "quote.bin"), "--event-log", str(log),
                         "--policy", str(sim_bundle["policy"]))
    assert rc == 2
    _two_lines(err, "nested deeper")
    dup = tmp_path / "dup.yaml"
    dup.write_text(sim_bundle["policy"].read_text() + "\nname: again\n")
    rc, _out, err = _run(capsys, "verify", str(sim_bundle["dir"]), "--policy", str(dup))
    assert rc == 2
    _two_lines(err, "duplicate key")


def test_verify_with_missing_dataset_or_base_model_is_an_input_error(sim_bundle: dict, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for flag, words in (("--dataset", "missing"), ("--base-model", "missing")):
        rc, _out, err = _run(capsys, "verify", str(sim_bundle["dir"]), "--policy", str(sim_bundle["policy"]), flag,
                             str(tmp_path / "nonexistent"))
        assert rc == 2, (flag, err)
        _two_lines(err, words)


def test_verify_into_a_closed_pipe_keeps_the_verdict(sim_bundle: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    for policy, want in ((sim_bundle["policy"], 0), (None, 1)):
        r, w = os.pipe()
        os.close(r)  # `| head -1` already exited
        stream = io.TextIOWrapper(os.fdopen(w, "wb", buffering=0), write_through=True)
        monkeypatch.setattr(sys, "stdout", stream)
        argv = ["verify", str(sim_bundle["dir"]), *(["--policy", str(policy)] if policy else [])]
        assert main(argv) == want  # accepted stays 0, rejected stays 1; never 70
        print("after the pipe closed")  # stdout now points at /dev/null: no error at exit
        stream.close()
        monkeypatch.undo()


def test_disk_full_outside_a_wrapped_write_is_a_state_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import app.training.tiny_model as tiny

    def full(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny, "fsync_tree", full)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\n")
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 7
    _two_lines(err, "tiny base model", "No space left")
    assert list((tmp_path / "out" / "exports").iterdir()) == []


# --- tampered state ----------------------------------------------------------------------------------------------


def test_deleting_dataset_versions_does_not_reopen_a_rollback(sim_bundle: dict, tmp_path: Path) -> None:
    import shutil

    from app.dataset.versions import check_version
    from app.errors import DatasetRollbackError

    state = tmp_path / "state"
    shutil.copytree(sim_bundle["dir"].parent.parent / "state", state)
    (state / "dataset-versions.json").unlink()  # the tamper
    start = json.loads((sim_bundle["dir"] / "audit.jsonl").read_text().splitlines()[0])["data"]
    ds_id, version = start["dataset_id"], start["dataset_version"]
    with pytest.raises(DatasetRollbackError):  # the same version with other content: refused from the audit chain
        check_version(state, ds_id, version, "0" * 64)
    assert check_version(state, ds_id, version, start["dataset_plaintext_sha256"]) == version
    assert check_version(state, ds_id, version + 1, "1" * 64) == version


def test_a_recovered_run_row_keeps_steps_loss_and_audit_head(sim_bundle: dict, tmp_path: Path) -> None:
    import shutil

    from app.scheduler import Service

    out = tmp_path / "out"
    cfg = Config.model_validate({"output": {"dir": str(out)}})
    svc = Service(cfg, runner=lambda **_kw: pytest.fail("must not train again"))
    slot = svc.schedule.due(svc.clock.now())
    shutil.copytree(sim_bundle["dir"], out / "exports" / slot.run_id)  # exported, then kill -9 before the DB write
    assert svc.tick() == f"recovered: {slot.run_id}"
    row = svc.db.get(slot.run_id)
    manifest = json.loads((out / "exports" / slot.run_id / "manifest.json").read_text())
    assert row.status == "succeeded" and row.audit_head == manifest["audit"]["head"]
    assert row.metrics["losses"] and row.metrics["run_id"] == manifest["run_id"]


def test_scratch_full_while_saving_a_checkpoint_is_a_state_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import transformers

    def full(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", full)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"output:\n  dir: {tmp_path / 'out'}\ntraining:\n  max_steps: 2\n  save_steps: 1\n")
    rc, _out, err = _run(capsys, "run", "--config", str(cfg))
    assert rc == 7
    _two_lines(err, "checkpoint", "No space left")
    assert "training and base_model settings" not in err
    assert list((tmp_path / "out" / "exports").iterdir()) == []
