"""``cvm-tune verify BUNDLE --replay --dataset FILE --key-file KEY``: a nightly run re-executed from its bundle's
configuration, the base model and the owner's dataset gives the bundle's weights bit for bit; another dataset, or a
run whose weights changed after training, fails ``training.replay`` naming the hashes.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.owner_fixtures import KEY, encrypt_to, jsonl, owner_key

REPO = Path(__file__).resolve().parent.parent
ROWS = [json.loads(line) for line in (REPO / "app" / "data" / "sample.jsonl").read_text().splitlines() if line.strip()][:24]
OWNER = owner_key()


def _run(root: Path, rows: list[dict[str, Any]], version: int = 1) -> tuple[Path, Path, Path]:
    """A run on an owner-signed dataset with a key file: (bundle, dataset file, key file)."""
    from app.cli import main
    from tests.test_tabular import OWNER as TABULAR_OWNER
    from tests.test_tabular import _cfg

    root.mkdir(parents=True, exist_ok=True)
    data = root / f"tickets-v{version}.cvmds"
    encrypt_to(data, jsonl(rows), signer=TABULAR_OWNER, dataset_id="tickets", dataset_version=version)
    assert main(["run", "--config", str(_cfg(root, data))]) == 0  # the tabular tests' run: 3 steps, key file
    return next(p for p in (root / "out" / "exports").iterdir() if p.is_dir()), data, root / "dataset.key"


def _verify(bundle: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    from app.cli import main

    buf = io.StringIO()
    policy = bundle.parent.parent / "simulator-test-policy.yaml"
    with contextlib.redirect_stdout(buf):
        code = main(["verify", str(bundle), "--policy", str(policy), "--json", *extra])
    return code, json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _run(tmp_path_factory.mktemp("replay") / "honest", ROWS)


def test_a_run_replays_to_its_weights_bit_for_bit(honest: tuple[Path, Path, Path]) -> None:
    bundle, data, key = honest
    assert json.loads((bundle / "manifest.json").read_text())["backend"]["cpu_threads"] >= 1
    code, doc = _verify(bundle, "--replay", "--dataset", str(data), "--key-file", str(key))
    checks = {c["name"]: c for c in doc["checks"]}
    assert (code, doc["verdict"]) == (0, "accepted"), [c for c in doc["checks"] if c["status"] == "fail"]
    assert checks["dataset.file"]["status"] == "pass"
    assert checks["training.replay"]["status"] == "pass" and "bit-identical" in checks["training.replay"]["reason"]


def test_another_dataset_does_not_replay(honest: tuple[Path, Path, Path], tmp_path: Path) -> None:
    bundle, _data, key = honest
    other = tmp_path / "tickets-v2.cvmds"
    encrypt_to(other, jsonl(ROWS[:-3]), signer=OWNER, dataset_id="tickets", dataset_version=2)
    code, doc = _verify(bundle, "--replay", "--dataset", str(other), "--key-file", str(key))
    checks = {c["name"]: c for c in doc["checks"]}
    assert (code, doc["verdict"]) == (1, "rejected")
    assert checks["dataset.file"]["status"] == "fail" and checks["training.replay"]["status"] == "fail"
    assert "not the dataset the bundle names" in checks["training.replay"]["reason"]


def test_weights_changed_after_training_fail_the_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose weights were changed between training and export (its bundle is consistent: every file hash, the
    audit chain and the quote hold) verifies, but its replay gives other weights."""
    import app.training
    from safetensors.torch import load_file, save_file

    real = app.training.train

    def tampered(req: Any) -> Any:
        result = real(req)
        f = Path(result.adapter_dir) / "adapter_model.safetensors"
        tensors = load_file(str(f))
        name = next(k for k in sorted(tensors) if "lora_B" in k)
        tensors[name] = tensors[name] + 1e-3
        save_file(tensors, str(f))
        return result

    monkeypatch.setattr(app.training, "train", tampered)
    bundle, data, key = _run(tmp_path / "tampered", ROWS)
    monkeypatch.setattr(app.training, "train", real)
    code, doc = _verify(bundle)
    assert code == 0  # nothing in the bundle itself shows it
    code, doc = _verify(bundle, "--replay", "--dataset", str(data), "--key-file", str(key))
    replay = next(c for c in doc["checks"] if c["name"] == "training.replay")
    assert (code, replay["status"]) == (1, "fail") and "the bundle's are" in replay["reason"]


def test_replaying_a_run_needs_its_dataset_and_key(honest: tuple[Path, Path, Path]) -> None:
    from app.cli import main

    bundle, data, _key = honest
    policy = bundle.parent.parent / "simulator-test-policy.yaml"
    assert main(["verify", str(bundle), "--policy", str(policy), "--replay", "--dataset", str(data)]) == 2
    assert main(["verify", str(bundle), "--policy", str(policy), "--key-file", str(data)]) == 2
