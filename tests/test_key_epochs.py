"""Key continuity across KMS key rotations: sealed checkpoints and the API's saved states record the key epochs they
were sealed under, are re-sealed under the current ones after a rotation (nothing lost, atomically), and an agent
that ignores GetKey's epoch selectors is a clear error with nothing changed (``app.keys_epoch``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import dstack_sdk
import pytest

from app.api.errors import BadRequest
from app.api.proof.vault import Vault
from app.dataset.keys import derive_key
from app.keys_epoch import EPOCHS_FILE, EpochKeys, KeyEpochError, KeyEpochs, read_epochs
from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings
from app.tee import GuestAgent
from app.training.checkpoints import record_epochs, rekey_checkpoints, restore_checkpoint, seal_checkpoint
from app.training.sealed import SWAP_SUFFIX, recover_swaps

PATH, PURPOSE = "cvm-tune/checkpoints/v1", "cvm-tune-checkpoint-key"
INPUTS = {"config": "c" * 64}
FP = hashlib.sha256(b"fp").hexdigest()


@pytest.fixture
def sim_agent(sock_dir: Path) -> Iterator[tuple[GuestAgentSimulator, GuestAgent]]:
    sim = GuestAgentSimulator()
    with SimulatorServer(sim, socket_path=sock_dir / "k.sock") as srv:
        yield sim, GuestAgent(dstack_sdk.DstackClient(srv.endpoint), endpoint=srv.endpoint, mode="dstack", embedded=sim)


def agent_on(sim: GuestAgentSimulator, sock: Path) -> tuple[SimulatorServer, GuestAgent]:
    srv = SimulatorServer(sim, socket_path=sock).start()
    return srv, GuestAgent(dstack_sdk.DstackClient(srv.endpoint), endpoint=srv.endpoint, mode="dstack", embedded=sim)


class _stopping:
    def __init__(self, srv: SimulatorServer) -> None:
        self.srv = srv

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.srv.stop()


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def plain_checkpoint(tmp: Path, step: int) -> Path:
    src = tmp / f"plain-{step}"
    src.mkdir()
    (src / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (src / "adapter_model.safetensors").write_bytes(bytes(range(256)) * step)
    return src


def night(tmp: Path, keys: EpochKeys, step: int) -> Path:
    """What a run leaves: its checkpoints dir with the key's epochs and one sealed checkpoint."""
    ckpts = tmp / "out" / "runs" / "run-1" / "checkpoints"
    record_epochs(ckpts, keys.current_epochs)
    seal_checkpoint(plain_checkpoint(tmp, step), ckpts, key=keys.current, fingerprint=FP, inputs=INPUTS, step=step,
                    keep=3)
    return ckpts


# ------------------------------------------------------------------------------------------------ the raw call
def test_get_key_at_selects_and_checks_epochs(sim_agent) -> None:
    sim, agent = sim_agent
    key0, epochs = agent.get_key_at(PATH, PURPOSE)
    assert epochs == KeyEpochs(0, 0) and key0 == agent.get_key(PATH, PURPOSE)  # the SDK's key, same bytes
    sim.rotate(root_epoch=1)
    key1, epochs = agent.get_key_at(PATH, PURPOSE)
    assert epochs == KeyEpochs(1, 0) and key1 != key0
    assert agent.get_key_at(PATH, PURPOSE, KeyEpochs(0, 0)) == (key0, KeyEpochs(0, 0))


def test_get_key_at_detects_an_agent_ignoring_selectors(sock_dir: Path) -> None:
    srv, agent = agent_on(GuestAgentSimulator(SimulatorSettings(dstack="0.5", app_epoch=1)), sock_dir / "o.sock")
    with _stopping(srv):
        assert agent.get_key_at(PATH, PURPOSE)[1] is None
        with pytest.raises(KeyEpochError, match="ignores GetKey's epoch selectors") as err:
            agent.get_key_at(PATH, PURPOSE, KeyEpochs(0, 0))
        assert "0.6.6" in err.value.fix


# ------------------------------------------------------------------------------------------------ checkpoints
def test_rotation_between_two_nights_reseals_checkpoints(sim_agent, tmp_path: Path) -> None:
    sim, agent = sim_agent
    first = EpochKeys(agent, PATH, PURPOSE, derive_key)
    ckpts = night(tmp_path, first, 4)
    sim.rotate(app_epoch=1)  # KMS app-key rotation, CVM rebooted
    second = EpochKeys(agent, PATH, PURPOSE, derive_key)
    assert second.current != first.current
    ram = tmp_path / "ram"
    ram.mkdir()
    assert rekey_checkpoints(tmp_path / "out" / "runs", second, ram) == ["run-1/checkpoint-4"]
    assert read_epochs(ckpts / "checkpoint-4") == read_epochs(ckpts) == KeyEpochs(0, 1)
    assert list(ram.iterdir()) == [] and not list(ckpts.glob(f"*{SWAP_SUFFIX}"))
    choice = restore_checkpoint(ckpts, key=second.current, fingerprint=FP, inputs=INPUTS, scratch=tmp_path / "s")
    assert choice.step == 4 and (choice.path / "adapter_model.safetensors").read_bytes() == bytes(range(256)) * 4
    assert rekey_checkpoints(tmp_path / "out" / "runs", EpochKeys(agent, PATH, PURPOSE, derive_key), ram) == []


def test_agent_ignoring_selectors_stops_with_nothing_changed(sim_agent, tmp_path: Path, sock_dir: Path) -> None:
    _sim, agent = sim_agent
    ckpts = night(tmp_path, EpochKeys(agent, PATH, PURPOSE, derive_key), 2)
    before = tree(ckpts)
    srv, old_agent = agent_on(GuestAgentSimulator(SimulatorSettings(dstack="0.5", root_epoch=1)), sock_dir / "o.sock")
    with _stopping(srv):
        keys = EpochKeys(old_agent, PATH, PURPOSE, derive_key)
        with pytest.raises(KeyEpochError, match="reports no key epochs"):
            rekey_checkpoints(tmp_path / "out" / "runs", keys, tmp_path)
    assert tree(ckpts) == before


def test_interrupted_swap_is_recovered(sim_agent, tmp_path: Path) -> None:
    _sim, agent = sim_agent
    ckpts = night(tmp_path, EpochKeys(agent, PATH, PURPOSE, derive_key), 3)
    (ckpts / "checkpoint-3").rename(ckpts / f"checkpoint-3{SWAP_SUFFIX}")  # killed between the two renames
    recover_swaps(ckpts)
    assert (ckpts / "checkpoint-3" / "manifest.enc").is_file() and not list(ckpts.glob(f"*{SWAP_SUFFIX}"))


def test_unrecorded_legacy_checkpoint_opens_with_epoch_zero(sim_agent, tmp_path: Path) -> None:
    sim, agent = sim_agent
    keys0 = EpochKeys(agent, PATH, PURPOSE, derive_key)
    ckpts = tmp_path / "out" / "runs" / "run-1" / "checkpoints"
    seal_checkpoint(plain_checkpoint(tmp_path, 1), ckpts, key=keys0.current, fingerprint=FP, inputs=INPUTS, step=1, keep=3)
    assert not (ckpts / EPOCHS_FILE).exists()  # sealed by a version that recorded nothing
    sim.rotate(root_epoch=2)
    keys = EpochKeys(agent, PATH, PURPOSE, derive_key)
    assert rekey_checkpoints(tmp_path / "out" / "runs", keys, tmp_path) == ["run-1/checkpoint-1"]
    assert restore_checkpoint(ckpts, key=keys.current, fingerprint=FP, inputs=INPUTS, scratch=tmp_path / "s").step == 1


# ------------------------------------------------------------------------------------------------ API saved states
class _Ckpt:
    def __init__(self, d: Path) -> None:
        self.path, self.owner, self.kind, self.dir, self.op_head, self.ops = "tinker://x", "o", "training", str(d), "h", 3
        self.lora = {"rank": 4}


def test_rotation_between_save_state_and_load_state(sim_agent, tmp_path: Path, sock_dir: Path) -> None:
    sim, agent = sim_agent
    vault = Vault(tmp_path / "api", tmp_path / "ram", EpochKeys(agent, "cvm-tune/api-checkpoints/v1", "p", derive_key))
    c = _Ckpt(tmp_path / "api" / "state-1")
    src = tmp_path / "state"
    src.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt"):
        (src / name).write_bytes(name.encode() * 10)
    vault.seal(src, c)
    assert read_epochs(Path(c.dir)) == KeyEpochs(0, 0)
    before = tree(Path(c.dir))

    srv, old = agent_on(GuestAgentSimulator(SimulatorSettings(dstack="0.5", app_epoch=1)), sock_dir / "o.sock")
    with _stopping(srv):  # a guest that ignores the selectors: refused, nothing changed
        stale = Vault(tmp_path / "api", tmp_path / "ram", EpochKeys(old, "cvm-tune/api-checkpoints/v1", "p", derive_key))
        with pytest.raises(BadRequest, match="key rotation"), stale.opened(c):
            pass
    assert tree(Path(c.dir)) == before

    sim.rotate(app_epoch=1)  # server restarted after an app-key rotation
    vault = Vault(tmp_path / "api", tmp_path / "ram", EpochKeys(agent, "cvm-tune/api-checkpoints/v1", "p", derive_key))
    with vault.opened(c) as state:
        assert (state / "optimizer.pt").read_bytes() == b"optimizer.pt" * 10
    assert read_epochs(Path(c.dir)) == KeyEpochs(0, 1)
    with vault.opened(c) as state:  # re-sealed: opens with the current key alone
        assert (state / "adapter_model.safetensors").is_file()


def test_the_raw_call_covers_v1_and_attest(sim_agent, sock_dir: Path) -> None:
    from app.errors import TeeError

    _sim, agent = sim_agent
    assert agent.v1("Version", {})["version"] == "0.6.7"
    key = agent.v1("GetKey", {"domain": "d", "algorithm": "ed25519"})
    assert len(bytes.fromhex(key["public_key"])) == 32
    assert agent.attest(b"\x01")[:2] == b"\x00\x00"  # SCALE V0
    with pytest.raises(TeeError, match="newer than the current"):
        agent.get_key_at(PATH, PURPOSE, KeyEpochs(0, 5))
    srv, old = agent_on(GuestAgentSimulator(SimulatorSettings(dstack="0.5")), sock_dir / "o.sock")
    with _stopping(srv):
        with pytest.raises(TeeError, match="HTTP 404"):
            old.v1("Version", {})


def test_a_checkpoint_no_key_opens_is_kept_aside_not_deleted(sim_agent, tmp_path: Path) -> None:
    """A rotation on a guest that reports no epochs cannot be detected: the checkpoint is kept, never deleted."""
    _sim, agent = sim_agent
    ckpts = night(tmp_path, EpochKeys(agent, PATH, PURPOSE, derive_key), 2)
    before = tree(ckpts / "checkpoint-2")
    choice = restore_checkpoint(ckpts, key=b"\x07" * 32, fingerprint=FP, inputs=INPUTS, scratch=tmp_path / "s")
    assert choice.path is None and choice.rejected == [("checkpoint-2", "sealed with another key (other app id)")]
    assert tree(ckpts / "checkpoint-2.other-key") == before


def test_a_federated_client_opens_a_global_adapter_sent_to_its_recipient_of_before_a_rotation(tmp_path: Path) -> None:
    from attestation.outputs import confidential as C

    from app.config import Config, TeeSettings
    from app.errors import DataError
    from app.export.confidential import cvm_identity
    from app.federated.secure import decrypt_global
    from app.tee import open_guest_agent

    with open_guest_agent(TeeSettings()) as agent:  # the recipient the client's round bundle announced
        ciphertext = C.encrypt(b"global weights", (C.recipient_of(cvm_identity(agent.get_key)),))
    rotated = Config.model_validate({"tee": {"simulator": {"root_epoch": 1}}})
    directory, data = decrypt_global(rotated, ciphertext, tmp_path)
    assert data == b"global weights" and (directory / "adapter_model.safetensors").read_bytes() == data
    old_guest = Config.model_validate({"tee": {"simulator": {"dstack": "0.5", "root_epoch": 1}}})
    with pytest.raises(DataError, match="not encrypted to this CVM's key"):
        decrypt_global(old_guest, ciphertext, tmp_path)
