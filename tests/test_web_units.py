"""The browser verifier's arithmetic against the Python verifier's, run by node on the very modules the page bundles
(web/test/units.mjs): Python's float repr and canonical JSON (every hash over JSON depends on them), ε of the rdp
and prv accountants and the bounds checked before either runs, MRCONFIGID on the spec's rule vectors (§3), the op
chain on the spec's test vector (§15) and on changed ops, the manifest and round-manifest models, safetensors files
and the float arithmetic of a round's aggregate."""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest

from attestation.privacy.dp import history_problems, recompute_epsilon
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


# (σ, q, T, δ) for the prv accountant: typical runs, q = 1 (one PLD), one step, a sparse PLD (σ large), many steps
PRV_GRID = [(1.0, 4 / 171, 2, 1e-5), (1.0, 0.0784313725490196, 4, 0.00038446751249519417), (1.2, 0.05, 1000, 1e-5),
            (0.8, 1.0, 10, 1e-5), (50.0, 1.0, 1, 1e-5), (2.0, 0.001, 1, 1e-5), (1000.0, 0.5, 3, 1e-5),
            (20.0, 0.1, 2, 1e-5), (0.6, 0.01, 5000, 1e-7)]
# thousands of steps at a small δ: the FFT's rounding, raised to the T-th power, is what separates the two figures
PRV_NOISY = [(3.0, 0.001, 30000, 1e-9)]


def test_prv_epsilon_equals_the_python_verifiers(web_copy: Path) -> None:
    """The page's port of dp-accounting's PLD accountant against the Python verifier's figure: equal to 1e-6
    (measured: 1e-15 to 4e-8), 1e-5 where the FFT's rounding dominates (measured 2e-6); both far inside the
    0.03 + 0.5 % the check allows between the recomputed and the recorded ε."""
    grid = PRV_GRID + PRV_NOISY
    got = call(web_copy, *(("epsilon", ["prv", [[s, q, t]], d]) for s, q, t, d in grid))
    for (s, q, t, d), eps in zip(grid, got, strict=True):
        want = recompute_epsilon("prv", [(s, q, t)], d)
        assert math.isclose(eps, want, rel_tol=1e-5 if (s, q, t, d) in PRV_NOISY else 1e-6), (s, q, t, d, eps, want)


@pytest.mark.parametrize("accountant, history, delta", [
    ("prv", [[1.0, 0.01, 200_000]], 1e-5),  # more steps than the prv accountant takes
    ("prv", [[0.3, 1.0, 100_000]], 1e-10),  # a mesh over 2**22 points
    ("rdp", [[0.001, 0.01, 10]], 1e-5),  # σ below 0.01
    ("rdp", [[1.0, 1.5, 10]], 1e-5),  # q above 1
    ("prv", [[1.0, 0.01, 10]], 1.0),  # δ not below 1
    ("xyz", [[1.0, 0.01, 10]], 1e-5),
    ("prv", [[1.0, 0.01, 0]], 1e-5),  # no step: nothing spent
    ("rdp", [[1.0, 0.01, 0]], 1e-5),
])
def test_the_bounds_and_their_reasons_are_the_python_verifiers(web_copy: Path, accountant: str,
                                                               history: list[list[float]], delta: float) -> None:
    problems, eps = call(web_copy, ("historyProblems", [accountant, history, delta]), ("epsilon", [accountant, history, delta]))
    assert problems == history_problems(accountant, [tuple(h) for h in history], delta)  # type: ignore[misc]
    try:
        want: Any = recompute_epsilon(accountant, [tuple(h) for h in history], delta)  # type: ignore[misc]
    except ValueError as exc:
        want = {"error": str(exc)}
    assert eps == want if isinstance(want, dict) else math.isclose(eps, want, rel_tol=1e-9, abs_tol=1e-12)


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


def test_the_page_knows_every_member_of_the_round_manifest(web_copy: Path) -> None:
    from attestation.rounds.manifest import RoundManifest

    assert call(web_copy, ("roundManifestMembers", []))[0] == _members(RoundManifest)


def _safetensors(tensors: dict[str, tuple[str, list[int], bytes]], pad: bytes = b"", header: bytes | None = None
                 ) -> bytes:
    """A safetensors file: name -> (dtype, shape, data bytes), laid out in order."""
    meta, at = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    head = header if header is not None else json.dumps(meta).encode() + pad
    return struct.pack("<Q", len(head)) + head + b"".join(d for _, _, d in tensors.values())


def _f32(*xs: float) -> bytes:
    return struct.pack(f"<{len(xs)}f", *xs)


SAFETENSORS = {
    "f32 and f16": _safetensors({"a": ("F32", [2, 2], _f32(1.5, -2.25, 3e-8, 7.0)),
                                 "b": ("F16", [3], struct.pack("<3e", 0.5, -1.0, 6e-5))}),
    "padded header": _safetensors({"a": ("F32", [1], _f32(1.0))}, pad=b"   "),
    "ints and bools": _safetensors({"i": ("I64", [2], struct.pack("<2q", -3, 2**40)), "t": ("BOOL", [2], b"\x00\x01")}),
    "bf16": _safetensors({"a": ("BF16", [2], b"\x80\x3f\x00\x40")}),
    "wrong size": _safetensors({"a": ("F32", [3], _f32(1.0, 2.0))}),
    "gap": _safetensors({"a": ("F32", [1], _f32(1.0))}) + b"\x00",
    "unknown dtype": _safetensors({"a": ("F33", [1], _f32(1.0))}),
    "not json": _safetensors({"a": ("F32", [1], _f32(1.0))}, header=b"{not json}"),
    "header past the end": struct.pack("<Q", 1000) + b"{}",
    "too short": b"\x01\x00",
}


@pytest.mark.parametrize("name", sorted(SAFETENSORS))
def test_safetensors_files_load_or_fail_as_safetensors_numpy_loads_them(web_copy: Path, name: str) -> None:
    import numpy as np
    from safetensors.numpy import load

    [got] = call(web_copy, ("safetensors", [base64.b64encode(SAFETENSORS[name]).decode()]))
    try:
        want: Any = {k: {"dtype": {np.float32: "F32", np.float16: "F16", np.int64: "I64", np.bool_: "BOOL"}[v.dtype.type],
                         "shape": list(v.shape), "values": [float(x) for x in v.ravel()]}
                     for k, v in load(SAFETENSORS[name]).items()}
    except KeyError:  # a dtype numpy has no array for: round.aggregate skips (load_plain's LookupError)
        want = "lookup"
    except Exception:  # noqa: BLE001 - SafetensorError: round.aggregate fails
        want = "parse"
    assert got == want


def test_the_weighted_sum_is_numpys_in_float32_and_float16(web_copy: Path) -> None:
    import numpy as np
    from safetensors.numpy import load

    rng = np.random.default_rng(7)
    files, weights = [], [0.3123456789, 0.2, 0.4876543211]
    for _ in weights:
        files.append(_safetensors({"w": ("F32", [64], rng.normal(size=64).astype(np.float32).tobytes()),
                                   "h": ("F16", [16], rng.normal(size=16).astype(np.float16).tobytes())}))
    [got] = call(web_copy, ("weightedSum", [weights, [base64.b64encode(f).decode() for f in files]]))
    total = None
    for w, data in zip(weights, files, strict=True):
        scaled = {k: v * w for k, v in load(data).items()}
        total = scaled if total is None else {k: total[k] + scaled[k] for k in total}
    assert total is not None and {k: [float(x) for x in v] for k, v in total.items()} == got


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
