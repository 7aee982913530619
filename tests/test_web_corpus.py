"""The browser verifier against ``cvm-tune verify --json`` on more kinds of bundle (tests/test_web_verify.py has the
harness, the demo bundle and its tampers): a DP-SGD run (rdp accountant), a confidential run (weights encrypted to
the dataset owner's and the operator's age keys; no identity given), a continual child (warm-started from the first
night, with its lineage and promotion decision), a DPO run, a DP-SGD run under the prv accountant (ε recomputed in
the page by its port of dp-accounting's PLD accountant), and an ops file given for a bundle that records no op chain.
Each is also tampered where its kind adds a bound field. Federated round bundles are in tests/test_web_rounds.py,
training-API checkpoints in tests/test_web_verify.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.run.pipeline import RunHooks, run_once
from attestation.outputs import confidential as C
from tests.test_confidential import EVAL, OPERATOR_ID, OWNER_ID, SAMPLE, _cfg, _encrypt
from tests.test_dpo import HELD_OUT, TRAIN_SUBJECTS, pair
from tests.test_web_verify import pytestmark, drive, packed_cases, python_verdict, same_checks, site, web_copy  # noqa: F401

DP = {"mode": "dp-sgd", "noise_multiplier": 1.0, "target_epsilon": 30.0}
OPS_CASE = "ops for a bundle without an op chain"
PRV = "dp, prv accountant"
DPO = {"objective": "dpo", "per_device_batch_size": 2, "gradient_accumulation_steps": 1}


def _run(root: Path, *, training: dict[str, Any] | None = None, recipients: tuple[str, ...] = (), owner: bool = False,
         rows: list[dict] | None = None, version: int = 1) -> tuple[Path, Path]:
    """One night on ``root`` (its data/ and out/ kept between nights): (bundle, simulator policy)."""
    from app.config import Config

    (root / "data").mkdir(exist_ok=True)
    _encrypt(root / "data" / f"tickets-v{version}.cvmds", rows or (SAMPLE[:60] + EVAL), version,
             (C.recipient_of(OWNER_ID),) if owner else ())
    doc = _cfg(root, recipients=recipients).model_dump(mode="json", by_alias=True)
    doc["training"].update(training or {})
    result = run_once(Config.model_validate(doc), hooks=RunHooks(service=True))
    return result.bundle_dir, root / "out" / "simulator-test-policy.yaml"


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """One bundle of each kind (built once for the module): name -> (bundle, simulator policy)."""
    cont = tmp_path_factory.mktemp("continual")
    made = {"continual parent": _run(cont), "continual child": _run(cont, rows=SAMPLE[:120] + EVAL, version=2)}
    made["dp"] = _run(tmp_path_factory.mktemp("dp"),
                      training={"privacy": DP, "per_device_batch_size": 2, "gradient_accumulation_steps": 2})
    made[PRV] = _run(tmp_path_factory.mktemp("prv"), training={
        "privacy": {**DP, "accountant": "prv"}, "per_device_batch_size": 2, "gradient_accumulation_steps": 2})
    made["confidential"] = _run(tmp_path_factory.mktemp("confidential"), owner=True,
                                recipients=(C.recipient_of(OPERATOR_ID),))
    made["dpo"] = _run(tmp_path_factory.mktemp("dpo"), training=DPO,
                       rows=[pair(s) for s in TRAIN_SUBJECTS] + [pair(s, split="eval") for s in HELD_OUT])
    return made


def _manifest_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(b: Path) -> None:
        m = json.loads((b / "manifest.json").read_bytes())
        change(m)
        (b / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return edit


def _config_privacy(b: Path) -> None:
    c = json.loads((b / "config.json").read_bytes())
    c["training"]["privacy"]["target_epsilon"] = 31.0
    (b / "config.json").write_text(json.dumps(c, sort_keys=True, separators=(",", ":")))


def _plaintext_weights(b: Path) -> None:
    (b / "adapter" / "adapter_model.safetensors.age").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


def _plain_names(b: Path) -> None:
    """The layout of a bundle made before ciphertext was named ``.age``: the age files under the plaintext names."""
    m = json.loads((b / "manifest.json").read_bytes())
    for age in [f for f in m["files"] if f.endswith(".safetensors.age")]:
        (b / age).rename(b / age.removesuffix(".age"))
        m["files"][age.removesuffix(".age")] = m["files"].pop(age)
    (b / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def _both_names(b: Path) -> None:
    shutil.copyfile(b / "adapter" / "adapter_model.safetensors.age", b / "adapter" / "adapter_model.safetensors")


# (kind, tamper name, edit): each kind untampered, then the fields its kind adds to a bundle
CASES: list[tuple[str, str, Callable[[Path], None] | None]] = [
    *((kind, "as exported", None) for kind in ("continual parent", "continual child", "dp", PRV, "confidential", "dpo")),
    ("dp", "recorded epsilon", _manifest_edit(lambda m: m["privacy"].update(epsilon=m["privacy"]["epsilon"] * 0.9))),
    ("dp", "config privacy", _config_privacy),
    ("dp", "privacy rows", _manifest_edit(lambda m: m["privacy"].update(rows=m["privacy"]["rows"] + 1))),
    (PRV, "recorded epsilon", _manifest_edit(lambda m: m["privacy"].update(epsilon=m["privacy"]["epsilon"] * 0.9))),
    (PRV, "recorded epsilon within the prv tolerance", _manifest_edit(lambda m: m["privacy"].update(
        epsilon=m["privacy"]["epsilon"] + 0.02))),
    (PRV, "noise multiplier", _manifest_edit(lambda m: m["privacy"].update(noise_multiplier=0.7, noise_derived=True))),
    ("confidential", "weights in plaintext", _plaintext_weights),
    ("confidential", "ciphertext under the plaintext names", _plain_names),
    ("confidential", "both names", _both_names),
    ("confidential", "recipients", _manifest_edit(lambda m: m["confidentiality"].update(
        recipients=m["confidentiality"]["recipients"][:-1]))),
    ("continual child", "lineage", _manifest_edit(lambda m: m["lineage"].update(parent_manifest_sha256="0" * 64))),
    ("dpo", "promotion decision", _manifest_edit(lambda m: m["evaluation"].update(
        promote=not m["evaluation"]["promote"]))),
]


@pytest.fixture(scope="module")
def shown(kinds: dict[str, tuple[Path, Path]], site: Any, web_copy: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, dict[str, Any]]:
    """Each case as the page showed it, with cvm-tune's verdict on the same bytes (``python``)."""
    pages, pythons = packed_cases(CASES, kinds, site, tmp_path_factory.mktemp("kinds"), "kind")
    dp = CASES.index(("dp", "as exported", None))  # with an ops file: the op chain check runs, and fails
    op = {"op": "optim_step", "adam_params": {"learning_rate": 1e-3}}
    (site.root / "ops.jsonl").write_text(json.dumps(op) + "\n")
    pythons.append(python_verdict(kinds["dp"][0], kinds["dp"][1], site.root / "ops.jsonl")[0])
    pages.append({"url": site.url(f"kind-{dp:02d}.tar.gz", f"kind-{dp:02d}.yaml", "ops.jsonl")})
    names = [f"{kind}: {name}" for kind, name, _ in CASES] + [OPS_CASE]
    return {n: {**p, "python": py} for n, p, py in zip(names, drive(web_copy, pages), pythons, strict=True)}


def test_the_page_recomputes_epsilon_of_either_accountant_as_cvm_tune_does(shown: dict[str, dict[str, Any]]) -> None:
    """privacy.dp shows the recomputed (ε, δ) to four digits: the page's figure is the Python verifier's, for the rdp
    accountant and for the prv accountant's PLD (within 0.03 + 0.5 % of the recorded ε: the last case passes)."""
    for case in ("dp: as exported", f"{PRV}: as exported", f"{PRV}: recorded epsilon within the prv tolerance"):
        page, py = shown[case], shown[case]["python"]
        mine, theirs = (next(c for c in v["checks"] if c["name"] == "privacy.dp") for v in (page["verdict"], py))
        assert mine["status"] == theirs["status"] == "pass", (case, mine, theirs)
        assert mine["reason"].split(" as ")[0] == theirs["reason"].split(" as ")[0] and "(ε, δ) = (" in mine["reason"]


@pytest.mark.parametrize("case", [f"{kind}: {name}" for kind, name, _ in CASES] + [OPS_CASE])
def test_the_page_agrees_with_cvm_tune_verify(shown: dict[str, dict[str, Any]], case: str) -> None:
    page = shown[case]
    same_checks(page, page["python"], case)
    assert page["verdict"]["verdict"] == ("accepted" if case.endswith("as exported") else "rejected")


def test_the_page_names_the_age_file_an_older_bundle_lacks(shown: dict[str, dict[str, Any]]) -> None:
    """Ciphertext under the plaintext name: the page fails manifest.schema with cvm-tune's own reason, which names the
    ``.age`` file the weights must be."""
    page = shown["confidential: ciphertext under the plaintext names"]
    mine = next(c for c in page["verdict"]["checks"] if c["name"] == "manifest.schema")
    theirs = next(c for c in page["python"]["checks"] if c["name"] == "manifest.schema")
    assert mine["status"] == theirs["status"] == "fail" and mine["reason"] == theirs["reason"]
    assert "named adapter/adapter_model.safetensors.age" in mine["reason"], mine
