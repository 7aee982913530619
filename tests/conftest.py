"""Shared pytest fixtures."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.simulator import GuestAgentSimulator, SimulatorServer  # noqa: E402
from app.simulator.server import MAX_SOCKET_PATH  # noqa: E402


@pytest.fixture
def simulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatorServer]:
    """A dstack guest-agent simulator on a unix socket; ``DSTACK_SIMULATOR_ENDPOINT`` points at it.

    Yields the running :class:`SimulatorServer`; ``.agent`` is its :class:`GuestAgentSimulator`.
    """
    sock = tmp_path / "dstack.sock"
    short_dir = None
    if len(os.fsencode(str(sock))) > MAX_SOCKET_PATH:  # a long TMPDIR (macOS) would not fit in sun_path
        short_dir = tempfile.TemporaryDirectory(prefix="dstack-", dir="/tmp")
        sock = Path(short_dir.name) / "dstack.sock"
    server = SimulatorServer(GuestAgentSimulator(), socket_path=sock).start()
    monkeypatch.setenv("DSTACK_SIMULATOR_ENDPOINT", server.endpoint)
    try:
        yield server
    finally:
        server.stop()
        if short_dir is not None:
            short_dir.cleanup()


@pytest.fixture(scope="session")
def sim_bundle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small simulator run, shared read-only: ``dir`` (exports/<run_id>), ``policy`` (its test-CA policy),
    ``config`` (the YAML it ran with). Copy the bundle before changing anything in it."""
    import yaml

    from app.cli import main

    root = tmp_path_factory.mktemp("sim-bundle")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(root / "out")}, "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", str(cfg)]) == 0
    return {"dir": next((root / "out" / "exports").iterdir()), "policy": root / "out" / "simulator-test-policy.yaml",
            "config": cfg}
