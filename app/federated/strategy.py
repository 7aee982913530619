"""A Flower strategy wrapper that admits only verified client bundles and ends every round in a round bundle.

:class:`AttestedStrategy` delegates sampling and aggregation to a Flower strategy (FedAvg, FedProx, FedYogi from
``flwr.serverapp.strategy``, weighted by the ``trainable-tokens`` metric) and adds, per round: a fresh nonce and the
global adapter's hash in the train config; the admission gate (``app.federated.admission``) before aggregation,
with the verified token count as the weight; the attested round bundle (``app.federated.round_export``) after it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, FedYogi, Strategy

from attestation.io.hashing import sha256_hex

from app.errors import ConfigError, RoundFailedError
from app.federated.admission import WEIGHT_KEY, Admission, Admitted, Rejected, RoundTerms
from app.federated.round_export import Aggregator, RoundRecord, export_round, head_files
from app.config.federation import FederationSettings
from app.federated import secure
from app.federated.transport import arrays_to_safetensors, pack_bundle
from attestation.rounds.manifest import GLOBAL_ADAPTER_AGE
from app.federated.quiet import round_line

log = logging.getLogger("cvm-tune.federated")


def make_strategy(fed: FederationSettings) -> tuple[Strategy, dict[str, Any]]:
    """The configured Flower strategy (every sampled node trains; no federated evaluation) and its manifest record."""
    common: dict[str, Any] = {"fraction_train": 1.0, "fraction_evaluate": 0.0, "min_train_nodes": fed.min_clients,
                              "min_available_nodes": fed.min_clients, "weighted_by_key": WEIGHT_KEY}
    if fed.strategy == "fedprox":
        return FedProx(proximal_mu=fed.proximal_mu, **common), {"name": "fedprox",
                                                                 "params": {"proximal_mu": fed.proximal_mu}}
    if fed.strategy == "fedyogi":
        if fed.initial_adapter is None:
            raise ConfigError("federation.strategy fedyogi needs federation.initial_adapter (its server optimizer "
                              "steps from a global model)", fix="set federation.initial_adapter, or use fedavg")
        return FedYogi(eta=fed.server_learning_rate, tau=fed.tau, **common), {
            "name": "fedyogi", "params": {"eta": fed.server_learning_rate, "tau": fed.tau}}
    return FedAvg(**common), {"name": "fedavg", "params": {}}


class AttestedStrategy(Strategy):
    """See the module docstring. ``rounds`` collects (round, round bundle path) as rounds complete; ``progress`` is
    told when a round goes out to the clients and when its bundle is written (the command's live lines)."""

    def __init__(self, inner: Strategy, strategy_record: dict[str, Any], admission: Admission, aggregator: Aggregator,
                 out: Path, federation_id: str, fed: FederationSettings,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.inner, self.record, self.admission, self.aggregator = inner, strategy_record, admission, aggregator
        self.out, self.federation_id, self.fed, self.progress = out, federation_id, fed, progress
        self.terms: RoundTerms | None = None
        self.layout: dict[str, tuple[str, tuple[int, ...]]] | None = None  # the adapter's tensors: name -> dtype, shape
        self.previous: str | None = None
        self.rounds: list[tuple[int, Path]] = []
        self.rejections: list[tuple[int, Rejected]] = []

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        global_sha = sha256_hex(arrays_to_safetensors(arrays)) if len(arrays) else None
        mu = float(self.record["params"].get("proximal_mu", 0.0))
        self.terms = RoundTerms(server_round, secrets.token_hex(32), global_sha, mu)
        self.layout = _layout(arrays) if len(arrays) else None
        cfg = ConfigRecord(dict(config))
        cfg["nonce"] = self.terms.nonce
        cfg["global-adapter-sha256"] = global_sha or ""
        self.progress(f"round {server_round}/{self.fed.rounds}: sent to the clients; each trains and exports an "
                      "attested bundle …")
        if self.rounds:  # the attested round that produced this global adapter, for the clients to check
            cfg["previous-round"] = pack_bundle(self.rounds[-1][1], head_files(self.rounds[-1][1]))
        key = self.aggregator.secure
        if key is None:
            return self.inner.configure_train(server_round, arrays, cfg, grid)
        cfg[secure.KEY_FIELD] = key.evidence  # the attested recipient the clients encrypt their updates to
        if self.rounds and len(arrays):  # an aggregate of client updates: only ever sent as ciphertext
            cfg[secure.GLOBAL_FIELD] = (self.rounds[-1][1] / GLOBAL_ADAPTER_AGE).read_bytes()
            return secure.strip_arrays(self.inner.configure_train(server_round, arrays, cfg, grid))
        return self.inner.configure_train(server_round, arrays, cfg, grid)  # base model or the operator's initial

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        terms = self.terms
        if terms is None or terms.round != server_round:
            raise RoundFailedError(f"round {server_round} was never configured")
        admitted: list[Admitted] = []
        rejected: list[Rejected] = []
        verified: list[Message] = []
        for msg in replies:
            verdict = self.admission.check(msg, terms, {a.client for a in admitted})
            if isinstance(verdict, Admitted) and _layout(verdict.arrays) != (self.layout or _layout(verdict.arrays)):
                verdict = Rejected(verdict.client, verdict.node_id, "its adapter's tensors (names, dtypes or shapes) "
                                   "differ from the round's global adapter (another base model or LoRA shape)")
            if isinstance(verdict, Admitted):
                self.layout = self.layout or _layout(verdict.arrays)  # a first round: the first admitted adapter's
                # aggregate exactly the checked weights, with the verified token count as the weight
                msg.content = RecordDict({"arrays": verdict.arrays,
                                          "metrics": MetricRecord({WEIGHT_KEY: verdict.trainable_tokens})})
                admitted.append(verdict)
                verified.append(msg)
            else:
                rejected.append(verdict)
        for r in rejected:
            log.warning("round %d: rejected %s (node %d): %s", server_round, r.client or "?", r.node_id, r.reason)
            self.rejections.append((server_round, r))
        if len(admitted) < self.fed.min_clients:
            reasons = "; ".join(f"{r.client or r.node_id}: {r.reason}" for r in rejected[:3]) or "no replies"
            raise RoundFailedError(f"round {server_round}: {len(admitted)} client bundle(s) admitted, "
                                   f"federation.min_clients is {self.fed.min_clients} ({reasons})",
                                   fix="check the rejected clients' bundles and the federation policy, then run "
                                   "the federation again")
        arrays, metrics = self.inner.aggregate_train(server_round, verified)
        if arrays is None:
            raise RoundFailedError(f"round {server_round}: the {self.record['name']} strategy produced no aggregate")
        path, self.previous = export_round(self.out, self.aggregator, RoundRecord(
            self.federation_id, server_round, terms.nonce, self.record, self.fed.min_clients,
            terms.global_adapter_sha256, self.previous), arrays, admitted, rejected)
        self.admission.forget(server_round)
        log.info("round %d: %d admitted, %d rejected; round bundle %s", server_round, len(admitted), len(rejected), path)
        self.rounds.append((server_round, path))
        self.progress(round_line(server_round, path))
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None


def _layout(arrays: ArrayRecord) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (arr.dtype, tuple(arr.shape)) for name, arr in arrays.items()}
