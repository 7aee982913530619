"""The training API's TLS key (and certificate) survive restarts and KMS key rotations: sealed under
``<output>/api/tls/`` with the key epochs, re-sealed under the current ones after a rotation, and an agent that
ignores GetKey's epoch selectors is :class:`KeyEpochError` with nothing overwritten (``app.api.http.tls``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import dstack_sdk
import pytest

from app.api.http.tls import SEALED_DIR, SEALED_FILE, TLS_KEY_PATH, tls_identity
from app.errors import StateError
from app.keys_epoch import EPOCHS_FILE, KeyEpochError, KeyEpochs, read_epochs
from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings
from app.tee import GuestAgent
from app.training.sealed import SWAP_SUFFIX

NAMES = ("api.example",)


@pytest.fixture
def sim_agent(sock_dir: Path) -> Iterator[tuple[GuestAgentSimulator, GuestAgent]]:
    sim = GuestAgentSimulator()
    with SimulatorServer(sim, socket_path=sock_dir / "t.sock") as srv:
        yield sim, GuestAgent(dstack_sdk.DstackClient(srv.endpoint), endpoint=srv.endpoint, mode="dstack", embedded=sim)


def files(home: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(home.iterdir())}


def derived_spki(agent: GuestAgent) -> bytes:
    """The SHA-256 of the SPKI of the key GetKey derives now (what the server used before the key was sealed)."""
    from cryptography.hazmat.primitives import serialization

    from app.export.signing import derive_key

    pub = derive_key(agent.get_key, TLS_KEY_PATH).public_key()
    return hashlib.sha256(pub.public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)).digest()


def test_the_tls_key_survives_a_key_rotation(sim_agent, tmp_path: Path, sock_dir: Path) -> None:
    sim, agent = sim_agent
    state, home = tmp_path / "api", tmp_path / "api" / SEALED_DIR
    first = tls_identity(agent, NAMES, state)  # first start on epoch (0, 0): derived as before, then sealed
    assert first.spki_sha256 == derived_spki(agent)
    assert read_epochs(home) == KeyEpochs(0, 0) and sorted(files(home)) == sorted([EPOCHS_FILE, SEALED_FILE])
    assert b"PRIVATE KEY" not in (home / SEALED_FILE).read_bytes()
    assert os.stat(home / SEALED_FILE).st_mode & 0o777 == 0o600
    before = files(home)
    assert tls_identity(agent, NAMES, state) == first and files(home) == before  # a restart: opened, not re-sealed

    old = GuestAgentSimulator(SimulatorSettings(dstack="0.5", app_epoch=1))  # a rotated guest that ignores selectors
    with SimulatorServer(old, socket_path=sock_dir / "o.sock") as srv:
        stale = GuestAgent(dstack_sdk.DstackClient(srv.endpoint), endpoint=srv.endpoint, mode="dstack", embedded=old)
        with pytest.raises(KeyEpochError, match="reports no key epochs"):
            tls_identity(stale, NAMES, state)
    assert files(home) == before

    sim.rotate(root_epoch=1, app_epoch=2)  # a KMS key rotation, then the server restarts
    assert derived_spki(agent) != first.spki_sha256  # GetKey now derives another key ...
    again = tls_identity(agent, NAMES, state)
    assert again.spki_sha256 == first.spki_sha256 and again.cert_pem == first.cert_pem  # ... the server keeps its own
    assert read_epochs(home) == KeyEpochs(1, 2) and files(home) != before
    assert not list(tmp_path.joinpath("api").glob(f"*{SWAP_SUFFIX}")) and not list(state.glob(".tmp-*"))
    resealed = files(home)
    assert tls_identity(agent, NAMES, state) == first and files(home) == resealed  # opens with the current key alone


def test_changed_names_reissue_the_certificate_for_the_same_key(sim_agent, tmp_path: Path) -> None:
    _sim, agent = sim_agent
    first = tls_identity(agent, NAMES, tmp_path / "api")
    other = tls_identity(agent, ("other.example",), tmp_path / "api")
    assert other.cert_pem != first.cert_pem and other.spki_sha256 == first.spki_sha256
    assert tls_identity(agent, ("other.example",), tmp_path / "api") == other


def test_a_changed_sealed_identity_is_refused_and_kept(sim_agent, tmp_path: Path) -> None:
    _sim, agent = sim_agent
    tls_identity(agent, NAMES, tmp_path / "api")
    sealed = tmp_path / "api" / SEALED_DIR / SEALED_FILE
    blob = bytearray(sealed.read_bytes())
    blob[-1] ^= 1
    sealed.write_bytes(bytes(blob))
    with pytest.raises(StateError, match="does not open"):
        tls_identity(agent, NAMES, tmp_path / "api")
    assert sealed.read_bytes() == bytes(blob)


def test_a_swap_cut_short_is_undone(sim_agent, tmp_path: Path) -> None:
    _sim, agent = sim_agent
    first = tls_identity(agent, NAMES, tmp_path / "api")
    home = tmp_path / "api" / SEALED_DIR
    home.rename(home.with_name(home.name + SWAP_SUFFIX))  # killed between the two renames of a swap
    (tmp_path / "api" / f".tmp-{SEALED_DIR}-x").mkdir()  # and the stage it left
    assert tls_identity(agent, NAMES, tmp_path / "api") == first
    assert sorted(p.name for p in (tmp_path / "api").iterdir()) == [SEALED_DIR]
