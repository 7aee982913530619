"""Property-based CLI fuzzing: configs, policies, manifests, quotes, event logs and dataset files derived from
valid ones by mutation, run through the real commands in-process.

For every input the command must end with an exit code from its documented set, never 70 (internal error),
print no traceback (no ``--debug``), create nothing outside its output directory, and export nothing from bad
input. The default suite runs a fast profile; ``-m slow`` runs the same properties with many more examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attestation.errors import AttestationError

from app.cli import main
from app.dataset import encrypt_file, write_key_file

FAST, LONG = 40, 300
OWN_OUTPUT = re.compile(r"(case\d+/)?out(/|$)")  # a case's own output directory
EXITS = {  # documented exit codes per command (docs/exit-codes.md)
    "validate-config": {0, 2},
    "status": {0, 2, 7},
    "run": {0, 2, 3, 4, 5, 6, 7},
    "verify": {0, 1, 2},
    "verify-quote": {0, 1, 2},
    "inspect": {0, 2, 3},
}

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
)


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """Flip, delete, insert, truncate or duplicate: 1-4 edits of ``data``."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "duplicate", "zero"]))
        pos = draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "flip" and out:
            out[pos] ^= draw(st.integers(1, 255))
        elif op == "delete":
            del out[pos:pos + draw(st.integers(1, 64))]
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif op == "truncate":
            del out[pos:]
        elif op == "duplicate":
            out[pos:pos] = out[pos:pos + draw(st.integers(1, 256))]
        elif op == "zero":
            n = draw(st.integers(1, 64))
            out[pos:pos + n] = bytes(len(out[pos:pos + n]))
    return bytes(out)


@st.composite
def tree_mutations(draw: st.DrawFn, doc: object) -> object:
    """Replace, delete or add a value somewhere in a parsed YAML/JSON document."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        node, path = doc, []
        while isinstance(node, dict | list) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
            path.append((node, key))
            node = node[key]
        if not path:
            if isinstance(doc, dict):
                doc[draw(st.text(min_size=1, max_size=10))] = draw(VALUES)
            continue
        parent, key = path[-1]
        op = draw(st.sampled_from(["replace", "delete", "wrap"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[key]
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:
            parent[key] = draw(VALUES)
    return doc


def _call(argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


def _check(command: str, argv: list[str], root: Path) -> int:
    before = _listing(root)
    code, err = _call(argv)
    assert code in EXITS[command], (argv, code, err[-2000:])
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    created = {p for p in _listing(root) - before if not OWN_OUTPUT.match(p)}
    assert not created, created
    return code


def _same_content(name: str, mutated: bytes, original: bytes) -> bool:
    """Byte-equal; for the event log (not hashed in the manifest: its events are replayed against the quote's
    RTMRs) a text that decodes to the same events counts as the same (a key repeated with its value, a field
    dstack may add in a later version and the verifier does not read)."""
    if mutated == original:
        return True
    if name != "event_log.json":
        return False
    from attestation.tdx.eventlog import parse_event_log

    try:
        return parse_event_log(mutated.decode()) == parse_event_log(original.decode())
    except (ValueError, AttestationError):
        return False


def _first_difference(a: bytes, b: bytes) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"accepted a changed file: at byte {i}: {a[max(i - 60, 0):i + 60]!r} vs {b[max(i - 60, 0):i + 60]!r}"


def _listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, demo_bundle: tuple[Path, Path]) -> dict[str, Path]:
    """One real demo run (bundle + simulator policy) and an encrypted dataset with its key file."""
    root = tmp_path_factory.mktemp("fuzz-world")
    bundle, policy = demo_bundle
    key = os.urandom(32)
    write_key_file(root / "key", key)
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    encrypt_file(rows, root / "data.cvmds", key, dataset_id="fuzz", dataset_version=1)
    rows.unlink()
    return {"root": root, "bundle": bundle, "policy": policy,
            "key": root / "key", "dataset": root / "data.cvmds"}


def _case_dir(tmp_path: Path, n: list[int]) -> Path:
    n[0] += 1
    d = tmp_path / f"case{n[0]}"
    d.mkdir()
    return d


BASE_CONFIG = {"output": {"dir": "OUT", "keep_checkpoints": 2}, "training": {"max_steps": 1, "save_steps": 1,
               "learning_rate": 0.005, "lora": {"r": 4}}, "schedule": {"time": "02:00", "timezone": "UTC"},
               "tee": {"mode": "embedded-simulator", "timeout_s": 5}}


def _config_property(examples: int) -> Callable[..., None]:
    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def prop(tmp_path: Path, data: st.DataObject) -> None:
        case = _case_dir(tmp_path, _counter)
        if data.draw(st.booleans()):  # the case's own path goes in after drawing: the draws must not depend on it
            text = yaml.safe_dump(data.draw(tree_mutations(BASE_CONFIG))).encode()
        else:
            text = data.draw(byte_mutations(yaml.safe_dump(BASE_CONFIG).encode()))
        text = text.replace(b"OUT", str(case / "out").encode())
        path = case / "c.yaml"
        path.write_bytes(text)
        valid = _check("validate-config", ["validate-config", str(path)], tmp_path) == 0
        _check("status", ["status", "--config", str(path)], tmp_path)
        if not valid:  # a refused config runs nothing and exports nothing
            assert _check("run", ["run", "--config", str(path)], tmp_path) == 2
            assert not list(case.glob("out/exports/*"))

    _counter = [0]
    return prop


def _verify_property(examples: int, target: str) -> Callable[..., None]:
    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def prop(world: dict[str, Path], tmp_path: Path, data: st.DataObject) -> None:
        case = _case_dir(tmp_path, _counter)
        bundle = case / world["bundle"].name
        shutil.copytree(world["bundle"], bundle)
        policy = world["policy"]
        if target == "policy":
            policy = case / "policy.yaml"
            doc = yaml.safe_load(world["policy"].read_text())
            policy.write_bytes(yaml.safe_dump(data.draw(tree_mutations(doc))).encode() if data.draw(st.booleans())
                               else data.draw(byte_mutations(world["policy"].read_bytes())))
        elif target == "manifest.json" and data.draw(st.booleans()):
            doc = json.loads((bundle / target).read_bytes())
            (bundle / target).write_text(json.dumps(data.draw(tree_mutations(doc))))
        else:
            (bundle / target).write_bytes(data.draw(byte_mutations((bundle / target).read_bytes())))
        code = _check("verify", ["verify", str(bundle), "--policy", str(policy)], tmp_path)
        if target != "policy" and code == 0:  # accepted: the file must say what the original says
            mutated, original = (bundle / target).read_bytes(), (world["bundle"] / target).read_bytes()
            assert _same_content(target, mutated, original), _first_difference(mutated, original)
        if target in ("quote.bin", "event_log.json"):
            argv = ["verify-quote", str(bundle / "quote.bin"), "--policy", str(world["policy"])]
            if target == "event_log.json":
                argv = ["verify-quote", str(world["bundle"] / "quote.bin"), "--event-log", str(bundle / target),
                        "--policy", str(world["policy"])]
            _check("verify-quote", argv, tmp_path)

    _counter = [0]
    return prop


def _dataset_property(examples: int) -> Callable[..., None]:
    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def prop(world: dict[str, Path], tmp_path: Path, data: st.DataObject) -> None:
        case = _case_dir(tmp_path, _counter)
        damaged = case / "data.cvmds"
        damaged.write_bytes(data.draw(byte_mutations(world["dataset"].read_bytes())))
        _check("inspect", ["dataset", "inspect", str(damaged)], tmp_path)
        cfg = case / "c.yaml"
        cfg.write_text(yaml.safe_dump({"output": {"dir": str(case / "out")}, "training": {"max_steps": 1, "save_steps": 1},
                                       "dataset": {"source": "encrypted-file", "path": str(damaged),
                                                   "key": {"source": "file", "file": str(world["key"])}}}))
        code = _check("run", ["run", "--config", str(cfg)], tmp_path)
        if damaged.read_bytes() != world["dataset"].read_bytes():
            assert code == 3 and not list(case.glob("out/exports/*"))  # authenticated encryption: every change refused

    _counter = [0]
    return prop


test_fuzz_config = _config_property(FAST)
test_fuzz_policy = _verify_property(FAST, "policy")
test_fuzz_manifest = _verify_property(FAST, "manifest.json")
test_fuzz_quote = _verify_property(FAST, "quote.bin")
test_fuzz_event_log = _verify_property(FAST, "event_log.json")
test_fuzz_audit = _verify_property(FAST, "audit.jsonl")
test_fuzz_dataset = _dataset_property(15)

test_fuzz_config_long = pytest.mark.slow(_config_property(LONG))
test_fuzz_policy_long = pytest.mark.slow(_verify_property(LONG, "policy"))
test_fuzz_manifest_long = pytest.mark.slow(_verify_property(LONG, "manifest.json"))
test_fuzz_quote_long = pytest.mark.slow(_verify_property(LONG, "quote.bin"))
test_fuzz_event_log_long = pytest.mark.slow(_verify_property(LONG, "event_log.json"))
test_fuzz_dataset_long = pytest.mark.slow(_dataset_property(60))
