"""dstack 0.6's app-compose fields in the compose audit: what runs outside the containers (init_script) and a GPU policy
that weakens dstack's boot gate are findings (``compose-hash`` exit 1; ``verify`` fails ``compose.audit`` unless the
policy accepts them by name); the other 0.6 fields are read and reported, never silently passed; the page judges
them the same way, word for word (``web/src/compose.js``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from attestation.compose.dstack06 import audit06, gpu_policy_hash
from attestation.policy import Policy, load_policy
from tests.test_compose_audit import GOOD
from tests.test_web_verify import pytestmark as web_test
from tests.test_web_verify import web_copy  # noqa: F401  (the fixture: web/ rebuilt in a scratch directory)

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "tests" / "data" / "bundle"
NOW = "1765000000"

FINDINGS = {  # app-compose addition -> the finding's name
    "init script": ({"init_script": "echo hi > /dstack/x"}, "init_script"),
    "init scripts": ({"init_script": ["a", "b"]}, "init_script"),
    "attest_gpu false": ({"requirements": {"gpu_policy": {"attest_gpu": False}}}, "gpu_policy.attest_gpu"),
    "allow_devtools": ({"requirements": {"gpu_policy": {"allow_devtools": True}}}, "gpu_policy.allow_devtools"),
    "allow_debug": ({"requirements": {"gpu_policy": {"allow_debug": True}}}, "gpu_policy.allow_debug"),
    "allow_insecure_boot": ({"requirements": {"gpu_policy": {"allow_insecure_boot": True}}}, "gpu_policy.allow_insecure_boot"),
}
NOTES = {  # app-compose addition -> a phrase its note says
    "secure_time false": ({"secure_time": False}, "secure_time false: the CVM takes the host's clock"),
    "verity volume": ({"verity_volumes": [{"source": "/dev/vdb", "verity_root": "ab" * 32, "target": "/models"}]},
                      "verity volume /dev/vdb -> /models"),
    "event log v2": ({"event_log_version": 2}, "event_log_version 2: RTMR3 events are V2"),
    "manifest 3": ({"manifest_version": "3"}, "manifest_version '3': dstack 0.6 format"),
    "tpm": ({"key_provider": "tpm"}, "key_provider tpm: keys come from this machine's vTPM"),
    "rego": ({"requirements": {"gpu_policy": {"rego": "package policy\nnv_match := true"}}}, "a Rego relying-party policy"),
    "strict gpu policy": ({"requirements": {"gpu_policy": {"attest_gpu": True, "allow_debug": False}}}, None),
}
PROBLEMS = {  # app-compose addition -> a phrase of the problem no policy waives
    "six init scripts": ({"init_script": ["x"] * 6}, "init_script is not a bash script or a list of at most 5"),
    "unknown gpu_policy field": ({"requirements": {"gpu_policy": {"allow_everything": True}}}, "deny_unknown_fields"),
    "gpu_policy flag not bool": ({"requirements": {"gpu_policy": {"allow_debug": "yes"}}}, "is not true or false"),
    "manifest 4": ({"manifest_version": "4"}, "manifest_version '4' is not 1, 2 or 3"),
    "event log 3": ({"event_log_version": 3}, "event_log_version 3 is not 1 or 2"),
    "key provider hsm": ({"key_provider": "hsm"}, "key_provider 'hsm' is not one of"),
    "secure_time string": ({"secure_time": "no"}, "secure_time 'no' is not true or false"),
    "verity volume without root": ({"verity_volumes": [{"source": "/dev/vdb", "target": "/m"}]}, "verity_volumes is not a list"),
    "unknown requirement": ({"requirements": {"cpu": 1}}, "requirements.cpu is not a field dstack 0.6 knows"),
}


def _write(tmp_path: Path, extra: dict[str, Any]) -> Path:
    path = tmp_path / "app-compose.json"
    path.write_text(json.dumps({**GOOD, **extra}, indent=4))
    return path


def test_the_clean_app_compose_has_no_06_findings() -> None:
    assert audit06(GOOD) == ([], [], []) and gpu_policy_hash(GOOD) == ("44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c"
                                                                       "060f61caaff8a")


@pytest.mark.parametrize("extra, name", FINDINGS.values(), ids=FINDINGS.keys())
def test_compose_hash_exits_1_on_each_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict, name: str) -> None:
    findings, problems, _ = audit06({**GOOD, **extra})
    assert [n for n, _ in findings] == [name] and problems == []
    assert main(["compose-hash", str(_write(tmp_path, extra)), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == [findings[0][1]], "the 0.6 finding is the only problem"


@pytest.mark.parametrize("extra, phrase", NOTES.values(), ids=NOTES.keys())
def test_other_06_fields_are_read_and_reported_not_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict,
                                                          phrase: str | None) -> None:
    assert main(["compose-hash", str(_write(tmp_path, extra))]) == 0
    text = capsys.readouterr().out
    assert "PROBLEM" not in text
    if phrase:
        assert "NOTE          " in text and phrase in text, text


@pytest.mark.parametrize("extra, phrase", PROBLEMS.values(), ids=PROBLEMS.keys())
def test_malformed_06_fields_are_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict, phrase: str) -> None:
    assert main(["compose-hash", str(_write(tmp_path, extra)), "--json"]) == 1
    assert any(phrase in p for p in json.loads(capsys.readouterr().out)["problems"])


def test_the_gpu_policy_hash_is_dstacks_jcs_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SHA-256 of the JCS of the raw gpu_policy: an explicit default value changes it (reference §4)."""
    explicit = {"requirements": {"gpu_policy": {"attest_gpu": True}}}
    assert gpu_policy_hash({**GOOD, **explicit}) != gpu_policy_hash(GOOD)
    import hashlib
    assert gpu_policy_hash({**GOOD, **explicit}) == hashlib.sha256(b'{"attest_gpu":true}').hexdigest()
    main(["compose-hash", str(_write(tmp_path, explicit)), "--json"])
    assert json.loads(capsys.readouterr().out)["gpu_policy_hash"] == hashlib.sha256(b'{"attest_gpu":true}').hexdigest()


def _bundle_with(tmp_path: Path, extra: dict) -> Path:
    copy = shutil.copytree(SAMPLE, tmp_path / "b" / SAMPLE.name)
    doc = json.loads((copy / "app-compose.json").read_text())
    (copy / "app-compose.json").write_text(json.dumps({**doc, **extra}))
    return copy


def _verify(bundle: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    main(["verify", str(bundle), "--policy", str(policy), "--now", NOW, "--json"])
    return {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


@pytest.mark.parametrize("extra, name", [FINDINGS["init script"], FINDINGS["attest_gpu false"], FINDINGS["allow_devtools"]],
                         ids=["init_script", "attest_gpu", "allow_devtools"])
def test_verify_fails_compose_audit_unless_the_policy_accepts_the_finding_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict, name: str) -> None:
    bundle = _bundle_with(tmp_path, extra)
    base = load_policy(REPO / "tests" / "data" / "bundle-policy.yaml")
    strict = tmp_path / "strict.yaml"
    strict.write_text(base.to_yaml())
    assert _verify(bundle, strict, capsys)["compose.audit"]["status"] == "fail"
    other = [n for n in ("init_script", "gpu_policy.allow_debug") if n != name][0]
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(base.model_copy(update={"allowed_compose_findings": (other,)}).to_yaml())
    assert _verify(bundle, wrong, capsys)["compose.audit"]["status"] == "fail", "another name does not accept it"
    accepting = tmp_path / "accepting.yaml"
    accepting.write_text(base.model_copy(update={"allowed_compose_findings": (name,)}).to_yaml())
    check = _verify(bundle, accepting, capsys)["compose.audit"]
    assert check["status"] == "pass" and f"accepted by the policy: {name}" in check["reason"]


def test_the_sample_bundle_passes_compose_audit_and_a_policy_names_only_known_findings(
        capsys: pytest.CaptureFixture[str]) -> None:
    checks = _verify(SAMPLE, REPO / "tests" / "data" / "bundle-policy.yaml", capsys)
    assert checks["compose.audit"]["status"] == "pass"
    with pytest.raises(ValueError, match="unknown compose finding"):
        Policy(allowed_compose_findings=("everything",))


def _page_audit(web: Path, docs: list[dict]) -> list[Any]:
    from tests.test_web_units import call

    return call(web, *(("dstack06Audit", [json.dumps(d)]) for d in docs))


@web_test
def test_the_page_judges_the_06_fields_word_for_word(web_copy: Path) -> None:
    docs = [{**GOOD, **extra} for extra, _ in [*FINDINGS.values(), *NOTES.values(), *PROBLEMS.values()]]
    docs.append({**GOOD, "manifest_version": 3, "init_script": "", "requirements": {"os_version": "0.6.7",
                                                                                   "gpu_policy": {"allow_debug": False}}})
    got = _page_audit(web_copy, docs)
    want = [[[list(f) for f in a[0]], a[1], a[2]] for a in (audit06(d) for d in docs)]
    assert got == want


def test_app_compose_and_deploy_plan_predict_v3_where_a_06_vmm_makes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from app.deploy.plan import _check_inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docker-compose.yaml").write_text((REPO / "docker-compose.yaml").read_text())
    base = ["app-compose", "--image", "registry.example.com/cvm-tune@sha256:" + "5e" * 32, "--bundles-token-sha256", "ab" * 32]
    assert main([*base, "--key-provider-id", "cd" * 32, "--app-id", "ef" * 20, "--out-dir", "v3"]) == 0
    assert main([*base, "--out-dir", "v1"]) == 0
    out = capsys.readouterr().out
    assert "mr_config_id  v3 03 || SHA-256 of the MrConfigV3 document" in out and "mr_config_id  v1 01" in out
    for d, form in (("v3", "MRCONFIGID v3: 03 || SHA-256"), ("v1", "MRCONFIGID v1: 01")):
        (tmp_path / d / "secrets.env").write_text("CVM_TUNE_ALERT_WEBHOOK=https://alerts.example/hook\n")
        notes = _check_inputs(tmp_path / d / "app-compose.json", tmp_path / d / "secrets.env")
        assert any(n.startswith(form) for n in notes), notes
