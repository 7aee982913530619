"""The ``federation`` section of the config: one model for both roles (light: pydantic only).

The aggregator (Flower ServerApp) reads ``rounds``, ``strategy``, ``min_clients``, ``clients``, ``client_policy``
and ``client_compose_hashes``; a data owner's CVM (Flower ClientApp) reads ``client_name``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from app.config.base import HEX64, _Closed

CLIENT_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$"


def _all_hex64(value: tuple[str, ...]) -> tuple[str, ...]:
    if bad := [v for v in value if not re.fullmatch(HEX64, v)]:
        raise ValueError(f"{bad[0]!r} is not 64 lowercase hex characters")
    return value


class FederationClient(_Closed):
    """One data owner's CVM the aggregator admits."""

    owner_public_keys: tuple[str, ...] = Field(
        min_length=1, description="Ed25519 public keys (hex) whose signed datasets this client may train on; a "
        "bundle whose dataset another key signed is rejected.")

    @field_validator("owner_public_keys")
    @classmethod
    def _hex(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_hex64(value)


class FederationSettings(_Closed):
    """Federated rounds on Flower (``docs/federated.md``)."""

    client_name: str | None = Field(None, pattern=CLIENT_NAME, description="Client role: this CVM's name in the "
                                    "aggregator's `federation.clients` (sent with every reply).")
    aggregator_compose_hashes: tuple[str, ...] = Field(
        (), description="Client role: allowed compose-hashes of the aggregator. Set: a global adapter is trained on "
        "only after the previous round's attestation verifies (the aggregator's quote over the round manifest naming "
        "that adapter). Unset: the global adapter is trusted as sent.")
    aggregator_policy: Path | None = Field(None, description="Client role: verification policy YAML for the "
                                           "aggregator's quote. Unset: the simulator's test-CA policy when tee.mode "
                                           "is embedded-simulator, else the built-in default (Intel root).")
    initial_adapter_sha256: str | None = Field(None, pattern=HEX64, description="Client role, with "
                                               "aggregator_compose_hashes: the SHA-256 of the only initial adapter a "
                                               "first round may start from (it has no attested round behind it).")
    rounds: int = Field(3, ge=1, le=10_000, description="Aggregator: number of rounds.")
    strategy: Literal["fedavg", "fedprox", "fedyogi"] = Field(
        "fedavg", description="Aggregator: Flower strategy; client updates are weighted by their verified trainable "
        "tokens. fedprox sends `proximal_mu` to the clients; fedyogi needs `initial_adapter`.")
    proximal_mu: float = Field(0.01, ge=0.0, le=100.0, description="fedprox: weight of the proximal term "
                               "(mu/2 * ||w - w_global||^2 over the LoRA weights) the clients add to their loss.")
    server_learning_rate: float = Field(0.01, gt=0.0, le=10.0, description="fedyogi: server-side learning rate (eta).")
    tau: float = Field(0.001, gt=0.0, le=1.0, description="fedyogi: adaptivity (tau).")
    min_clients: int = Field(2, ge=1, le=10_000, description="Aggregator: clients sampled per round, and the fewest "
                             "admitted bundles a round needs; fewer fails the round (nothing aggregated).")
    round_timeout_s: float = Field(3600.0, gt=0, description="Aggregator: how long a round waits for replies.")
    initial_adapter: Path | None = Field(None, description="Aggregator: adapter_model.safetensors the first round "
                                         "starts from (e.g. a promoted bundle's); unset: clients start from the base "
                                         "model.")
    client_policy: Path | None = Field(None, description="Aggregator: verification policy YAML for client bundles "
                                       "(trusted root, TCB, measurements). Unset: the simulator's test-CA policy when "
                                       "tee.mode is embedded-simulator, else the built-in default (Intel root).")
    client_compose_hashes: tuple[str, ...] = Field((), description="Aggregator: allowed client compose-hashes "
                                                   "(`cvm-tune compose-hash`); a bundle from any other compose is "
                                                   "rejected. Required to run a federation.")
    clients: dict[str, FederationClient] = Field({}, description="Aggregator: the admitted clients by name, each "
                                                 "with its owners' keys. Required to run a federation.")
    secure_aggregation: bool = Field(False, description="Aggregator: clients encrypt their updates (age) to this "
                                     "CVM's key, attested by its quote before round 1; the aggregator decrypts them in "
                                     "memory, and the round bundle holds no plaintext update: the global adapter is "
                                     "encrypted to the admitted clients' CVM keys and sent to them only as ciphertext.")

    @field_validator("client_compose_hashes", "aggregator_compose_hashes")
    @classmethod
    def _compose(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _all_hex64(value)

    @field_validator("clients")
    @classmethod
    def _names(cls, value: dict[str, FederationClient]) -> dict[str, FederationClient]:
        if bad := [k for k in value if not re.fullmatch(CLIENT_NAME, k)]:
            raise ValueError(f"client name {bad[0]!r} is not allowed (letters, digits, '.', '_', '-')")
        return value
