"""Embedded dstack guest-agent simulator: the real HTTP/JSON protocol, quotes under a TEST PKI.

Outside a confidential VM, cvm-tune runs against this simulator. It answers the same RPCs as the
dstack guest agent over a unix socket or loopback TCP: as dstack 0.6.7 by default (v0 Info, GetQuote, GetKey with
key-epoch selectors, Attest, Version, Sign, Verify, EmitEvent refused; ``/v1/`` Version, Info, GetKey, Attest,
AttestGpu; ``SimulatorSettings(root_epoch=, app_epoch=)`` and :meth:`GuestAgentSimulator.rotate` simulate KMS key
rotations, ``gpu=True`` an H100 that dstack's boot gate attested) or as 0.5.11 (``dstack="0.5"``: EmitEvent extends
RTMR3), so ``dstack_sdk.DstackClient`` works unchanged, and its quotes verify with ``dcap_qvl.verify_with_root_ca``
against :attr:`GuestAgentSimulator.test_root_ca_der` only: they can never pass for real TDX evidence.
``DEFAULT_TEST_SECRET`` is public and NOT secret.

Example::

    with SimulatorServer(GuestAgentSimulator(), socket_path="/tmp/dstack.sock") as server:
        client = dstack_sdk.DstackClient(server.endpoint)
"""

from app.simulator.agent import DEFAULT_TEST_SECRET, GuestAgentSimulator, SimulatorRpcError, SimulatorSettings
from app.simulator.server import SimulatorServer

__all__ = ["DEFAULT_TEST_SECRET", "GuestAgentSimulator", "SimulatorRpcError", "SimulatorServer", "SimulatorSettings"]
