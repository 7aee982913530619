"""State on the output volume that the host can edit between nights, and numbers that must be bounded before any
arithmetic: the privacy ledger is checked against the audit chain and the exported bundles, exports/PROMOTED against
the chain's promote entries, and the DP-SGD block of a manifest or a configuration is bounded before the accountant
runs (a refusal with its exit code, never an exception).

Run: ``python -m pytest tests/test_hardening_state.py -q`` (CPU; three short training runs shared by the tests).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import main
from app.config import Config, load_config
from app.errors import ConfigError, PromotionStateError
from app.run.pipeline import RunHooks, run_once
from tests.owner_fixtures import KEY, encrypt_to, jsonl, owner_key

SAMPLE = [json.loads(line) for line in (Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl")
          .read_text().splitlines() if line.strip()]
OWNER = owner_key()
LEDGER = Path("state") / "privacy-budget.json"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _audit_types(out: Path) -> list[str]:
    return [json.loads(line)["type"] for line in (out / "state" / "audit.jsonl").read_text().splitlines()]


# --- the lifetime privacy budget follows records the host cannot rewrite ---------------------------------------


def _dp_cfg(root: Path, **privacy: Any) -> Path:
    data = {"output": {"dir": str(root / "out")},
            "training": {"max_steps": 2, "save_steps": 2, "per_device_batch_size": 2, "gradient_accumulation_steps": 2,
                         "max_length": 64, "privacy": {"mode": "dp-sgd", "noise_multiplier": 1.0,
                                                       "target_epsilon": 30.0, **privacy}}}
    path = root / f"cfg-{len(list(root.glob('cfg-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def dp_volume(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One DP night on the sample; a lifetime cap that a second night of the same epsilon would exceed."""
    root = tmp_path_factory.mktemp("dp")
    assert main(["run", "--config", str(_dp_cfg(root))]) == 0
    (bundle,) = (root / "out" / "exports").iterdir()
    eps = json.loads((bundle / "manifest.json").read_text())["privacy"]["epsilon"]
    return {"root": root, "bundle": bundle, "epsilon": eps, "cap": round(eps * 1.5, 3)}


def _clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _edit_ledger(out: Path, change: Any) -> None:
    doc = json.loads((out / LEDGER).read_text())
    for entry in doc["datasets"].values():
        for run in entry["runs"].values():
            change(doc, run)
    (out / LEDGER).write_text(json.dumps(doc))


@pytest.mark.parametrize("tamper", ["empty", "epsilon 0.1", "epsilon NaN", "epsilon -100", "epsilon abc"])
def test_an_edited_ledger_is_refused_not_trusted(dp_volume: dict[str, Any], tmp_path: Path, tamper: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = _clone(dp_volume["root"], tmp_path / "vol")
    out = root / "out"
    if tamper == "empty":
        (out / LEDGER).write_text(json.dumps({"schema": "cvm-tune/privacy-budget/v1", "datasets": {}}))
    elif tamper == "epsilon NaN":  # json.dumps writes NaN, which Python's own parser accepts
        _edit_ledger(out, lambda _doc, run: run.update(epsilon=float("nan")))
    else:
        value = {"epsilon 0.1": 0.1, "epsilon -100": -100, "epsilon abc": "abc"}[tamper]
        _edit_ledger(out, lambda _doc, run: run.update(epsilon=value))
    before = _files(out / "exports"), (out / LEDGER).read_bytes(), _audit_types(out)
    capsys.readouterr()
    assert main(["run", "--config", str(_dp_cfg(root, lifetime_epsilon=dp_volume["cap"]))]) == 7
    err = capsys.readouterr().err
    assert "privacy-budget.json" in err and "Traceback" not in err
    assert (_files(out / "exports"), (out / LEDGER).read_bytes(), _audit_types(out)) == before  # nothing trained


def test_status_with_a_damaged_ledger_is_a_state_error(dp_volume: dict[str, Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = _clone(dp_volume["root"], tmp_path / "vol")
    _edit_ledger(root / "out", lambda _doc, run: run.update(epsilon="abc"))
    before = _files(root / "out")
    assert main(["status", "--config", str(_dp_cfg(root))]) == 7
    assert "no valid epsilon" in capsys.readouterr().err
    assert _files(root / "out") == before


def test_a_run_that_died_after_its_start_keeps_its_reservation_in_the_chain(dp_volume: dict[str, Any]) -> None:
    """run.start commits to the planned epsilon, so a deleted ledger is rebuilt with the reservation of a run that
    never recorded privacy.spent."""
    from attestation.bundle.audit import make_entry

    from app.run.privacy_budget import trusted_spend

    out = dp_volume["root"] / "out"
    start = next(json.loads(line) for line in (out / "state" / "audit.jsonl").read_text().splitlines()
                 if json.loads(line)["type"] == "run.start")
    assert start["data"]["privacy_planned"]["epsilon"] >= dp_volume["epsilon"]
    died = make_entry(seq=99, run_id="died", type="run.start", time="t", data={**start["data"]}, prev="0" * 64)
    trusted = trusted_spend([died], None)
    (entry,) = trusted.values()
    assert entry["runs"]["died"]["epsilon"] == start["data"]["privacy_planned"]["epsilon"]


# --- numbers bounded before the accountant: a rejection, never an exception -------------------------------------


@pytest.mark.parametrize(("change", "why"), [
    ({"accountant": "prv", "steps": 10**7}, "steps is outside [0, 100000] for the prv accountant"),
    ({"accountant": "prv", "noise_multiplier": 0.02, "sample_rate": 1.0, "steps": 1, "delta": 1e-5},
     "is not what the prv accountant gives"),  # computable without Opacus, and not what the block records
    ({"noise_multiplier": 1e-300}, "noise multiplier"),
    ({"noise_multiplier": 1e300}, "noise multiplier"),
    ({"rows": 10**4000}, "is outside [2, 1e+12]"),
    ({"expected_batch_size": 10**400}, "expected batch"),
])
def test_an_out_of_range_privacy_block_fails_the_check(dp_volume: dict[str, Any], tmp_path: Path,
                                                       change: dict[str, Any], why: str) -> None:
    from app.federated.admission import Admission, _Reject
    from attestation import verify_bundle
    from attestation.policy import load_policy

    bundle = shutil.copytree(dp_volume["bundle"], tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["privacy"].update(change)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    policy = load_policy(dp_volume["root"] / "out" / "simulator-test-policy.yaml")
    verdict = verify_bundle(bundle, policy=policy, now=1_900_000_000)
    (dp,) = [c for c in verdict.checks if c.name == "privacy.dp"]
    assert not verdict.accepted and dp.status == "fail" and why in dp.detail, dp.detail
    with pytest.raises(_Reject, match="rejected under policy"):  # federated admission: the same verification
        Admission(None, policy, tmp_path / "work")._check_bundle("c", 1, bundle, None, None)  # type: ignore[arg-type]


def test_verify_cli_rejects_a_prv_block_with_ten_million_steps(dp_volume: dict[str, Any], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bundle = shutil.copytree(dp_volume["bundle"], tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["privacy"].update(accountant="prv", steps=10**7)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    policy = dp_volume["root"] / "out" / "simulator-test-policy.yaml"
    assert main(["verify", str(bundle), "--policy", str(policy)]) == 1
    assert "FAIL privacy.dp" in capsys.readouterr().out


@pytest.mark.parametrize("privacy", [
    {"noise_multiplier": 1e-300},
    {"noise_multiplier": 1e300},
    {"accountant": "prv", "noise_multiplier": 1.0},  # with max_steps 10**7 below
    {"max_grad_norm": 1e300},
])
def test_out_of_range_dp_settings_exit_2_before_anything_is_written(tmp_path: Path, privacy: dict[str, Any]) -> None:
    cfg = tmp_path / "cfg.yaml"
    training: dict[str, Any] = {"privacy": {"mode": "dp-sgd", **privacy}}
    if privacy.get("accountant") == "prv":
        training["max_steps"] = 10**7
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")}, "training": training}))
    with pytest.raises(ConfigError):
        load_config(cfg)
    assert main(["run", "--config", str(cfg)]) == 2
    assert not (tmp_path / "out").exists()


def test_a_prv_plan_whose_mesh_is_too_large_is_a_config_error() -> None:
    from app.config import PrivacySettings, TrainingSettings
    from app.training.privacy import plan

    s = TrainingSettings(max_steps=10_000, per_device_batch_size=4, gradient_accumulation_steps=2,
                         privacy=PrivacySettings(mode="dp-sgd", accountant="prv", noise_multiplier=1.0,
                                                 target_epsilon=1000))
    with pytest.raises(ConfigError, match="would discretise") as exc:
        plan(s, rows=80)
    assert exc.value.exit_code == 2


# --- exports/PROMOTED must agree with the audit chain ----------------------------------------------------------


def _version(directory: Path, version: int, rows: list[dict], dataset_id: str = "tickets") -> None:
    encrypt_to(directory / f"{dataset_id}-v{version}.cvmds", jsonl(rows), signer=OWNER, dataset_id=dataset_id,
               dataset_version=version)


def _lineage_cfg(root: Path, dataset_id: str = "tickets") -> Config:
    key = root / "dataset.key"
    if not key.exists():
        key.write_bytes(KEY)
        key.chmod(0o600)
    return Config.model_validate({
        "output": {"dir": str(root / "out")},
        "dataset": {"source": "encrypted-file", "path": str(root / "data"), "dataset_id": dataset_id,
                    "owner_public_key": OWNER.public_key().public_bytes_raw().hex(),
                    "key": {"source": "file", "file": str(key)}},
        "training": {"max_steps": 2, "save_steps": 2, "init": "previous"},
        "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}})


@pytest.fixture(scope="module")
def lineage(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """v1 -> A (from the base model, promoted), v2 -> B (warm from A, promoted)."""
    root = tmp_path_factory.mktemp("lineage")
    (root / "data").mkdir()
    _version(root / "data", 1, SAMPLE[:40])
    a = run_once(_lineage_cfg(root), hooks=RunHooks(service=True))
    _version(root / "data", 2, SAMPLE[:60])
    b = run_once(_lineage_cfg(root), hooks=RunHooks(service=True))
    return {"root": root, "a": a.run_id, "b": b.run_id}


def _tampered_night(lineage: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: Any,
                    dataset_id: str = "tickets") -> tuple[PromotionStateError, list[dict[str, Any]]]:
    from app import alerts

    root = _clone(lineage["root"], tmp_path / "vol")
    tamper(root / "out" / "exports")
    _version(root / "data", 3, SAMPLE[:80], dataset_id=dataset_id)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(alerts, "send", lambda _s, event, output: sent.append(dict(event)) or False)
    exports, chain = _files(root / "out" / "exports"), (root / "out" / "state" / "audit.jsonl").read_bytes()
    with pytest.raises(PromotionStateError) as exc:
        run_once(_lineage_cfg(root, dataset_id), hooks=RunHooks(service=True))
    assert exc.value.exit_code == 7
    assert _files(root / "out" / "exports") == exports  # no bundle, pointers untouched
    assert (root / "out" / "state" / "audit.jsonl").read_bytes() == chain  # nothing started
    assert [e["event"] for e in sent] == ["state.inconsistent"]
    return exc.value, sent


def test_a_deleted_promoted_pointer_does_not_restart_the_lineage(lineage: dict[str, Any], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    exc, _ = _tampered_night(lineage, tmp_path, monkeypatch, lambda ex: (ex / "PROMOTED").unlink())
    assert "PROMOTED is missing" in exc.message and lineage["b"] in exc.message


def test_a_pointer_moved_back_to_an_older_bundle_is_refused(lineage: dict[str, Any], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    exc, sent = _tampered_night(lineage, tmp_path, monkeypatch,
                                lambda ex: (ex / "PROMOTED").write_text(f"{lineage['a']}\n"))
    assert f"names {lineage['a']}" in exc.message and "moved back" in exc.message
    assert lineage["b"] in sent[0]["reason"]


def test_a_promoted_bundle_replaced_by_another_volumes_is_refused(lineage: dict[str, Any], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  demo_bundle: tuple[Path, Path]) -> None:
    def replace(ex: Path) -> None:  # the demo run's bundle (another volume, the sample dataset) in B's place
        shutil.rmtree(ex / lineage["b"])
        shutil.copytree(demo_bundle[0], ex / lineage["b"])

    exc, _ = _tampered_night(lineage, tmp_path, monkeypatch, replace)
    assert "not a bundle exported on this output volume" in exc.message


def test_a_promoted_adapter_of_another_dataset_is_not_continued(lineage: dict[str, Any], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    exc, _ = _tampered_night(lineage, tmp_path, monkeypatch, lambda _ex: None, dataset_id="other-set")
    assert "trained on dataset 'tickets', not 'other-set'" in exc.message


def test_a_promotion_the_chain_missed_is_recorded_once_the_bundle_verifies(lineage: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """A run that moved PROMOTED and died before its promote entry: the next night records it and continues."""
    root = _clone(lineage["root"], tmp_path / "vol")
    chain = root / "out" / "state" / "audit.jsonl"
    lines = chain.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "promote" and json.loads(lines[-1])["run_id"] == lineage["b"]
    chain.write_bytes(b"".join(lines[:-1]))  # B's export is the chain head; PROMOTED names B
    _version(root / "data", 3, SAMPLE[:80])
    c = run_once(_lineage_cfg(root), hooks=RunHooks(service=True))
    entries = [json.loads(line) for line in chain.read_text().splitlines()]
    promotes = [(e["run_id"], e["seq"]) for e in entries if e["type"] == "promote"]
    assert [r for r, _ in promotes] == [lineage["a"], lineage["b"], c.run_id]
    start = next(e for e in entries if e["type"] == "run.start" and e["run_id"] == c.run_id)
    assert promotes[1][1] < start["seq"]  # recorded before the night started
    manifest = json.loads((c.bundle_dir / "manifest.json").read_text())
    assert manifest["lineage"]["parent_run_id"] == lineage["b"]
    assert main(["verify", str(c.bundle_dir), "--policy", str(root / "out" / "simulator-test-policy.yaml")]) == 0


@pytest.mark.parametrize("body", [b"[" * 200_000, b'{"schema": 1e999999}', b"\xff"])
def test_a_damaged_dataset_version_record_is_a_state_error(tmp_path: Path, body: bytes) -> None:
    from app.dataset.versions import FILE, load_state
    from app.errors import StateError

    (tmp_path / FILE).write_bytes(body)
    with pytest.raises(StateError):
        load_state(tmp_path)
    assert (tmp_path / FILE).read_bytes() == body  # nothing rewritten
