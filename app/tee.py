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

dstack-sdk 0.5.4 covers the v0 surface except GetKey's key-epoch selectors (guest 0.6.6 / 0.5.16) and knows
nothing of ``/v1/``: :func:`agent_rpc` is the one raw call for those (:meth:`GuestAgent.get_key_at`,
:meth:`GuestAgent.v1`), to be replaced by dstack-sdk 0.6's ``DstackClientV0`` / ``DstackClient`` when the package
registry has it. (``DstackClient`` of 0.6 is the v1 client, other keys: switch to ``DstackClientV0`` then.)
"""

from __future__ import annotations

import contextlib
import json
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
from app.keys_epoch import KeyEpochError, KeyEpochs

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

    def __init__(self, client: DstackClient, *, endpoint: str, mode: str, embedded: Any = None,
                 timeout_s: float = 30.0) -> None:
        self._client = client
        self.endpoint = endpoint
        self.mode = mode
        self._embedded = embedded  # the in-process simulator, when mode is embedded-simulator
        self._timeout_s = timeout_s

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

    def get_key_at(self, path: str, purpose: str, epochs: KeyEpochs | None = None) -> tuple[bytes, KeyEpochs | None]:
        """v0 GetKey, with the ``root_epoch``/``app_epoch`` selectors when ``epochs`` is given: ``(32 key bytes,
        the epochs the agent reports)`` (``None``: it reports none, as every guest before 0.6.6/0.5.16).

        Raises:
            KeyEpochError: epochs were asked for and the agent answered others or none (it ignores the selectors).
            TeeError: the agent refused or did not answer.
        """
        body: dict[str, Any] = {"path": path, "purpose": purpose, "algorithm": "secp256k1"}
        if epochs is not None:
            body.update(epochs.as_dict())
        answer = agent_rpc(self.endpoint, "GetKey", body, timeout_s=self._timeout_s)
        try:
            key = bytes.fromhex(str(answer["key"]).removeprefix("0x"))
        except (KeyError, ValueError) as exc:
            raise TeeError("guest agent answered GetKey without a hex key") from exc
        got = KeyEpochs.from_answer(answer)
        if epochs is not None and got != epochs:
            raise KeyEpochError(f"asked GetKey({path}) for {epochs}; the guest agent answered {got or 'no epochs'}: "
                                "it ignores GetKey's epoch selectors (dstack guest 0.5.15 / 0.6.5 or older)")
        return key, got

    def v1(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/v1/`` guest-API call (dstack 0.6: GetKey, Attest, AttestGpu, Info, Version).

        Raises:
            TeeError: the agent predates v1 (404), refused or did not answer.
        """
        return agent_rpc(self.endpoint, f"v1/{method}", body, timeout_s=self._timeout_s)

    def attest(self, report_data: bytes) -> bytes:
        """v0 ``Attest`` (dstack 0.6): the VersionedAttestation bytes (SCALE V0 or MessagePack V1).

        Raises:
            TeeError: the agent has no Attest (0.5) or refused.
        """
        answer = agent_rpc(self.endpoint, "Attest", {"report_data": report_data.hex()}, timeout_s=self._timeout_s)
        try:
            return bytes.fromhex(str(answer["attestation"]))
        except (KeyError, ValueError) as exc:
            raise TeeError("guest agent answered Attest without a hex attestation") from exc

    def quote(self, report_data: bytes) -> tuple[bytes, str]:
        """GetQuote -> (quote bytes, event log JSON text as returned)."""
        if len(report_data) != 64:
            raise TeeError("report_data must be exactly 64 bytes here (the manifest binding)")
        resp = self._call("GetQuote", self._client.get_quote, report_data)
        return resp.decode_quote(), resp.event_log

    def mr_config_document(self, quote: bytes) -> bytes | None:
        """The MrConfigV3 document a v3 MRCONFIGID (dstack 0.6 with ``key_provider_id``) is the hash of, as the
        host gave it (``mr_config`` in Info's ``vm_config``: exact bytes, never re-serialised); ``None`` when the
        ``quote``'s MRCONFIGID is not v3 or the agent gives none. The verifier checks it hashes to MRCONFIGID."""
        if len(quote) < 280 or quote[232] != 3:  # MRCONFIGID: TD report offset 184, after the 48-byte header
            return None
        try:
            vm = json.loads(self._call("Info", self._client.info).vm_config or "{}")
        except ValueError:
            return None
        doc = vm.get("mr_config") if isinstance(vm, dict) else None
        return doc.encode() if isinstance(doc, str) and doc else None

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

    def boot_info(self) -> Any:
        """What dstack measured into RTMR3 at boot (:func:`attestation.tdx.eventlog.boot_info` of Info's unstripped
        log; RTMR3 digests are recomputed, never read): ``.dstack06``, ``.values["gpu-attestation"]``, ...

        Raises:
            TeeError: the agent did not answer Info, or its event log is malformed.
        """
        from attestation.errors import EventLogError
        from attestation.tdx.eventlog import boot_info, parse_event_log

        log = self._call("Info", self._client.info).tcb_info.event_log
        try:
            return boot_info(parse_event_log([{**e.model_dump(), "digest": "" if e.imr == 3 else e.digest} for e in log]))
        except EventLogError as exc:
            raise TeeError(f"guest agent answered Info with a malformed event log: {exc.message}") from exc

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
    return agent_rpc(endpoint, method, {}, timeout_s=timeout_s)


def agent_rpc(endpoint: str, route: str, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """``POST /<route>`` with a JSON body to the guest agent at ``endpoint`` (unix socket or http(s) URL): the one
    raw call, for what dstack-sdk 0.5.4 cannot send (GetKey epoch selectors, ``/v1/``). Transport errors are
    retried like the SDK calls.

    Raises:
        TeeError: an HTTP error (with the agent's ``error`` text), a non-JSON answer, or no answer.
    """
    if endpoint.startswith(("http://", "https://")):
        client = httpx.Client(base_url=endpoint, timeout=timeout_s)
    else:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint), base_url="http://localhost", timeout=timeout_s)
    last: Exception | None = None
    with client:
        for attempt in range(_RETRIES):
            try:
                resp = client.post(f"/{route}", json=body)
                resp.raise_for_status()
                answer = resp.json()
                if not isinstance(answer, dict):
                    raise ValueError("not a JSON object")
                return answer
            except httpx.HTTPStatusError as exc:
                raise TeeError(f"guest agent refused {route}: HTTP {exc.response.status_code} {_error_text(exc)}") from exc
            except ValueError as exc:
                raise TeeError(f"guest agent answered {route} with something other than a JSON object") from exc
            except httpx.TransportError as exc:
                last = exc
                if attempt < _RETRIES - 1:
                    time.sleep(0.2 * 2**attempt)
    raise TeeError(f"guest agent at {endpoint} did not answer {route}: {type(last).__name__}") from last


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


def simulator_settings(settings: TeeSettings) -> Any:
    """The embedded simulator's settings from ``tee.simulator`` (dstack line and key epochs)."""
    from app.simulator import SimulatorSettings

    sim = settings.simulator
    return SimulatorSettings(dstack=sim.dstack, root_epoch=sim.root_epoch, app_epoch=sim.app_epoch, gpu=sim.gpu)


@contextlib.contextmanager
def open_guest_agent(settings: TeeSettings) -> Iterator[GuestAgent]:
    """Connect to (or start) the guest agent and check it answers Info.

    Raises:
        NoTeeError: no agent configured/reachable.
    """
    if settings.mode == "embedded-simulator":
        from app.simulator import GuestAgentSimulator, SimulatorServer

        from app.simulator.sockets import SIM_DIR_PREFIX, hold_owner_lock, remove_stale_simulator_dirs, socket_parent

        parent = socket_parent()
        remove_stale_simulator_dirs(parent)
        with tempfile.TemporaryDirectory(prefix=SIM_DIR_PREFIX, dir=parent) as tmp, hold_owner_lock(Path(tmp)):  # 0700
            sim = GuestAgentSimulator(simulator_settings(settings))
            with SimulatorServer(sim, socket_path=Path(tmp) / "dstack.sock") as server:
                agent = GuestAgent(DstackClient(server.endpoint, timeout=settings.timeout_s),
                                   endpoint=server.endpoint, mode=settings.mode, embedded=sim,
                                   timeout_s=settings.timeout_s)
                agent.identity()
                yield agent
        return
    endpoint = resolve_endpoint(settings)
    try:
        client = DstackClient(endpoint, timeout=settings.timeout_s)
    except FileNotFoundError as exc:
        raise NoTeeError(f"guest-agent socket {endpoint} does not exist") from exc
    agent = GuestAgent(client, endpoint=endpoint, mode=settings.mode, timeout_s=settings.timeout_s)
    try:
        agent.identity()
    except TeeError as exc:
        raise NoTeeError(f"guest agent at {endpoint} is not answering: {exc.message}") from exc
    yield agent
