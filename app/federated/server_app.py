"""The aggregator: a Flower ``ServerApp`` (Message API) running :class:`app.federated.strategy.AttestedStrategy`.

Flower loads ``app.federated.server_app:app``; its cvm-tune config is the run config value ``cvm-tune-config``
(``flwr run . --run-config 'cvm-tune-config="/etc/cvm-tune/config.yaml"'``), default ``/etc/cvm-tune/config.yaml``.
Round bundles go to ``<output.dir>/rounds/<federation id>/round-NNNN/``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from attestation.policy import load_policy, simulator_policy

from app.config import Config, load_config
from app.errors import ConfigError
from app.federated.admission import Admission
from app.federated.round_export import Aggregator
from app.federated.secure import attest_key
from app.federated.strategy import AttestedStrategy, make_strategy
from app.federated.transport import safetensors_to_arrays
from app.tee import open_guest_agent

DEFAULT_CONFIG = "/etc/cvm-tune/config.yaml"


@dataclass(frozen=True)
class FederationResult:
    rounds: list[tuple[int, Path]]  # (round, round bundle)
    rejections: list[tuple[int, str, str]]  # (round, client, reason)


def run_federation(grid: Grid, cfg: Config, federation_id: str,
                   progress: Callable[[str], None] = lambda _m: None) -> FederationResult:
    """Run ``federation.rounds`` attested rounds on ``grid`` (``progress``: a line as each round goes out and ends).

    Raises:
        ConfigError: the federation section cannot run a federation (no clients, no compose-hash allow-list).
        RoundFailedError: a round admitted fewer than ``federation.min_clients`` bundles.
        CvmTuneError: the aggregator's guest agent or the round export failed.
    """
    fed = cfg.federation
    if not fed.clients or not fed.client_compose_hashes:
        raise ConfigError("the aggregator needs federation.clients and federation.client_compose_hashes",
                          fix="list every client with its owners' public keys and the clients' compose-hashes "
                          "(cvm-tune compose-hash)")
    inner, record = make_strategy(fed)
    initial = ArrayRecord() if fed.initial_adapter is None else safetensors_to_arrays(fed.initial_adapter)
    out = cfg.output.dir.resolve() / "rounds"
    with ExitStack() as stack:
        agent = stack.enter_context(open_guest_agent(cfg.tee))
        ident = agent.identity()
        simulated = cfg.tee.mode == "embedded-simulator" or ident.is_cvm_tune_simulator
        if fed.client_policy is not None:
            policy = load_policy(fed.client_policy)
        elif simulated:
            policy = simulator_policy(agent.simulator_root_der())
        else:
            policy = load_policy(None)
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cvm-tune-fed-")))
        key = attest_key(agent, ident, federation_id, cfg.tee.mode, cfg.tee) if fed.secure_aggregation else None
        aggregator = Aggregator(agent, ident, simulated, cfg.tee.mode, cfg.tee.collateral, cfg.tee.pccs_url,
                                cfg.tee.timeout_s, policy, key)
        strategy = AttestedStrategy(inner, record, Admission(fed, policy, work, key), aggregator, out, federation_id,
                                    fed, progress)
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=fed.rounds, timeout=fed.round_timeout_s)
    return FederationResult(strategy.rounds, [(n, r.client, r.reason) for n, r in strategy.rejections])


def make_server_app(config_path: Path | None = None) -> ServerApp:
    """A ServerApp reading ``config_path`` (else the run config's ``cvm-tune-config``)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from app.federated.quiet import OURS, round_line, summarised

        path = config_path or Path(str(context.run_config.get("cvm-tune-config", DEFAULT_CONFIG)))
        with summarised() as flwr_log:
            result = run_federation(grid, load_config(path), f"flwr-{context.run_id}")
            for n, bundle in result.rounds:
                flwr_log.info(round_line(n, bundle), extra=OURS)

    return server


app = make_server_app()
