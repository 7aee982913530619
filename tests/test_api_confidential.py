"""The training API with ``export.recipients``: every save's export bundle holds its weights only as age ciphertext to
those recipients and the CVM's own key, built in RAM as a nightly run's; anyone verifies the bundle and its op chain,
a recipient's identity opens the weights, and no tensor bytes of the adapter are anywhere on the volume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.api_drive import Server, _bundle, _steps
from tests.test_api import BASE, _client, _datums, _verify, close_clients, serving  # noqa: F401  (the fixture)
from tests.test_api_sealed import _ram, _windows

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes


@pytest.fixture(scope="module")
def owner() -> Any:
    import pyrage

    return pyrage.x25519.Identity.generate()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, owner: Any) -> Any:
    yield from serving(tmp_path_factory.mktemp("api-confidential"),
                       f"export:\n  recipients: ['{owner.to_public()}']\n")


def test_an_api_bundle_holds_its_weights_only_as_ciphertext_to_the_recipients(server: Server, owner: Any,
                                                                               tmp_path: Path) -> None:
    import pyrage
    from safetensors.torch import load

    tc = _client(server).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    ops: list[dict[str, Any]] = []
    _steps(tc, _datums(server), 3, ops)
    path = tc.save_weights_for_sampler("w3", user_metadata={"export": "true"}).result().path  # exported when asked
    bundle = _bundle(server, tc.model_id, path)

    cipher = (bundle / "adapter" / "adapter_model.safetensors.age").read_bytes()  # named as age's tools name it
    assert cipher.startswith(b"age-encryption.org/v1\n")
    manifest = json.loads((bundle / "manifest.json").read_text())
    block = manifest["confidentiality"]
    assert [f for f in manifest["files"] if ".safetensors" in f] == ["adapter/adapter_model.safetensors.age"]
    assert list(block["plaintext_sha256"]) == ["adapter/adapter_model.safetensors"]  # the plaintext's own name
    assert sorted(p.name for p in bundle.rglob("*.safetensors*")) == ["adapter_model.safetensors.age"]
    assert str(owner.to_public()) in block["recipients"] and block["cvm_recipient"] in block["recipients"]
    assert block["dataset_recipients"] == []

    code, out = _verify(server, bundle, ops, tmp_path)  # anyone: the quote, the op chain
    assert code == 0, out
    key = tmp_path / "owner.key"
    key.write_text(str(owner) + "\n")
    for extra, opened in (((), "skip"), (("--identity", str(key)), "pass")):  # anyone; the recipient
        code, checks = _checks(server, bundle, tmp_path, *extra)
        assert code == 0
        assert checks["confidential.outputs"]["status"] == "pass"  # one stanza per recipient, every weight file age
        assert checks["confidential.plaintext"]["status"] == opened
        assert checks["model.signature"]["status"] == opened  # over the decrypted weights

    tensors = load(pyrage.decrypt(cipher, [owner]))
    needles = [w for name, t in tensors.items() if "lora_" in name for w in _windows(t.numpy().tobytes())]
    assert len(needles) > 10
    hits = [p for p in server.out.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles)]
    assert hits == []  # nowhere on the volume: not the bundle, not the sealed state, not a temporary copy
    assert not _ram(server.out).exists()  # and nothing left in RAM



def _checks(srv: Server, bundle: Path, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """``cvm-tune verify BUNDLE --policy <simulator policy> --json`` in this process: (exit code, checks by name)."""
    import contextlib

    from app.cli import main

    out = tmp / f"verdict-{len(list(tmp.glob('verdict-*')))}.json"
    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        code = main(["verify", str(bundle), "--policy", str(srv.out / "simulator-test-policy.yaml"), "--json", *extra])
    return code, {c["name"]: c for c in json.loads(out.read_text())["checks"]}
