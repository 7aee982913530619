"""Audit anchors on dstack 0.6 (no EmitEvent): a quote over the chain head at every checkpoint, kept on the volume,
carried by the bundle and checked by ``audit.anchors`` (docs/verifier-spec.md section 4a); every anchored head is
published to the rollback anchor, so a volume restored behind a checkpoint is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import app.training
from app.audit import AuditLog, AuditRecorder
from app.cli import main
from app.config import TeeSettings
from app.errors import StateError, TeeError
from app.simulator import GuestAgentSimulator, SimulatorSettings
from app.state import RollbackDetected, check_anchor
from app.tee import GuestAgent, open_guest_agent
from attestation.bundle import manifest as B
from attestation.bundle.anchors import (AnchorFormatError, make_anchor, of_chain, parse_anchor, parse_anchor_lines,
                                        report_data)
from attestation.bundle.audit import parse_lines
from attestation.bundle.verify import verify_bundle
from attestation.io.hashing import canonical_json, sha256_file
from attestation.policy import load_policy
from tests.test_pipeline import _cfg  # 8 steps, a checkpoint every 4

NOW = int(time.time())


def _resumed_run(tmp: Path, **sections: object) -> Path:
    """A run stopped after its first checkpoint and resumed by a new process (a new simulator boot)."""
    cfg = _cfg(tmp, **sections)
    real = app.training.train
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(app.training, "train", lambda req: real(dataclasses.replace(req, stop_after_step=4)))
        assert main(["run", "--config", str(cfg)]) == 6
    assert main(["run", "--config", str(cfg)]) == 0
    return next((tmp / "out" / "exports").iterdir())


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("anchored")
    anchor = tmp / "published" / "anchor.json"
    return _resumed_run(tmp, state={"rollback_anchor": str(anchor)}), tmp


def _policy(tmp: Path, **changes: object):
    return load_policy(tmp / "out" / "simulator-test-policy.yaml").model_copy(update=changes)


def _checks(bundle: Path, policy) -> dict[str, tuple[str, str]]:
    v = verify_bundle(bundle, policy=policy, now=NOW)
    return {c.name: (c.status, c.detail) for c in v.checks}


def _failed(bundle: Path, policy) -> set[str]:
    return {n for n, (s, _) in _checks(bundle, policy).items() if s == "fail"}


def _copy(made: tuple[Path, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(made[0], tmp_path / "b"))


def reattest(b: Path, body: bytes | None, count: int | None = None,
             change: Callable[[dict[str, Any]], None] | None = None) -> None:
    """audit-anchors.jsonl := ``body`` (None: removed, the bundle unanchored), ``manifest.audit.anchors`` := ``count``
    (its line count when None), then the manifest re-hashed and re-quoted by the same simulator CVM: only the
    anchors' own rules can then fail."""
    m = json.loads((b / B.MANIFEST).read_text())
    path = b / B.AUDIT_ANCHORS
    if body is None:
        path.unlink()
        m["audit"]["anchors"] = None
        m["files"].pop(B.AUDIT_ANCHORS)
    else:
        path.write_bytes(body)
        m["audit"]["anchors"] = body.count(b"\n") if count is None else count
        m["files"][B.AUDIT_ANCHORS] = sha256_file(path)
    if change is not None:
        change(m)
    manifest = json.dumps(m, indent=2, sort_keys=True).encode() + b"\n"
    (b / B.MANIFEST).write_bytes(manifest)
    answer = GuestAgentSimulator(SimulatorSettings()).get_quote(B.manifest_report_data(manifest))
    (b / B.QUOTE_BIN).write_bytes(bytes.fromhex(answer["quote"]))
    (b / B.QUOTE_HEX).write_text(answer["quote"] + "\n")
    (b / B.EVENT_LOG).write_text(answer["event_log"])


def _body(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _lines(bundle: Path) -> list[bytes]:
    return (bundle / B.AUDIT_ANCHORS).read_bytes().split(b"\n")[:-1]


def _entries(bundle: Path):
    return parse_lines((bundle / B.AUDIT).read_bytes())


def test_each_checkpoint_is_anchored_in_the_boot_that_wrote_it(made: tuple[Path, Path]) -> None:
    bundle, tmp = made
    m = json.loads((bundle / B.MANIFEST).read_text())
    entries = _entries(bundle)
    checkpoints = [e for e in entries if e.type == "checkpoint"]
    anchors = parse_anchor_lines((bundle / B.AUDIT_ANCHORS).read_bytes())
    assert m["audit"]["rtmr3"] == "unsupported" and m["audit"]["anchors"] == 2 == len(checkpoints)
    assert [(a.seq, a.head) for a in anchors] == [(e.seq, e.hash) for e in checkpoints]
    # the first checkpoint was written before the process died: its anchor comes from that boot's quote
    assert anchors[0].seq < next(e.seq for e in entries if e.type == "run.resume") < anchors[1].seq
    assert all(a.quote[568:632] == report_data(a.seq, a.head) for a in anchors)  # report_data: offset 520 + 48
    status, detail = _checks(bundle, _policy(tmp))["audit.anchors"]
    assert status == "pass" and "2 checkpoint(s)" in detail
    assert _failed(bundle, _policy(tmp, require_audit_anchors=True)) == set()
    assert _failed(bundle, _policy(tmp, require_rtmr3_audit=True)) == {"audit.rtmr3"}  # 0.6 cannot measure the chain
    kept = parse_anchor_lines((tmp / "out" / "state" / "audit-anchors.jsonl").read_bytes())
    assert [a.line for a in kept] == [a.line for a in anchors]
    assert main(["verify", str(bundle), "--policy", str(tmp / "out" / "simulator-test-policy.yaml")]) == 0


def test_the_published_head_follows_each_anchor_and_catches_a_rolled_back_volume(made: tuple[Path, Path]) -> None:
    bundle, tmp = made
    published = json.loads((tmp / "published" / "anchor.json").read_text())
    last_checkpoint = [e for e in _entries(bundle) if e.type == "checkpoint"][-1]
    assert published["audit_head"] == last_checkpoint.hash  # `run` publishes at each anchor (the service after runs too)
    log = AuditLog(tmp / "out" / "state" / "audit.jsonl")
    check_anchor(tmp / "published" / "anchor.json", counter=0, audit_hashes={e.hash for e in log.entries})
    before = {e.hash for e in log.entries if e.seq < last_checkpoint.seq}  # the volume as it was before that checkpoint
    with pytest.raises(RollbackDetected, match="not in the local chain"):
        check_anchor(tmp / "published" / "anchor.json", counter=0, audit_hashes=before)


@pytest.mark.parametrize("case", ["dropped", "swapped quotes", "reversed", "wrong entry", "run.start anchored",
                                  "other deployment"])
def test_anchors_that_do_not_anchor_the_slice_fail_only_audit_anchors(made: tuple[Path, Path], tmp_path: Path,
                                                                     case: str) -> None:
    bundle = _copy(made, tmp_path)
    first, second = (parse_anchor(line) for line in _lines(bundle))
    entries = _entries(bundle)
    start = entries[0]
    sim = GuestAgentSimulator(SimulatorSettings())

    def anchor_of(entry, agent: GuestAgentSimulator = sim) -> bytes:
        answer = agent.get_quote(report_data(entry.seq, entry.hash))
        return make_anchor(entry, bytes.fromhex(answer["quote"]), answer["event_log"]).line

    def with_quote(a, quote: bytes) -> bytes:
        return canonical_json({"v": 1, "seq": a.seq, "head": a.head, "quote": quote.hex(), "event_log": a.event_log})

    lines = {
        "dropped": [first.line],
        "swapped quotes": [with_quote(first, second.quote), with_quote(second, first.quote)],
        "reversed": [second.line, first.line],
        "wrong entry": [canonical_json({"v": 1, "seq": first.seq, "head": start.hash, "quote": first.quote.hex(),
                                        "event_log": first.event_log}), second.line],
        "run.start anchored": [anchor_of(start), first.line, second.line],
        "other deployment": [anchor_of(next(e for e in entries if e.seq == first.seq), GuestAgentSimulator(
            SimulatorSettings(app_compose=json.dumps({"manifest_version": 2, "name": "another-app", "runner":
                                                      "docker-compose", "docker_compose_file": "services: {}\n"})))),
                             second.line],
    }[case]
    reattest(bundle, _body(lines))
    checks = _checks(bundle, _policy(made[1]))
    assert {n for n, (s, _) in checks.items() if s == "fail"} == {"audit.anchors"}, checks
    reason = checks["audit.anchors"][1]
    assert {"dropped": "has no anchor", "swapped quotes": "its quote fails report_data", "reversed": "increasing",
            "wrong entry": "no entry of the slice", "run.start anchored": "run.start entry is not anchored",
            "other deployment": "another"}[case] in reason


def test_an_unanchored_06_bundle_is_skipped_unless_the_policy_requires_anchors(made: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    bundle = _copy(made, tmp_path)
    reattest(bundle, None)
    assert _checks(bundle, _policy(made[1]))["audit.anchors"][0] == "skip"
    assert _failed(bundle, _policy(made[1], require_audit_anchors=True)) == {"audit.anchors"}


def test_a_manifest_count_that_differs_or_an_unlisted_file_fails(made: tuple[Path, Path], tmp_path: Path) -> None:
    bundle = _copy(made, tmp_path)
    reattest(bundle, _body(_lines(bundle)))
    m = json.loads((bundle / B.MANIFEST).read_text())
    m["audit"]["anchors"] = 3
    (bundle / B.MANIFEST).write_text(json.dumps(m))
    assert "audit.anchors" in _failed(bundle, _policy(made[1]))
    other = _copy(made, tmp_path / "2")
    (other / B.AUDIT_ANCHORS).write_bytes((other / B.AUDIT_ANCHORS).read_bytes()[:-1])  # one byte changed: its hash
    assert {"manifest.files", "audit.anchors"} <= _failed(other, _policy(made[1]))


def test_a_05_agent_that_measures_the_chain_writes_no_anchors(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tee={"simulator": {"dstack": "0.5"}})
    assert main(["run", "--config", str(cfg)]) == 0
    bundle = next((tmp_path / "out" / "exports").iterdir())
    m = json.loads((bundle / B.MANIFEST).read_text())
    assert m["audit"]["rtmr3"] == "emit_event" and m["audit"].get("anchors") is None
    assert not (bundle / B.AUDIT_ANCHORS).exists() and not (tmp_path / "out" / "state" / "audit-anchors.jsonl").exists()
    assert _checks(bundle, _policy(tmp_path, require_audit_anchors=True))["audit.anchors"][0] == "skip"


@pytest.fixture
def agent() -> GuestAgent:
    with open_guest_agent(TeeSettings()) as a:
        yield a


def test_an_anchor_whose_entry_never_joined_the_chain_is_never_exported(tmp_path: Path, agent: GuestAgent) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    rec = AuditRecorder(log, agent, require_emit=False)
    rec.record("r", "run.start", {})
    lost = log.next_entry("r", "checkpoint", {"global_step": 1})  # quoted, then the process died before the append
    log.append_anchor(make_anchor(lost, *agent.quote(report_data(lost.seq, lost.hash))))
    with open(log.anchors_path, "ab") as f:
        f.write(b'{"event_log":"[]","he')  # and a torn second anchor line
    again = AuditLog(tmp_path / "audit.jsonl")
    assert len(again.anchors()) == 1 and again.repaired  # the torn line is dropped
    rec = AuditRecorder(again, agent, require_emit=False)
    done = rec.record("r", "checkpoint", {"global_step": 2})
    assert done.seq == lost.seq and done.hash != lost.hash
    kept = of_chain(again.anchors(), again.entries)
    assert len(again.anchors()) == 2 and [(a.seq, a.head) for a in kept] == [(done.seq, done.hash)]


def test_no_quote_no_checkpoint_entry(tmp_path: Path, agent: GuestAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    rec = AuditRecorder(log, agent, require_emit=False)
    rec.record("r", "run.start", {})
    before = (tmp_path / "audit.jsonl").read_bytes()

    def refuse(report_data: bytes) -> tuple[bytes, str]:
        raise TeeError("GetQuote failed: the agent is gone")

    monkeypatch.setattr(agent, "quote", refuse)
    with pytest.raises(TeeError, match="GetQuote failed"):
        rec.record("r", "checkpoint", {"global_step": 1})
    assert (tmp_path / "audit.jsonl").read_bytes() == before and not log.anchors_path.exists()
    assert rec.record("r", "train.done", {}).seq == 1  # entries that need no anchor go on
    real = type(agent).quote
    monkeypatch.setattr(agent, "quote", lambda rd: real(agent, bytes(64)))  # a quote over other report_data
    before = (tmp_path / "audit.jsonl").read_bytes()
    with pytest.raises(TeeError, match="other report_data"):
        rec.record("r", "checkpoint", {"global_step": 1})
    assert (tmp_path / "audit.jsonl").read_bytes() == before and not log.anchors_path.exists()


@pytest.mark.parametrize("line", [
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":1,"x":0}',  # an extra member
    b'{"event_log": "[]","head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":1}',  # not canonical
    b'{"event_log":"[]","head":"' + b"A" * 64 + b'","quote":"00","seq":1,"v":1}',  # uppercase head
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"0","seq":1,"v":1}',  # odd hex
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":-1,"v":1}',  # negative seq
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":true,"v":1}',  # a boolean seq
    b'{"event_log":[],"head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":1}',  # a parsed event log
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":2}',  # another version
    b"\xff",
    b'{"event_log":"\\ud800","head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":1}',  # a lone surrogate
    b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":NaN,"v":1}',  # not JSON's number
])
def test_malformed_anchor_lines_are_refused(line: bytes) -> None:
    with pytest.raises(AnchorFormatError):
        parse_anchor(line)


def test_an_anchors_file_must_end_with_a_newline(tmp_path: Path) -> None:
    good = b'{"event_log":"[]","head":"' + b"a" * 64 + b'","quote":"00","seq":1,"v":1}'
    assert len(parse_anchor_lines(good + b"\n")) == 1
    with pytest.raises(AnchorFormatError, match="newline"):
        parse_anchor_lines(good)
    (tmp_path / "audit-anchors.jsonl").write_bytes(b"not json\n")
    with pytest.raises(StateError, match="corrupt"):
        AuditLog(tmp_path / "audit.jsonl").anchors()


def test_an_audit_line_without_a_canonical_form_is_a_format_error() -> None:
    from attestation.bundle.audit import AuditFormatError, parse_entry

    for line in (b'{"data":{"x":"\\ud800"},"prev":"' + b"0" * 64 + b'","run_id":"r","seq":0,"time":"t","type":"export","v":1}',
                 b'{"data":{"x":NaN},"prev":"' + b"0" * 64 + b'","run_id":"r","seq":0,"time":"t","type":"export","v":1}'):
        with pytest.raises(AuditFormatError, match="canonical"):
            parse_entry(line)


@pytest.mark.parametrize("audit", [{"anchors": True}, {"anchors": "1"}, {"first_seq": "0"}, {"entries": 8.0}])
def test_the_manifests_audit_counts_are_json_integers(made: tuple[Path, Path], tmp_path: Path,
                                                      audit: dict[str, Any]) -> None:
    bundle = _copy(made, tmp_path)
    reattest(bundle, (bundle / B.AUDIT_ANCHORS).read_bytes(), change=lambda m: m["audit"].update(audit))
    assert _checks(bundle, _policy(made[1]))["manifest.schema"][0] == "fail"
