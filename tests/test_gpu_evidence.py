"""GPU evidence: parsing captured nvidia-smi text and NVIDIA's real H100 report, collection, manifest, verifier.

No GPU is needed: the parsers run on the captured outputs in ``tests/data/gpu/`` (sources in its README)
and on dstack's real ``nvattest`` sample; collection runs the real subprocess code against stand-in
``nvidia-smi``/``nvattest`` executables on ``PATH`` that print those captures.
Run: ``python -m pytest tests/test_gpu_evidence.py -q``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.run import gpu as collect_mod
from app.cli import main
from app.errors import TeeError
from attestation.tdx import gpu as G
from attestation.bundle.audit import GENESIS, make_entry

DATA = Path(__file__).parent / "data"
GPU = DATA / "gpu"
SAMPLE = DATA / "attestation" / "dstack_gpu_attestation_h100_localverifier.json"
SAMPLE_NONCE = "1" * 64


def _fx(name: str) -> str:
    return (GPU / name).read_text()


def _cmd(name: str, stdout: str = "", status: str = "ok", rc: int | None = 0) -> dict[str, Any]:
    return {"name": name, "argv": ["nvidia-smi"], "status": status, "returncode": rc, "stdout": stdout, "stderr": ""}


def _evidence(commands: list[dict[str, Any]], nonce: str = SAMPLE_NONCE) -> bytes:
    return G.evidence_bytes({"schema": G.SCHEMA, "nonce": nonce, "commands": commands})


def _h100(cc: str = "cc_status_on.txt", devtools: str = "cc_devtools_off.txt", query: str | None = None,
          nvattest: str | None = None) -> list[dict[str, Any]]:
    cmds = [_cmd("query-gpu", _fx("query_gpu_h100.txt")), _cmd("cc-status", _fx(cc)), _cmd("cc-devtools", _fx(devtools)),
            _cmd("cc-environment", _fx("cc_environment_production.txt"))]
    cmds.append(_cmd("cc-query", _fx(query)) if query else _cmd("cc-query", "", "error", 2))
    if nvattest is not None:
        cmds.append(_cmd("nvattest", nvattest))
    return cmds


# --- nvidia-smi text ------------------------------------------------------------------------------------


def test_query_gpu_csv() -> None:
    (d,) = G.parse_query_gpu(_fx("query_gpu_h100.txt"))
    assert (d.index, d.name, d.uuid, d.pci_bus_id) == (0, "NVIDIA H100 80GB HBM3", "GPU-8c35f4c9-4dff-c9a2-866f-afb5d82e1dd7",
                                                       "00000000:1B:00.0")
    assert (d.driver_version, d.vbios_version) == ("580.159.03", "96.00.D9.00.01")
    two = G.parse_query_gpu(_fx("query_gpu_h100.txt") + _fx("query_gpu_h100.txt").replace("0, ", "1, ", 1))
    assert [x.index for x in two] == [0, 1]
    with pytest.raises(G.GpuEvidenceError):
        G.parse_query_gpu("NVIDIA H100 80GB HBM3, 580.159.03\n")  # another field list


@pytest.mark.parametrize(("files", "expected"), [
    ({"cc-status": "cc_status_on.txt", "cc-devtools": "cc_devtools_off.txt"}, ("on", None)),
    ({"cc-status": "cc_status_on.txt", "cc-devtools": "cc_devtools_on.txt"}, ("devtools", None)),
    ({"cc-status": "cc_status_off.txt", "cc-devtools": "cc_devtools_off.txt"}, ("off", None)),
    ({"cc-query": "cc_query_ppcie_h200.txt"}, ("ppcie", "ready")),
    ({"cc-query": "cc_query_off_h20.txt", "cc-status": "cc_status_off.txt"}, ("off", "ready")),
    ({"cc-query": "cc_query_on_h100nvl.txt"}, ("on", "ready")),
    ({"cc-status": "cc_no_capable_device.txt"}, ("unknown", None)),
])
def test_cc_state_from_captured_conf_compute_output(files: dict[str, str], expected: tuple[str, str | None]) -> None:
    fields = {name: G.parse_fields(_fx(f)) for name, f in files.items()}
    mode, _env, ready = G.cc_state(fields, present=True)
    assert (mode, ready) == expected
    assert G.cc_state(fields, present=False) == ("n/a", None, None)


def test_environment_and_devtools_fields() -> None:
    assert G.parse_fields(_fx("cc_environment_production.txt")) == {"cc environment": "PRODUCTION"}
    assert G.parse_fields(_fx("cc_query_on_h100nvl.txt"))["devtools mode"] == "OFF"
    assert "cc state" in G.parse_fields(_fx("cc_query_ppcie_h200.txt"))  # the ==== header line is not a field


# --- the real NVIDIA report ------------------------------------------------------------------------------


def _reencode(sample: str, nonce: str, *, edit: dict[str, Any] | None = None, fix_digests: bool = True) -> str:
    """The sample with another nonce (and claim edits): local-mode EATs are unsigned, anyone can do this."""
    doc = json.loads(sample)

    def enc(obj: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).decode().rstrip("=")

    def rewrite(token: str, extra: dict[str, Any]) -> str:
        header, claims = (json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))) for p in token.split(".")[:2])
        claims.update(eat_nonce=nonce, **extra)
        return f"{enc(header)}.{enc(claims)}."

    gpus = {name: rewrite(tok, edit or {}) for name, tok in doc["detached_eat"][1].items()}
    header, overall = (json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)))
                       for p in doc["detached_eat"][0][1].split(".")[:2])
    overall["eat_nonce"] = nonce
    if fix_digests:
        overall["submods"] = {n: ["DIGEST", ["SHA256", hashlib.sha256(t.encode()).hexdigest()]] for n, t in gpus.items()}
    doc["detached_eat"] = [["JWT", f"{enc(header)}.{enc(overall)}."], gpus]
    for c in doc["claims"]:
        c.update(eat_nonce=nonce, **(edit or {}))
    return json.dumps(doc)


def test_real_h100_local_verifier_report() -> None:
    r = G.parse_nvattest(SAMPLE.read_text(), SAMPLE_NONCE)
    assert (r.status, r.result_code, r.result_message, r.overall) == ("ok", 0, "Ok", True)
    assert r.measres == {"GPU-0": "success"} and r.nonce_match and r.consistent
    assert r.signed is False  # alg none: the local verifier's EAT is self-reported
    assert r.versions == {"GPU-0": ["580.159.03", "96.00.D9.00.01"]}
    assert G.parse_nvattest(SAMPLE.read_text(), "2" * 64).nonce_match is False  # a replayed report


def test_report_inconsistencies_are_detected() -> None:
    nonce = "ab" * 32
    ok = G.parse_nvattest(_reencode(SAMPLE.read_text(), nonce), nonce)
    assert ok.nonce_match and ok.consistent
    stale_digest = G.parse_nvattest(_reencode(SAMPLE.read_text(), nonce, edit={"measres": "fail"}, fix_digests=False), nonce)
    assert stale_digest.consistent is False and stale_digest.measres == {"GPU-0": "fail"}
    doc = json.loads(SAMPLE.read_text())
    doc["claims"][0]["x-nvidia-gpu-driver-version"] = "999.0"  # listed claims differ from the token's
    assert G.parse_nvattest(json.dumps(doc), SAMPLE_NONCE).consistent is False
    assert G.parse_nvattest("not json", SAMPLE_NONCE).status == "unparseable"


# --- summary and policy ----------------------------------------------------------------------------------


def test_summary_of_an_attested_h100() -> None:
    data = _evidence(_h100(nvattest=SAMPLE.read_text()))
    info = G.summarize(data)
    assert info.present and info.nvidia_smi == "ok" and len(info.devices) == 1
    assert (info.cc_mode, info.cc_environment, info.ready_state) == ("on", "PRODUCTION", None)
    assert info.evidence_sha256 == hashlib.sha256(data).hexdigest() and info.nonce == SAMPLE_NONCE
    assert G.problems(info) == []
    text = G.describe(info)
    assert "1 x NVIDIA H100 80GB HBM3" in text and "CC mode on" in text and "unsigned local-mode EAT" in text


@pytest.mark.parametrize(("commands", "issue"), [
    (_h100(cc="cc_status_off.txt"), "mode is off"),
    (_h100(devtools="cc_devtools_on.txt"), "mode is devtools"),
    (_h100(query="cc_query_ppcie_h200.txt", cc="cc_status_off.txt"), "mode is ppcie"),
    (_h100(nvattest=_reencode(SAMPLE.read_text(), SAMPLE_NONCE, edit={"measres": "fail"})), "did not succeed"),
    (_h100(nvattest=_reencode(SAMPLE.read_text(), "cd" * 32)), "another nonce"),
    (_h100(nvattest=SAMPLE.read_text().replace('"measres": "success"', '"measres": "fail"')), "inconsistent"),
    (_h100(nvattest=_reencode(SAMPLE.read_text(), SAMPLE_NONCE, edit={"x-nvidia-gpu-vbios-version": "96.00.5E.00.01"})),
     "differ from nvidia-smi"),
    ([_cmd("query-gpu", status="missing", rc=None)], "nvidia-smi not installed"),
])
def test_problems_name_what_is_not_attested(commands: list[dict[str, Any]], issue: str) -> None:
    assert any(issue in p for p in G.problems(G.summarize(_evidence(commands))))


def test_malformed_evidence_documents_are_refused() -> None:
    for bad in (b"{", json.dumps({"schema": "x", "nonce": SAMPLE_NONCE, "commands": []}).encode(),
                json.dumps({"schema": G.SCHEMA, "nonce": "short", "commands": []}).encode(),
                _evidence([_cmd("cc-status"), _cmd("cc-status")])):
        with pytest.raises(G.GpuEvidenceError):
            G.summarize(bad)


# --- collection (real subprocess code, stand-in executables) ---------------------------------------------

_FAKE_SMI = """#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
args = sys.argv[1:]
key = {{"-f": "cc-status", "-d": "cc-devtools", "-e": "cc-environment", "-q": "cc-query"}}.get(args[-1]) \\
    if args[:1] == ["conf-compute"] else "query-gpu"
f = d / key
if not f.exists():
    sys.stderr.write("Invalid combination of input arguments.\\n"); sys.exit(2)
sys.stdout.write(f.read_text())
rc = d / (key + ".rc")
sys.exit(int(rc.read_text()) if rc.exists() else 0)
"""

_FAKE_NVATTEST = """#!{python}
import os, sys
sys.path.insert(0, {tests!r})
from test_gpu_evidence import SAMPLE, _reencode
args = sys.argv[1:]
assert args[:6] == ["attest", "--device", "gpu", "--verifier", "local", "--nonce"] and args[7:] == ["--format", "json"]
sys.stdout.write(_reencode(SAMPLE.read_text(), args[6]))
"""


@pytest.fixture
def fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with stand-in nvidia-smi and nvattest; returns the directory of their outputs."""
    bin_dir, out = tmp_path / "bin", tmp_path / "smi"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("nvidia-smi", _FAKE_SMI), ("nvattest", _FAKE_NVATTEST)):
        exe = bin_dir / name
        exe.write_text(text.format(python=sys.executable, tests=str(Path(__file__).parent)))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    for key, fixture in (("query-gpu", "query_gpu_h100.txt"), ("cc-status", "cc_status_on.txt"),
                         ("cc-devtools", "cc_devtools_off.txt"), ("cc-environment", "cc_environment_production.txt")):
        (out / key).write_text(_fx(fixture))
    monkeypatch.setenv("FAKE_GPU_DIR", str(out))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return out


def test_collect_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    ev = collect_mod.collect("ef" * 32)
    assert (ev.info.present, ev.info.nvidia_smi, ev.info.cc_mode, ev.info.devices) == (False, "missing", "n/a", [])
    assert [c["status"] for c in json.loads(ev.data)["commands"]] == ["missing"] * 5
    assert ev.audit_data() == {"evidence_sha256": hashlib.sha256(ev.data).hexdigest(), "present": False, "devices": 0,
                               "cc_mode": "n/a", "nvidia_report": None}
    with pytest.raises(TeeError, match="no NVIDIA GPU visible"):
        collect_mod.require_confidential(ev.info)


def test_collect_with_nvidia_tools(fake_gpu: Path) -> None:
    nonce = "5a" * 32
    ev = collect_mod.collect(nonce)
    doc = json.loads(ev.data)
    assert [c["name"] for c in doc["commands"]] == ["query-gpu", "cc-status", "cc-devtools", "cc-environment",
                                                     "cc-query", "nvattest"]
    assert doc["commands"][4]["status"] == "error"  # this "driver" has no conf-compute -q
    assert doc["commands"][5]["argv"][-3] == nonce
    r = ev.info.nvidia_report
    assert ev.info.cc_mode == "on" and r is not None and (r.overall, r.nonce_match, r.consistent) == (True, True, True)
    collect_mod.require_confidential(ev.info)  # nothing to object to
    (fake_gpu / "cc-status").write_text(_fx("cc_status_off.txt"))
    with pytest.raises(TeeError, match="mode is off"):
        collect_mod.require_confidential(collect_mod.collect(nonce).info)
    (fake_gpu / "query-gpu").write_text("garbled\n")
    with pytest.raises(TeeError, match="cannot read the GPU state"):
        collect_mod.collect(nonce)


# --- the verifier step -------------------------------------------------------------------------------------


def _chain(evidence: bytes, nonce_from: str = "run.start") -> list[Any]:
    start = make_entry(seq=0, run_id="r", type=nonce_from, time="t", data={}, prev=GENESIS)
    ev = make_entry(seq=1, run_id="r", type="gpu.evidence", time="t",
                    data={"evidence_sha256": hashlib.sha256(evidence).hexdigest()}, prev=start.hash)
    return [start, ev]


def test_verifier_check_binds_file_manifest_and_audit_chain() -> None:
    start_hash = _chain(b"")[0].hash
    data = _evidence(_h100(nvattest=_reencode(SAMPLE.read_text(), start_hash)), nonce=start_hash)
    info = G.summarize(data)
    status, detail = G.check(data, info, _chain(data))
    assert status == "pass" and "CC mode on" in detail and "NOT attested" not in detail

    assert G.check(None, info, _chain(data))[0] == "fail"
    assert G.check(data + b" ", info, _chain(data)) == ("fail", f"the manifest's gpu summary is not what {G.FILE} says")
    other = _evidence(_h100(cc="cc_status_off.txt"), nonce=start_hash)
    assert "another gpu-evidence.json" in G.check(data, info, _chain(other))[1]
    assert G.check(data, info, _chain(data)[:1])[1] == "no gpu.evidence audit entry"
    stale = _evidence(_h100(), nonce="77" * 32)  # collected for another chain head
    assert "not fresh" in G.check(stale, G.summarize(stale), _chain(stale))[1]
    replayed = _evidence(_h100(nvattest=SAMPLE.read_text()), nonce=start_hash)  # NVIDIA report of another nonce
    assert G.check(replayed, G.summarize(replayed), _chain(replayed)) == (
        "fail", "the NVIDIA attestation report carries another nonce")
    off = _evidence(_h100(cc="cc_status_off.txt"), nonce=start_hash)
    status, detail = G.check(off, G.summarize(off), _chain(off))
    assert status == "pass" and "NOT attested confidential GPUs: GPU confidential-compute mode is off" in detail


# --- through the pipeline ---------------------------------------------------------------------------------


def _config(tmp_path: Path, **tee: Any) -> Path:
    cfg = {"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 2, "save_steps": 2}, "tee": tee}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_pipeline_binds_gpu_evidence_and_the_verifier_shows_it(fake_gpu: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(_config(tmp_path, gpu_evidence="required"))]) == 0
    out = capsys.readouterr().out
    assert "gpu: 1 x NVIDIA H100 80GB HBM3 (driver 580.159.03, VBIOS 96.00.D9.00.01); CC mode on" in out
    bundle = next((tmp_path / "out" / "exports").iterdir())
    manifest = json.loads((bundle / "manifest.json").read_text())
    evidence = (bundle / "gpu-evidence.json").read_bytes()
    assert manifest["files"]["gpu-evidence.json"] == manifest["gpu"]["evidence_sha256"] == hashlib.sha256(evidence).hexdigest()
    assert manifest["gpu"]["cc_mode"] == "on" and manifest["gpu"]["nvidia_report"]["nonce_match"] is True
    audit = [json.loads(line) for line in (bundle / "audit.jsonl").read_text().splitlines()]
    assert [e["type"] for e in audit][:2] == ["run.start", "gpu.evidence"]
    assert audit[1]["data"]["evidence_sha256"] == manifest["gpu"]["evidence_sha256"]
    policy = tmp_path / "out" / "simulator-test-policy.yaml"
    assert main(["verify", str(bundle), "--policy", str(policy)]) == 0
    assert "GPU: 1 x NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    assert main(["verify", str(bundle), "--policy", str(policy), "--json"]) == 0
    check = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "gpu.evidence")
    assert check["status"] == "pass" and "NVIDIA local verifier: overall True" in check["reason"]


def test_required_gpu_evidence_refuses_to_train_without_a_cc_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert main(["run", "--config", str(_config(tmp_path, gpu_evidence="required"))]) == 5
    assert "GPU evidence required but: no NVIDIA GPU visible" in capsys.readouterr().err
    assert not list((tmp_path / "out" / "exports").iterdir()) and not list((tmp_path / "out" / "runs").glob("*/adapter"))
    audit = [json.loads(line) for line in (tmp_path / "out" / "state" / "audit.jsonl").read_text().splitlines()]
    assert [e["type"] for e in audit] == ["run.start", "gpu.evidence", "run.abort"]  # the refusal is on the record
    assert audit[2]["data"] == {"category": "attestation", "error": "TeeError"}
    assert audit[1]["data"]["present"] is False


def test_bundles_from_before_gpu_evidence_are_a_skip_not_a_failure(tmp_path: Path) -> None:
    from attestation.bundle import manifest as B
    from attestation.bundle.verify import _gpu
    from attestation.verify import QuoteFindings

    unanchored = B.AuditInfo.model_construct(anchors=None)
    old = B.Manifest.model_construct(gpu=None, files={}, audit=unanchored)
    assert B.hashed_files(old) == B.HASHED_FILES and B.Manifest.model_fields["gpu"].default is None
    f = QuoteFindings()
    _gpu(f, tmp_path, old)
    assert [(c.name, c.status) for c in f.checks] == [("gpu.evidence", "skip")]
    new = B.Manifest.model_construct(gpu=G.summarize(_evidence(_h100())), files={}, audit=unanchored)
    assert B.hashed_files(new) == (*B.HASHED_FILES, "gpu-evidence.json")
    _gpu(f, tmp_path, new)  # the manifest records GPU evidence but the file is gone
    assert (f.checks[-1].status, f.checks[-1].detail) == ("fail", "gpu-evidence.json missing or unreadable")


def test_attested_mode_demands_nvidias_report_required_rests_on_nvidia_smi() -> None:
    from app.errors import TeeError
    from app.run.gpu import require_confidential

    smi_only = G.summarize(_evidence(_h100()))
    require_confidential(smi_only)  # required: nvidia-smi's CC flag is enough (and the detail says it is unsigned)
    assert "nvidia-smi's word only" in G.describe(smi_only) and "unsigned" in G.describe(smi_only)
    with pytest.raises(TeeError, match="GPU evidence attested but: no NVIDIA attestation report"):
        require_confidential(smi_only, attested=True)
    require_confidential(G.summarize(_evidence(_h100(nvattest=SAMPLE.read_text()))), attested=True)
