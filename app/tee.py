"""The guest-agent seam: the only code that talks to dstack (or the simulator), via ``dstack_sdk``.

``open_guest_agent(settings)`` yields a :class:`GuestAgent`:

* ``embedded-simulator``: starts ``app.simulator`` in-process on a private unix socket and talks
  to it through the real ``dstack_sdk.DstackClient`` (same code path as in a CVM);
* ``dstack``: ``settings.endpoint``, else ``$DSTACK_SIMULATOR_ENDPOINT``, else the first existing
  of dstack's socket paths. Nothing reachable -> :class:`NoTeeError`; the app never exports an
  unattested adapter.

EmitEvent exists on dstack OS 0.5.x and is gone from the simulator >= 0.5.9 and from 0.6: the
first emit detects support (HTTP 400 = unsupported; accepted but absent from the event log =
no-op agent) and the result is recorded in the manifest.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from dstack_sdk import DstackClient

from app.config import TeeSettings
from app.errors import NoTeeError, TeeError

SOCKET_PATHS = ("/var/run/dstack.sock", "/run/dstack.sock", "/var/run/dstack/dstack.sock", "/run/dstack/dstack.sock")
SIMULATOR_REV_PREFIX = "cvm-tune-simulator"
_RETRIES = 3


@dataclass(frozen=True)
class Identity:
    """What the agent says about this CVM (Info + Version)."""

    app_id: str
    instance_id: str
    compose_hash: str
    app_compose: str
    version: str
    rev: str

    @property
    def is_cvm_tune_simulator(self) -> bool:
        return self.rev.startswith(SIMULATOR_REV_PREFIX)


class EmitUnsupported(TeeError):
    """The agent does not extend RTMR3 for app events."""


class GuestAgent:
    """Thin adapter over ``DstackClient`` with retries and errors the CLI can print."""

    def __init__(self, client: DstackClient, *, endpoint: str, mode: str, embedded: Any = None) -> None:
        self._client = client
        self.endpoint = endpoint
        self.mode = mode
        self._embedded = embedded  # the in-process simulator, when mode is embedded-simulator

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        last: Exception | None = None
        for attempt in range(_RETRIES):
            try:
                return fn(*args)
            except httpx.HTTPStatusError as exc:
                raise TeeError(f"guest agent refused {what}: HTTP {exc.response.status_code} {_error_text(exc)}") from exc
            except httpx.TransportError as exc:  # includes timeouts: the agent may be restarting
                last = exc
                if attempt < _RETRIES - 1:
                    time.sleep(0.2 * 2**attempt)
        raise TeeError(f"guest agent at {self.endpoint} did not answer {what}: {type(last).__name__}") from last

    def identity(self) -> Identity:
        """Info + Version (Version is absent before OS 0.5.7: recorded as 'unknown')."""
        info = self._call("Info", self._client.info)
        try:
            ver = self._client.version()
            version, rev = ver.version, ver.rev
        except (httpx.HTTPError, ValueError):
            version, rev = "unknown", "unknown"
        return Identity(info.app_id, info.instance_id, info.compose_hash, info.tcb_info.app_compose, version, rev)

    def get_key(self, path: str, purpose: str) -> bytes:
        """GetKey: 32 bytes, deterministic per (app id, path)."""
        return self._call("GetKey", self._client.get_key, path, purpose).decode_key()

    def quote(self, report_data: bytes) -> tuple[bytes, str]:
        """GetQuote -> (quote bytes, event log JSON text as returned)."""
        if len(report_data) != 64:
            raise TeeError("report_data must be exactly 64 bytes here (the manifest binding)")
        resp = self._call("GetQuote", self._client.get_quote, report_data)
        return resp.decode_quote(), resp.event_log

    def emit(self, name: str, payload: bytes) -> None:
        """EmitEvent; :class:`EmitUnsupported` when the agent answers 400 (no such RPC)."""
        try:
            self._client.emit_event(name, payload)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code in (400, 404, 501):
                raise EmitUnsupported(f"guest agent does not support EmitEvent ({_error_text(exc)})") from exc
            raise TeeError(f"EmitEvent failed: HTTP {exc.response.status_code}") from exc
        except httpx.TransportError as exc:
            raise TeeError(f"EmitEvent did not reach the guest agent: {type(exc).__name__}") from exc

    def last_runtime_event(self) -> tuple[str, bytes] | None:
        """The newest RTMR3 event in Info's (unstripped) log, to confirm an emit really landed."""
        log = self._call("Info", self._client.info).tcb_info.event_log
        runtime = [e for e in log if e.imr == 3]
        return (runtime[-1].event, bytes.fromhex(runtime[-1].event_payload)) if runtime else None

    def simulator_root_der(self) -> bytes:
        """The cvm-tune simulator's TEST root CA (for a test-CA policy).

        Raises:
            TeeError: the agent is not the cvm-tune simulator.
        """
        if self._embedded is not None:
            return bytes(self._embedded.test_root_ca_der)
        if self.identity().is_cvm_tune_simulator:
            return bytes.fromhex(_post(self.endpoint, "SimulatorCollateral", 30.0)["root_ca_der"])
        raise TeeError("only the cvm-tune simulator has a test root CA")

    def collateral(self, quote: bytes, *, pccs_url: str, timeout_s: float) -> str | None:
        """Collateral for the bundle: the simulator's test collateral, or the PCCS's (network, through the HTTP
        edge: :func:`attestation.tdx.pccs.fetch_collateral`, the whole fetch within ``timeout_s``).

        Raises:
            CollateralError: the PCCS could not be reached or did not answer collateral (a ``PccsError``); the
                caller reports it and, where it can, goes on without collateral and says so.
        """
        if self._embedded is not None:
            return str(self._embedded.collateral_json())
        if self.identity().is_cvm_tune_simulator:
            # Simulator-only extension route (documented in app.simulator): not part of dstack.
            return str(_post(self.endpoint, "SimulatorCollateral", timeout_s)["collateral"])
        from attestation.tdx.pccs import fetch_collateral

        return fetch_collateral(quote, pccs_url=pccs_url, timeout=timeout_s, retries=2, deadline_s=timeout_s)

    def bundle_collateral(self, quote: bytes, *, mode: str, pccs_url: str, timeout_s: float) -> tuple[str | None, str]:
        """``(collateral, why it is missing)`` for an export or round bundle: ``tee.collateral: none`` asks for none,
        a failed fetch is returned with its reason (never raised: the bundle is still exported, and says so)."""
        from attestation.errors import CollateralError

        if mode == "none":
            return None, "tee.collateral is 'none'"
        try:
            collateral = self.collateral(quote, pccs_url=pccs_url, timeout_s=timeout_s)
        except CollateralError as exc:
            return None, f"fetching it from {pccs_url} failed: {exc.message}"
        return collateral, "" if collateral is not None else "the guest agent returned none"


def _error_text(exc: httpx.HTTPStatusError) -> str:
    try:
        return str(exc.response.json().get("error", ""))[:200]
    except ValueError:
        return exc.response.text[:200]


def _post(endpoint: str, method: str, timeout_s: float) -> dict[str, Any]:
    if endpoint.startswith(("http://", "https://")):
        client = httpx.Client(base_url=endpoint, timeout=timeout_s)
    else:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint), base_url="http://localhost", timeout=timeout_s)
    with client:
        resp = client.post(f"/{method}", json={})
        resp.raise_for_status()
        return dict(resp.json())


def resolve_endpoint(settings: TeeSettings) -> str:
    """The guest-agent endpoint for dstack mode, checked to exist.

    Raises:
        NoTeeError: nothing configured and no socket found, or the path is not a socket.
    """
    endpoint = settings.endpoint or os.environ.get("DSTACK_SIMULATOR_ENDPOINT")
    if endpoint is None:
        endpoint = next((p for p in SOCKET_PATHS if os.path.exists(p)), None)
        if endpoint is None:
            raise NoTeeError(
                "no dstack guest agent: /var/run/dstack.sock does not exist and DSTACK_SIMULATOR_ENDPOINT is not set",
                fix="mount /var/run/dstack.sock into the container, or run `cvm-tune simulator --socket PATH` "
                "and set DSTACK_SIMULATOR_ENDPOINT=PATH (or use tee.mode: embedded-simulator for a demo)",
            )
    if not endpoint.startswith(("http://", "https://")):
        try:
            is_socket = stat.S_ISSOCK(os.stat(endpoint).st_mode)
        except OSError:
            raise NoTeeError(f"guest-agent socket {endpoint} does not exist") from None
        if not is_socket:
            # Docker creates a directory when the host path was missing at container start.
            raise NoTeeError(f"{endpoint} exists but is not a unix socket", fix="mount the host's /var/run/dstack.sock")
    return endpoint


SIM_DIR_PREFIX = "cvm-tune-sim-"
SIM_OWNER_LOCK = "owner.lock"  # flock'd by the process serving the simulator, for as long as it lives


@contextlib.contextmanager
def hold_owner_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory/owner.lock`` for the block: the simulator's directory is live
    for exactly as long as its owner process is (the kernel drops the lock when the process dies, even on kill -9).

    The file is locked under a private name and then renamed to ``owner.lock``: another process's
    :func:`remove_stale_simulator_dirs` never finds it unlocked (between a create and a flock it would have judged
    the new directory stale and removed it under its owner).
    """
    import fcntl

    private = directory / f".{SIM_OWNER_LOCK}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(private, directory / SIM_OWNER_LOCK)
        yield
    finally:
        os.close(fd)


def _owner_alive(directory: Path) -> bool | None:
    """True while another process holds the directory's owner lock, False once nobody does, None without a lock."""
    import fcntl

    try:
        fd = os.open(directory / SIM_OWNER_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _answers(sock: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(sock))
            return True
        except OSError:
            return False


def remove_stale_simulator_dirs(parent: Path) -> list[str]:
    """Delete embedded-simulator socket directories left by killed processes (kill -9 skips the cleanup).

    A directory is stale when it is ours (same uid) and no process holds its owner lock (``owner.lock``): liveness
    is what the kernel says, not whether the socket answers in time, so a simulator slowed by load is never removed.
    A directory without a lock (being set up, or left by an older release) is kept while its socket answers or it is
    less than a minute old. Returns the names removed.
    """
    import shutil

    removed = []
    for d in parent.glob(f"{SIM_DIR_PREFIX}*"):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            alive = _owner_alive(d)
            if alive is None:
                sock = d / "dstack.sock"
                alive = _answers(sock) if sock.exists() else time.time() - d.stat().st_mtime < 60
            if alive:
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def open_guest_agent(settings: TeeSettings) -> Iterator[GuestAgent]:
    """Connect to (or start) the guest agent and check it answers Info.

    Raises:
        NoTeeError: no agent configured/reachable.
    """
    if settings.mode == "embedded-simulator":
        from app.simulator import GuestAgentSimulator, SimulatorServer

        remove_stale_simulator_dirs(Path(tempfile.gettempdir()))
        with tempfile.TemporaryDirectory(prefix=SIM_DIR_PREFIX) as tmp, hold_owner_lock(Path(tmp)):  # 0700
            sim = GuestAgentSimulator()
            with SimulatorServer(sim, socket_path=Path(tmp) / "dstack.sock") as server:
                agent = GuestAgent(DstackClient(server.endpoint, timeout=settings.timeout_s),
                                   endpoint=server.endpoint, mode=settings.mode, embedded=sim)
                agent.identity()
                yield agent
        return
    endpoint = resolve_endpoint(settings)
    try:
        client = DstackClient(endpoint, timeout=settings.timeout_s)
    except FileNotFoundError as exc:
        raise NoTeeError(f"guest-agent socket {endpoint} does not exist") from exc
    agent = GuestAgent(client, endpoint=endpoint, mode=settings.mode)
    try:
        agent.identity()
    except TeeError as exc:
        raise NoTeeError(f"guest agent at {endpoint} is not answering: {exc.message}") from exc
    yield agent
