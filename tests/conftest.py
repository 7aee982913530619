"""Shared pytest fixtures."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
import ssl  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.simulator import GuestAgentSimulator, SimulatorServer  # noqa: E402
from app.simulator.server import MAX_SOCKET_PATH  # noqa: E402
from tests.loopback_http import Route  # noqa: E402
from tests.loopback_http import Server as LoopbackServer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis keeps its example database and caches in a scratch directory, not in ``.hypothesis`` of the
    directory pytest started in (the checkout): set before any test module is collected."""
    from hypothesis.configuration import set_hypothesis_home_dir

    home = tempfile.mkdtemp(prefix="cvm-tune-hypothesis-")
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
    set_hypothesis_home_dir(home)
    # The suite leaves nothing in $HOME or $TMPDIR either: the caches cvm-tune's commands keep in a private directory
    # (matplotlib, Hugging Face, torch's compilers, Flower, ray) go to one of the session's, removed at its end.
    from app.cli.quiet import cache_env

    caches = Path(tempfile.mkdtemp(prefix="cvm-tune-test-caches-"))
    env, ray = cache_env(caches)
    config.add_cleanup(lambda: [shutil.rmtree(d, ignore_errors=True) for d in (caches, ray)])
    for name, value in env.items():
        os.environ.setdefault(name, value)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``CVM_TUNE_FAILURE_LOG`` set, each failure's report is appended to that file as soon as the test ends, so a
    run cut off by an outer time limit (the GPU machine's) still leaves the reason of every failure before the cut."""
    log = os.environ.get("CVM_TUNE_FAILURE_LOG")
    if log and report.failed:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n{report.capstderr[-4000:]}\n")


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test runs with a scratch directory as its working directory, so a relative path (the default
    ``output.dir: cvm-tune-output``, a ``verdict.json``, Hypothesis' example database) never reads or writes a
    user's files in the checkout (pytest's own cache is off: ``-p no:cacheprovider`` in pyproject.toml)."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base model (built locally, nothing downloaded), built once per session; tests only read it."""
    from app.training import build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_tiny_model(path)
    return path


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """A private directory for unix sockets whose paths fit in ``sun_path`` (107 bytes) whatever ``$TMPDIR`` is:
    the test's own temp directory when a socket name fits there, else a new directory under /tmp (removed after)."""
    if len(os.fsencode(str(tmp_path / "0123456789abcdef.sock"))) <= MAX_SOCKET_PATH:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="s-", dir="/tmp") as short:
        yield Path(short)


@pytest.fixture
def simulator(sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatorServer]:
    """A dstack guest-agent simulator on a unix socket; ``DSTACK_SIMULATOR_ENDPOINT`` points at it.

    Yields the running :class:`SimulatorServer`; ``.agent`` is its :class:`GuestAgentSimulator`.
    """
    server = SimulatorServer(GuestAgentSimulator(), socket_path=sock_dir / "dstack.sock").start()
    monkeypatch.setenv("DSTACK_SIMULATOR_ENDPOINT", server.endpoint)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def demo_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One short demo run shared by the tests that only read its output: (bundle dir, simulator policy file).
    Tests that change the bundle copy it first."""
    import yaml

    from app.cli import main

    root = tmp_path_factory.mktemp("demo-bundle")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(root / "out")}, "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", str(cfg)]) == 0
    return next((root / "out" / "exports").iterdir()), root / "out" / "simulator-test-policy.yaml"


@pytest.fixture
def serve() -> Iterator[Callable[..., LoopbackServer]]:
    """``serve(route, tls=None)`` starts a :class:`tests.loopback_http.Server`; all are stopped after the test."""
    servers: list[LoopbackServer] = []

    def start(route: Route, tls: ssl.SSLContext | None = None) -> LoopbackServer:
        servers.append(LoopbackServer(route, tls))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
