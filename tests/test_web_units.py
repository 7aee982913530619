"""The browser verifier's arithmetic against the Python verifier's, run by node on the very modules the page bundles
(web/test/units.mjs): Python's float repr and canonical JSON (every hash over JSON depends on them), ε of the rdp
accountant, MRCONFIGID on the spec's rule vectors (§3), and the op chain on the spec's test vector (§15) and on
changed ops."""

from __future__ import annotations

import json
import math
import re
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest

from attestation.privacy.epsilon import rdp_epsilon
from tests.test_web_verify import REPO, pytestmark, web_copy  # noqa: F401


def call(web: Path, *calls: tuple[str, list[Any]]) -> list[Any]:
    """Run the page's functions: each call is (name, arguments); returns their results."""
    out = subprocess.run(["node", str(web / "test" / "units.mjs")], input=json.dumps(calls), capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout)


FLOATS = [0.0, -0.0, 1.0, -2.5, 0.1, 1e-4, 1e-5, 2e-05, 1.5e-7, 123456789.0, 1e15, 1e16, 1.2345e16, 1e22, 5e-324,
          1.7976931348623157e308, 6.668147563934326, 0.0784313725490196, 1 / 3, 2.0 ** 53, -1e-300]


def test_floats_print_as_python_prints_them(web_copy: Path) -> None:
    assert call(web_copy, *(("pyFloat", [x]) for x in FLOATS)) == [repr(x) for x in FLOATS]


def test_canonical_json_is_pythons(web_copy: Path) -> None:
    docs = [{"b": 1.0, "a": [2e-05, "é", None, True], "c": {"z": 1, "y": "line\nbreak\u0001"}},
            {"lr": 0.0002, "steps": 10**20, "tiny": 1e-300, "": [], "ü": {"\u2028": 3.5}}]
    texts = [json.dumps(d) for d in docs]
    got = call(web_copy, *(("canonical", [t, ascii_only]) for t in texts for ascii_only in (False, True)))
    want = [json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=a) for d in docs for a in (False, True)]
    assert got == want


GRID = [(1.0, 4 / 171, 2, 1e-5), (0.5, 0.3, 100, 1e-6), (3.0, 0.001, 30000, 1e-9), (0.8, 1.0, 10, 1e-5),
        (1.2, 0.05, 1000, 1e-5), (5.0, 0.2, 5, 1e-3), (1.0, 0.0784313725490196, 4, 0.00038446751249519417),
        (0.6, 0.01, 5000, 1e-7)]


def test_rdp_epsilon_equals_the_python_verifiers(web_copy: Path) -> None:
    got = call(web_copy, *(("rdpEpsilon", [[[s, q, t]], d]) for s, q, t, d in GRID))
    for (s, q, t, d), eps in zip(GRID, got, strict=True):
        assert math.isclose(eps, rdp_epsilon([(s, q, t)], d), rel_tol=1e-9), (s, q, t, d)


def test_mrconfigid_rule_vectors_of_the_spec(web_copy: Path) -> None:
    text = (REPO / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    rules = [json.loads(line) for block in re.findall(r"^```rule-vectors\n(.*?)^```", text, flags=re.S | re.M)
             for line in block.splitlines() if line.startswith("{")]
    rules = [r for r in rules if r["rule"].startswith("3.")]
    assert len(rules) >= 5
    got = call(web_copy, *(("mrConfigId", [r]) for r in rules))
    want = {r["rule"]: r["expect"] == "pass" for r in rules}
    assert {r["rule"]: ok for r, ok in zip(rules, got, strict=True)} == want


def _members(model: Any) -> dict[str, Any] | None:
    """{member (its JSON name): its own members, or None} of a pydantic model, through Optional, lists and tuples."""
    from pydantic import BaseModel

    def nested(annotation: Any) -> dict[str, Any] | None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return _members(annotation)
        if typing.get_origin(annotation) is dict:
            return None
        return next((n for a in typing.get_args(annotation) if (n := nested(a)) is not None), None)

    return {(f.alias or name): nested(f.annotation) for name, f in model.model_fields.items()}


def test_the_page_knows_every_member_of_the_manifest(web_copy: Path) -> None:
    """web/src/schema.js lists the manifest's closed objects member by member: a member added to the Python model
    must be added there too (else the page would reject every new bundle's manifest.schema)."""
    from attestation.bundle.manifest import Manifest

    assert call(web_copy, ("manifestMembers", []))[0] == _members(Manifest)


def _gpu_evidence() -> list[bytes]:
    """gpu-evidence.json documents: no GPU; H100s in and out of CC mode; with nvattest's real report, a replayed one,
    edited claims, a changed version, an unparseable one, a timeout; a malformed document."""
    from tests import test_gpu_evidence as T

    sample = T.SAMPLE.read_text()
    nvattest = [sample, T._reencode(sample, T.SAMPLE_NONCE), T._reencode(sample, "cd" * 32),
                T._reencode(sample, T.SAMPLE_NONCE, edit={"measres": "fail"}),
                T._reencode(sample, T.SAMPLE_NONCE, edit={"measres": "fail"}, fix_digests=False),
                sample.replace('"measres": "success"', '"measres": "fail"'),
                T._reencode(sample, T.SAMPLE_NONCE, edit={"x-nvidia-gpu-vbios-version": "96.00.5E.00.01"}), "not json"]
    docs = [[T._cmd("query-gpu", "", "missing", None)], T._h100(), T._h100(cc="cc_status_off.txt"),
            T._h100(devtools="cc_devtools_on.txt"), T._h100(query="cc_query_ppcie_h200.txt"),
            T._h100(query="cc_query_on_h100nvl.txt"), *(T._h100(nvattest=n) for n in nvattest),
            [*T._h100(), T._cmd("nvattest", "", "timeout", None)], [*T._h100(), T._cmd("nvattest", "x", "error", 1)]]
    return [T._evidence(d) for d in docs] + [b'{"schema": "cvm-tune/gpu-evidence/v1"}\n']


def test_gpu_evidence_is_summarised_and_judged_as_the_python_verifier_does(web_copy: Path) -> None:
    from types import SimpleNamespace

    from attestation.tdx import gpu as G

    evidence = _gpu_evidence()
    got = call(web_copy, *(("gpu", [data.decode()]) for data in evidence))
    for data, page in zip(evidence, got, strict=True):
        try:
            info = G.summarize(data)
        except G.GpuEvidenceError as exc:
            assert page == {"error": str(exc)}
            continue
        summary = page["summary"]
        if summary["nvidia_report"] is not None:  # the page leaves out the members a report without status ok lacks
            summary["nvidia_report"] = {**G.NvidiaReport(tool="nvattest", status="error").model_dump(mode="json"),
                                        **summary["nvidia_report"]}
        assert summary == info.model_dump(mode="json")
        entry = SimpleNamespace(type="gpu.evidence", data={"evidence_sha256": info.evidence_sha256}, prev=info.nonce)
        assert page["check"] == list(G.check(data, info, [entry]))


def test_dstacks_boot_time_gpu_attestation_is_read_as_the_python_verifier_reads_it(web_copy: Path) -> None:
    from attestation.tdx.eventlog import RUNTIME_EVENT_TYPE, Event
    from attestation.tdx.gpu_dstack import boot_gpu_attestation

    good = {"provider": "nvidia", "devices": 8, "cc_mode": "on", "devtools": False, "evidence_sha256": "ab" * 32}
    logs = [[("system-ready", "")], [("gpu-attestation", json.dumps(good)), ("system-ready", "")],
            [("system-ready", ""), ("gpu-attestation", json.dumps(good))],
            [("gpu-attestation", json.dumps(good)), ("gpu-attestation", json.dumps(good)), ("system-ready", "")],
            [("gpu-attestation", json.dumps({**good, "devtools": True})), ("system-ready", "")],
            [("gpu-attestation", json.dumps({**good, "cc_mode": "off"})), ("system-ready", "")],
            [("gpu-attestation", json.dumps({**good, "provider": "amd"})), ("system-ready", "")],
            [("gpu-attestation", "{}"), ("system-ready", "")]]
    got = call(web_copy, *(("bootGpu", [log]) for log in logs))
    for log, page in zip(logs, got, strict=True):
        events = tuple(Event(i, 3, RUNTIME_EVENT_TYPE, b"", name, payload.encode()) for i, (name, payload) in enumerate(log))
        want = boot_gpu_attestation(events)
        assert page == (None if want is None else list(want)), log


def _spec_vectors() -> dict[str, str]:
    text = (REPO / "docs" / "verifier-spec.md").read_text(encoding="utf-8")
    block = re.search(r"^```op-chain-vectors\n(.*?)^```", text, flags=re.S | re.M)
    assert block
    return dict(line.split(" = ", 1) for line in block.group(1).splitlines())


@pytest.mark.parametrize("change, status", [
    (lambda ops: ops, "pass"),
    (lambda ops: ops[:1], "fail"),
    (lambda ops: [ops[0].replace("[1, 2, 3]", "[1, 2, 4]"), ops[1]], "fail"),
    (lambda ops: [ops[0].replace("0.5", "0.25"), ops[1]], "fail"),
    (lambda ops: [ops[0], ops[1].replace("0.001", "0.002")], "fail"),
    (lambda ops: [ops[0], "", ops[1], ""], "pass"),
    (lambda ops: [ops[0], "[1, 2]", ops[1]], "fail"),
])
def test_the_op_chain_of_the_spec_vector(web_copy: Path, change: Any, status: str) -> None:
    v = _spec_vectors()
    recorded = {"head": v["head_2"], "ops": 2, "optimizer_steps": 1, "checkpoint": "tinker://x", "lora": {}}
    [check] = call(web_copy, ("opChain", [recorded, "\n".join(change([v["op_1"], v["op_2"]])) + "\n"]))
    assert (check["name"], check["status"]) == ("op_chain.ops", status), check["reason"]
