"""The training API on both simulated agent lines, and a KMS key rotation between ``save_state`` and ``load_state``:
the saved state, sealed under the old key epochs, loads after the server restarts under new ones and is re-sealed
under them (``app.keys_epoch``, ``app.api.proof.vault``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.keys_epoch import KeyEpochs, read_epochs
from tests.api_inproc import TOKENS, Client, fb_record, service


@pytest.mark.parametrize("dstack", ["0.5", "0.6"])
def test_save_then_load_after_a_restart(tmp_path: Path, dstack: str) -> None:
    conf = f"tee:\n  simulator:\n    dstack: '{dstack}'\n"
    with service(tmp_path, conf) as svc:
        c = Client(svc)
        m = c.create(seed=1)
        assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0] and c.optim_step(m)[0]
        path, bundle, _ops = c.save(m, "before-rotation")
        state = Path(svc.store.checkpoint(path).dir)
        records = dict(c.saved_records)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["tee"]["agent_version"] == ("0.6.7" if dstack == "0.6" else "0.5.11")
    assert read_epochs(state) == (KeyEpochs(0, 0) if dstack == "0.6" else None)
    rotated = conf + ("    root_epoch: 1\n    app_epoch: 2\n" if dstack == "0.6" else "")
    with service(tmp_path, rotated) as svc:  # restarted, after a KMS key rotation on 0.6
        c = Client(svc)
        c.saved_records = records
        ok, body, _target = c.load(path)
        assert ok, body
    if dstack == "0.6":
        assert read_epochs(state) == KeyEpochs(1, 2)
