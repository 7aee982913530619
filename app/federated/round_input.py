"""What a client run needs to know about the federated round it trains for (light: no Flower, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RoundInput:
    """One federated round, as the aggregator announced it.

    Attributes:
        round: The aggregator's round number (1, 2, ...).
        nonce: The aggregator's fresh nonce for this round (64 hex characters).
        global_adapter_dir: A directory holding the global adapter's ``adapter_model.safetensors`` (warm start);
            ``None``: the round starts from the base model.
        global_adapter_sha256: SHA-256 of those safetensors bytes (``None`` with no global adapter).
        proximal_mu: FedProx: the proximal term's weight (0: plain local training).
        aggregator_recipient: Secure aggregation: the aggregator CVM's age recipient (checked against its quote);
            the run's weight files are encrypted to it as well (``app.run.confidential``).
    """

    round: int
    nonce: str
    global_adapter_dir: Path | None
    global_adapter_sha256: str | None
    proximal_mu: float = 0.0
    aggregator_recipient: str | None = None

    def manifest_block(self) -> dict[str, Any]:
        """The manifest's ``federation`` section (``attestation.bundle.manifest.FederationInfo``)."""
        return {"round": self.round, "nonce": self.nonce, "global_adapter_sha256": self.global_adapter_sha256,
                "proximal_mu": self.proximal_mu}

    def proximal(self) -> float | None:
        return self.proximal_mu or None
