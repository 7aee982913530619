"""Round-bundle layout and the round-manifest schema (federated rounds, ``app.federated``).

The aggregator of a federated round writes ``rounds/<federation>/round-<NNNN>/``::

    round-manifest.json            what the round admitted and rejected, and the new global adapter (schema below)
    adapter/adapter_model.safetensors   the aggregated global adapter (safetensors bytes; their SHA-256 is the
                                   ``global_adapter_sha256`` the next round's clients record); with secure
                                   aggregation ``adapter/adapter_model.safetensors.age`` instead (age ciphertext)
    app-compose.json               the aggregator CVM's measured app-compose (raw bytes)
    clients/<name>/                each admitted client's complete export bundle (``attestation.bundle.manifest``); its
                                   quote is identified by the SHA-256 of its signed region (``quote_identity``)
    quote.bin, quote.hex           the aggregator's TDX quote, report_data = round_report_data(round-manifest.json)
    event_log.json                 the event log returned with that quote
    collateral.json                collateral for offline verification, when available

**report_data** = ``SHA-512(b"cvm-tune-round-v1:" || round-manifest.json bytes)`` (a tag of its own, so a round
manifest can never pass for a client manifest or the other way round).

**Secure aggregation** (``federation.secure_aggregation``): before round 1 the aggregator attests its age recipient in
``aggregator-key.json`` (:class:`AggregatorKey`; report_data = ``SHA-512(b"cvm-tune-aggregator-key-v1:" || bytes)``)
and sends it, with its quote, event log, app-compose and collateral, in every train message; a client checks it and
encrypts its bundle's weights to that recipient too. The round manifest then names ``aggregator_recipient`` and a
``confidentiality`` block: the global adapter file is age ciphertext to the admitted clients' CVM keys and the
aggregator's, named :data:`GLOBAL_ADAPTER_AGE`, ``global_adapter_sha256`` is the SHA-256 of its plaintext (what the
next round's clients record), and the client bundles hold their adapters only as ciphertext
(``adapter/adapter_model.safetensors.age``: ``attestation.outputs.confidential``).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from attestation.bundle.manifest import RUN_ID_PATTERN, CodeInfo, TeeInfo
from attestation.outputs.confidential import RECIPIENT, ciphertext_name

ROUND_SCHEMA = "cvm-tune/round-manifest/v1"
KEY_SCHEMA = "cvm-tune/aggregator-key/v1"
KEY_REPORT_DATA_TAG = b"cvm-tune-aggregator-key-v1"
KEY_DOC = "aggregator-key.json"
ROUND_REPORT_DATA_TAG = b"cvm-tune-round-v1"
ROUND_MANIFEST = "round-manifest.json"
GLOBAL_ADAPTER = "adapter/adapter_model.safetensors"
GLOBAL_ADAPTER_AGE = ciphertext_name(GLOBAL_ADAPTER)  # secure aggregation: the global adapter as age ciphertext
CLIENTS_DIR = "clients"
STRATEGIES = ("fedavg", "fedprox", "fedyogi")
# Strategies whose aggregate the verifier recomputes from the client adapters (FedYogi keeps server-side
# optimizer state across rounds: its output is attested by the aggregator's quote, not recomputed).
RECOMPUTABLE = ("fedavg", "fedprox")
_H64 = r"^[0-9a-f]{64}$"


def client_privacy(manifest: object) -> tuple[float | None, float | None]:
    """(epsilon, delta) of a client manifest's ``privacy`` block (DP-SGD), or (None, None) without DP."""
    privacy = getattr(manifest, "privacy", None)
    if privacy is None:
        return None, None
    return float(privacy.epsilon), float(privacy.delta)


def global_adapter(secure: bool) -> str:
    """The global adapter file of a round: :data:`GLOBAL_ADAPTER_AGE` with secure aggregation, else
    :data:`GLOBAL_ADAPTER`."""
    return GLOBAL_ADAPTER_AGE if secure else GLOBAL_ADAPTER


def quote_identity(raw: bytes) -> str:
    """A client quote's identity in the round manifest (``quote_sha256``): SHA-256 of its signed region (header,
    body and declared signature data), without the padding that may follow it. A quote with more or fewer trailing
    zero bytes verifies the same (``quote.padding``), so it is the same quote with the same identity.

    Raises:
        QuoteParseError: ``raw`` is not a quote.
    """
    from attestation.tdx.quote import Quote

    return hashlib.sha256(raw[:Quote.from_bytes(raw).signed_end]).hexdigest()


def round_report_data(manifest_bytes: bytes) -> bytes:
    """The 64-byte report_data that binds the aggregator's quote to these exact round-manifest bytes."""
    return hashlib.sha512(ROUND_REPORT_DATA_TAG + b":" + manifest_bytes).digest()


def key_report_data(doc_bytes: bytes) -> bytes:
    """The 64-byte report_data that binds the aggregator's quote to these exact aggregator-key.json bytes."""
    return hashlib.sha512(KEY_REPORT_DATA_TAG + b":" + doc_bytes).digest()


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AggregatorKey(_Closed):
    """``aggregator-key.json``: the age recipient of the aggregator CVM's key (GetKey ``cvm-tune/outputs/v1``),
    bound by the aggregator's quote; clients encrypt their updates to it."""

    schema_: Literal["cvm-tune/aggregator-key/v1"] = Field(KEY_SCHEMA, alias="schema")
    federation_id: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    recipient: str = Field(pattern=rf"^{RECIPIENT}$")
    created_at: str
    tee: TeeInfo

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RoundConfidentiality(_Closed):
    """Secure aggregation: who can read the global adapter file, and the SHA-256 of its plaintext."""

    scheme: Literal["age-v1/x25519"] = "age-v1/x25519"
    recipients: tuple[str, ...] = Field(min_length=1)  # the admitted clients' CVM keys and the aggregator's, sorted
    plaintext_sha256: str = Field(pattern=_H64)


class StrategyInfo(_Closed):
    name: Literal["fedavg", "fedprox", "fedyogi"]
    weighted_by: Literal["trainable_tokens"] = "trainable_tokens"
    params: dict[str, float] = {}


class AdmittedClient(_Closed):
    """A client bundle that passed the aggregator's checks and went into the aggregate."""

    client: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    run_id: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    manifest_sha256: str = Field(pattern=_H64)
    quote_sha256: str = Field(pattern=_H64)  # quote_identity(): SHA-256 of the quote's signed region
    adapter_sha256: str = Field(pattern=_H64)
    trainable_tokens: int = Field(ge=1)
    weight: float = Field(gt=0, le=1)
    # differential privacy of this client's round (its manifest's ``privacy``): null without DP
    privacy_epsilon: float | None = Field(None, ge=0)
    privacy_delta: float | None = Field(None, gt=0, lt=1)


class RejectedClient(_Closed):
    """A reply the aggregator dropped, and why (its bundle is not part of the round)."""

    client: str  # the name it claimed ("" when it named none)
    node_id: int
    reason: str


class RoundManifest(_Closed):
    """The round manifest (schema ``cvm-tune/round-manifest/v1``)."""

    schema_: Literal["cvm-tune/round-manifest/v1"] = Field(ROUND_SCHEMA, alias="schema")
    federation_id: str = Field(pattern=rf"^{RUN_ID_PATTERN}$")
    round: int = Field(ge=1)
    nonce: str = Field(pattern=_H64)
    created_at: str
    code: CodeInfo
    tee: TeeInfo
    strategy: StrategyInfo
    min_clients: int = Field(ge=1)
    global_adapter_in_sha256: str | None = Field(None, pattern=_H64)  # what the clients started from
    global_adapter_sha256: str = Field(pattern=_H64)  # the aggregate: sha256 of its safetensors (plaintext) bytes
    previous_round_sha256: str | None = Field(None, pattern=_H64)  # sha256 of the previous round-manifest.json
    admitted: list[AdmittedClient] = Field(min_length=1)
    rejected: list[RejectedClient]
    files: dict[str, str]  # app-compose.json and the global adapter (global_adapter(secure)) -> sha256
    aggregator_recipient: str | None = Field(None, pattern=rf"^{RECIPIENT}$")  # secure aggregation: updates go to it
    confidentiality: RoundConfidentiality | None = None  # secure aggregation: the global adapter is ciphertext

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
