"""Property-based CLI fuzzing: valid inputs, mutated, through the real commands in-process.

For every mutated config, policy, manifest, quote, event log and dataset file the command must exit
with a code documented for it (docs/exit-codes.md), never 70, print no traceback (``--debug`` is not
passed), create no file outside the output directory, and export nothing. The fast profile runs in
the default suite; ``-m slow`` runs the long one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cli import main

FAST = settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# The documented exit codes per command (docs/exit-codes.md).
CODES = {"validate-config": {0, 2}, "status": {0, 2, 7}, "verify": {0, 1, 2}, "verify-quote": {0, 1, 2},
         "dataset inspect": {0, 2, 3, 4}, "run": {0, 2, 3, 4, 5, 6, 7}}
DOC = Path(__file__).resolve().parent.parent / "docs" / "exit-codes.md"

# ---- mutation strategies ------------------------------------------------------------------------------------

ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.just("[" * 200 + "]" * 200), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: bytes) -> bytes:
    """Byte-level damage: flip, truncate, insert, delete, duplicate, or replace the whole file."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate", "replace"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "duplicate":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 256))]
        else:
            data = bytearray(draw(st.binary(max_size=256)))
    return bytes(data)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:20]):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated_tree(draw: st.DrawFn, valid: Any) -> Any:
    """Structural damage: replace, delete or add a value somewhere in a parsed JSON/YAML document."""
    obj = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(obj))
        path = draw(st.sampled_from(paths))
        if not path:
            obj = draw(ODD_VALUES)
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        if op == "replace":
            parent[path[-1]] = draw(ODD_VALUES)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(ODD_VALUES)
    return obj


def _dump_json(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _dump_yaml(obj: Any) -> bytes:
    return yaml.safe_dump(obj, allow_unicode=True).encode()


def mutated_doc(valid: bytes, loads: Callable[[bytes], Any], dumps: Callable[[Any], bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated_bytes(valid), mutated_tree(loads(valid)).map(dumps))


# ---- running a command in a sandbox ---------------------------------------------------------------------------


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def run_cli(argv: list[str], cwd: Path, out_dir: Path | None = None) -> tuple[int, str, str]:
    """``main(argv)`` in ``cwd``; asserts the properties every command shares."""
    before = {p for p in _files(cwd) if out_dir is None or not (cwd / p).is_relative_to(out_dir)}
    exports = _files(out_dir / "exports") if out_dir is not None and (out_dir / "exports").is_dir() else set()
    stdout, stderr = io.StringIO(), io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(old)
    err = stderr.getvalue()
    command = " ".join(argv[:2]) if argv[0] == "dataset" else argv[0]
    assert rc in CODES[command], (argv, rc, err)
    assert rc != 70 and "Traceback" not in err and "internal error" not in err, (argv, err)
    after = {p for p in _files(cwd) if out_dir is None or not (cwd / p).is_relative_to(out_dir)}
    assert after == before, ("files written outside the output dir", sorted(after - before))
    if out_dir is not None and (out_dir / "exports").is_dir():
        assert _files(out_dir / "exports") == exports, "exported from bad input"
    return rc, stdout.getvalue(), err


@contextlib.contextmanager
def sandbox() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cvm-tune-fuzz-") as tmp:
        yield Path(tmp)


# ---- targets ----------------------------------------------------------------------------------------------------

VALID_CONFIG = yaml.safe_dump({
    "output": {"dir": "OUT", "keep_checkpoints": 2},
    "training": {"max_steps": 4, "save_steps": 2, "learning_rate": 0.001, "seed": 7},
    "schedule": {"time": "02:00", "timezone": "UTC"},
    "dataset": {"source": "bundled-sample", "dedup": True},
}).encode()


def check_config(body: bytes) -> None:
    with sandbox() as tmp:
        out = tmp / "out"
        cfg = tmp / "cfg.yaml"
        cfg.write_bytes(body.replace(b"OUT", str(out).encode()))
        run_cli(["validate-config", str(cfg)], tmp, out)
        rc, _o, _e = run_cli(["status", "--config", str(cfg)], tmp, out)
        assert not out.exists()  # status never creates the output dir


def _bundle_case(sim_bundle: dict[str, Path], name: str, body: bytes, *extra: str) -> int:
    with sandbox() as tmp:
        b = tmp / "bundle"
        shutil.copytree(sim_bundle["dir"], b)
        (b / name).write_bytes(body)
        rc, _o, _e = run_cli(["verify", str(b), "--policy", str(sim_bundle["policy"]), *extra], tmp)
        return rc


def check_manifest(sim_bundle: dict[str, Path], body: bytes) -> None:
    rc = _bundle_case(sim_bundle, "manifest.json", body)
    valid = (sim_bundle["dir"] / "manifest.json").read_bytes()
    if body != valid:
        assert rc != 0, "a changed manifest was accepted"


def check_quote_in_bundle(sim_bundle: dict[str, Path], body: bytes) -> None:
    rc = _bundle_case(sim_bundle, "quote.bin", body)
    if body != (sim_bundle["dir"] / "quote.bin").read_bytes():
        assert rc != 0, "a changed quote was accepted"


def check_event_log_in_bundle(sim_bundle: dict[str, Path], body: bytes) -> None:
    _bundle_case(sim_bundle, "event_log.json", body)


def check_policy(sim_bundle: dict[str, Path], body: bytes) -> None:
    with sandbox() as tmp:
        p = tmp / "policy.yaml"
        p.write_bytes(body)
        run_cli(["verify", str(sim_bundle["dir"]), "--policy", str(p)], tmp)


def check_quote_file(sim_bundle: dict[str, Path], quote: bytes, log: bytes) -> None:
    with sandbox() as tmp:
        (tmp / "q.bin").write_bytes(quote)
        (tmp / "log.json").write_bytes(log)
        run_cli(["verify-quote", str(tmp / "q.bin"), "--event-log", str(tmp / "log.json"),
                 "--policy", str(sim_bundle["policy"]), "--now", "1800000000"], tmp)


def check_dataset(sim_bundle: dict[str, Path], body: bytes) -> None:
    with sandbox() as tmp:
        (tmp / "d.cvmds").write_bytes(body)
        run_cli(["dataset", "inspect", str(tmp / "d.cvmds")], tmp)
        rc, _o, _e = run_cli(["verify", str(sim_bundle["dir"]), "--policy", str(sim_bundle["policy"]),
                              "--dataset", str(tmp / "d.cvmds")], tmp)
        assert rc != 0 or body == _sample_dataset(sim_bundle).read_bytes()


def _sample_dataset(sim_bundle: dict[str, Path]) -> Path:
    return next((sim_bundle["dir"].parent.parent / "datasets").glob("*.cvmds"))


def _yaml_loads(b: bytes) -> Any:
    return yaml.safe_load(b)




# ---- fast profile (default suite) -------------------------------------------------------------------------------


@FAST
@given(st.data())
def test_fuzz_config(data: st.DataObject) -> None:
    check_config(data.draw(mutated_doc(VALID_CONFIG, _yaml_loads, _dump_yaml)))


def bundle_files(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    d = sim_bundle["dir"]
    manifest = (d / "manifest.json").read_bytes()
    check_manifest(sim_bundle, data.draw(mutated_doc(manifest, json.loads, _dump_json)))
    check_quote_in_bundle(sim_bundle, data.draw(mutated_bytes((d / "quote.bin").read_bytes())))
    check_event_log_in_bundle(sim_bundle, data.draw(mutated_doc((d / "event_log.json").read_bytes(), json.loads, _dump_json)))


def policy_quote_and_dataset(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    d = sim_bundle["dir"]
    check_policy(sim_bundle, data.draw(mutated_doc(sim_bundle["policy"].read_bytes(), _yaml_loads, _dump_yaml)))
    check_quote_file(sim_bundle, data.draw(mutated_bytes((d / "quote.bin").read_bytes())),
                     data.draw(mutated_doc((d / "event_log.json").read_bytes(), json.loads, _dump_json)))
    check_dataset(sim_bundle, data.draw(mutated_bytes(_sample_dataset(sim_bundle).read_bytes())))


@FAST
@given(data=st.data())
def test_fuzz_bundle_files(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    bundle_files(sim_bundle, data)


@FAST
@given(data=st.data())
def test_fuzz_policy_quote_and_dataset(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    policy_quote_and_dataset(sim_bundle, data)


def test_the_codes_asserted_here_are_the_documented_ones() -> None:
    import re

    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = {int(n) for n in re.findall(r"(?<![\w-])(\d+)(?![\w-])", cells[1].split(";")[0])}
    for command, codes in CODES.items():
        assert rows[command] == codes, command


def test_fuzz_helpers_really_mutate() -> None:
    """The strategies produce inputs that differ from the valid ones (the properties above are not vacuous)."""
    from hypothesis import find

    assert find(mutated_bytes(b"abcdef"), lambda b: b != b"abcdef") != b"abcdef"
    assert find(mutated_tree({"a": {"b": 1}}), lambda t: t != {"a": {"b": 1}}) != {"a": {"b": 1}}


# ---- long profile (-m slow) ----------------------------------------------------------------------------------


@pytest.mark.slow
@LONG
@given(st.data())
def test_fuzz_config_long(data: st.DataObject) -> None:
    check_config(data.draw(mutated_doc(VALID_CONFIG, _yaml_loads, _dump_yaml)))


@pytest.mark.slow
@LONG
@given(data=st.data())
def test_fuzz_bundle_files_long(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    bundle_files(sim_bundle, data)


@pytest.mark.slow
@LONG
@given(data=st.data())
def test_fuzz_policy_quote_and_dataset_long(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    policy_quote_and_dataset(sim_bundle, data)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_run_with_a_damaged_dataset_long(sim_bundle: dict[str, Path], data: st.DataObject) -> None:
    """``run`` on a damaged encrypted dataset: refused before training, nothing exported."""
    from app.dataset import write_key_file

    body = data.draw(mutated_bytes(_sample_dataset(sim_bundle).read_bytes()))
    with sandbox() as tmp:
        out = tmp / "out"
        key = tmp / "k.key"
        write_key_file(key, b"\x01" * 32)
        (tmp / "d.cvmds").write_bytes(body)
        cfg = tmp / "cfg.yaml"
        cfg.write_text(yaml.safe_dump({"output": {"dir": str(out)}, "training": {"max_steps": 2, "save_steps": 2},
                                       "dataset": {"source": "encrypted-file", "path": str(tmp / "d.cvmds"),
                                                   "key": {"source": "file", "file": str(key)}}}))
        before = {p for p in _files(tmp)}
        rc, _o, _e = run_cli(["run", "--config", str(cfg)], tmp, out)
        assert rc in (3, 4)  # the key does not open it, or the file is damaged: refused before training
        assert not (out / "exports").exists() or not any((out / "exports").iterdir())
        assert {p for p in _files(tmp) if not (tmp / p).is_relative_to(out)} == before
