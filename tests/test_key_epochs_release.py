"""A KMS key rotation between a key request and its grant (``app.keys_epoch``): the pending request, sealed under
the old key epochs, is opened with the old epoch's key, the grant is accepted and the released key is sealed under
the current epochs; a guest that ignores GetKey's epoch selectors is a clear error with nothing changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.config import TeeSettings
from app.keys_epoch import KeyEpochError
from app.tee import open_guest_agent
from tests.test_key_release import _key, _key_source, _release, flow, pending  # noqa: F401 (fixtures)


def _files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rotation_between_key_request_and_grant(pending: SimpleNamespace) -> None:
    state = pending.out / "state" / "key-release"
    assert json.loads((state / "pending.json").read_text())["key_epochs"] == {"root_epoch": 0, "app_epoch": 0}
    grant = _release(pending)
    before = _files(state)
    with open_guest_agent(TeeSettings(simulator={"dstack": "0.5", "app_epoch": 1})) as old_guest:
        with pytest.raises(KeyEpochError, match="reports no key epochs|ignores"):
            _key_source(pending, grant, old_guest).dataset_key()
    assert _files(state) == before  # nothing overwritten
    with open_guest_agent(TeeSettings(simulator={"app_epoch": 1})) as agent:  # rotated and rebooted
        assert _key_source(pending, grant, agent).dataset_key() == _key(pending.flow)
    sealed = [json.loads(p.read_text()) for p in state.glob("dataset-*.json")]
    assert [s["key_epochs"] for s in sealed] == [{"root_epoch": 0, "app_epoch": 1}]
    with open_guest_agent(TeeSettings(simulator={"app_epoch": 1})) as agent:  # a restart unseals it, no new grant
        (pending.out / "grant.json").unlink()
        assert _key_source(pending, b"{}", agent).released_key_for(pending.flow.root / "volume" / "data.cvmds")
