"""Attested federated rounds on one machine: ``cvm-tune federated simulate`` (docs/federated.md).

Everything goes under one new directory ``OUT``:

* ``owners/<client>.key|.pub``: each simulated data owner's signing key (as ``cvm-tune keys new`` writes it);
* ``clients/<client>/``: that owner's dataset key, signed encrypted share of the bundled sample rows
  (``data/<client>-v1.cvmds``), its CVM's cvm-tune config and output volume (``output/``);
* ``aggregator/``: the aggregator's config and output volume; round bundles in
  ``aggregator/output/rounds/simulation/round-NNNN/``;
* ``simulator-test-policy.yaml``: the policy that trusts the embedded simulator's test CA.

The rounds run on Flower's in-process simulation engine (``flwr.simulation.run_simulation`` on ray): no SuperLink,
and nothing is left running when :func:`run_rounds` returns or raises (ray is shut down). The last round
bundle is then verified as a relying party would, under the simulator's test policy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from app.errors import ConfigError, CvmTuneError, RoundFailedError, StateError, TrainingError
from app.federated.quiet import summarised

FEDERATION_ID = "simulation"
POLICY_FILE = "simulator-test-policy.yaml"
STRATEGIES = ("fedavg", "fedprox", "fedyogi")
ROUND_TIMEOUT_S = 1800.0  # per round; a tiny model's round takes seconds to a few minutes on a CPU
RAY_FIX = ("install the CPU lock again, which pins ray for Flower's simulation engine: "
           "sh requirements/install.sh .venv requirements/cpu.lock --editable")
log = logging.getLogger("cvm-tune.federated")


@dataclass(frozen=True)
class Plan:
    """What to simulate. ``min_clients``: the fewest admitted bundles a round needs (at most ``clients``)."""

    out: Path
    clients: int = 3
    rounds: int = 2
    strategy: str = "fedavg"
    max_steps: int = 5
    min_clients: int | None = None
    secure_aggregation: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"owner-{chr(ord('a') + i)}" for i in range(self.clients))


@dataclass(frozen=True)
class Prepared:
    """The files :func:`prepare` wrote."""

    aggregator_config: Path
    client_configs: tuple[Path, ...]
    policy_file: Path
    rounds_dir: Path


def check_plan(plan: Plan) -> None:
    """Refuse a plan before anything is written.

    Raises:
        ConfigError: ``out`` exists and is not an empty directory, or a count is out of range (exit 2).
        TrainingError: ray, the engine behind Flower's simulation, is not installed.
    """
    out = plan.out
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out {out} exists and is not a directory", fix="name a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty", fix="name a new or empty directory (nothing is overwritten)")
    if not 2 <= plan.clients <= 8 or not 1 <= plan.rounds <= 5 or plan.strategy not in STRATEGIES:
        raise ConfigError(f"clients {plan.clients} (2..8), rounds {plan.rounds} (1..5), strategy {plan.strategy!r}")
    if plan.min_clients is not None and not 1 <= plan.min_clients <= plan.clients:
        raise ConfigError(f"--min-clients {plan.min_clients} is outside 1..{plan.clients} (the simulated clients)",
                          fix="a round cannot admit more bundles than there are clients: lower --min-clients")
    if importlib.util.find_spec("ray") is None:
        raise TrainingError("Flower's simulation engine needs ray, which is not installed", fix=RAY_FIX)


def prepare(plan: Plan) -> Prepared:
    """Write the owners' keys and signed encrypted datasets, every client's config and the aggregator's."""
    from attestation.policy import policy_file_text, simulator_policy

    from app.dataset import encrypt_stream, write_key_file
    from app.dataset.owner import load_owner_key, new_owner_key
    from app.simulator import GuestAgentSimulator

    out = plan.out.resolve()
    (out / "owners").mkdir(parents=True, exist_ok=True)
    sim = GuestAgentSimulator()  # every simulated CVM (clients and aggregator) runs this compose: one compose-hash
    compose = sim.compose_hash.hex()
    policy_file = out / POLICY_FILE
    policy_file.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
    rows = [line for line in (resources.files("app") / "data" / "sample.jsonl").read_bytes().splitlines() if line.strip()]
    share = -(-len(rows) // plan.clients)
    initial = _initial_adapter(out / "aggregator" / "initial-adapter") if plan.strategy == "fedyogi" else None
    configs, owners = [], {}
    for i, name in enumerate(plan.names):
        owner_key, _, pub = new_owner_key(out / "owners" / name)
        owners[name] = {"owner_public_keys": [pub.hex()]}
        d = out / "clients" / name
        (d / "data").mkdir(parents=True)
        key = os.urandom(32)
        write_key_file(d / "dataset.key", key)
        dataset_id = f"{name}-records"
        with open(d / "data" / f"{name}-v1.cvmds", "wb") as fh:
            encrypt_stream(io.BytesIO(b"\n".join(rows[i * share:(i + 1) * share]) + b"\n"), fh, key,
                           dataset_id=dataset_id, dataset_version=1,
                           owner_key=load_owner_key(owner_key))
        federation: dict[str, Any] = {"client_name": name, "aggregator_compose_hashes": [compose]}
        if initial is not None:
            federation["initial_adapter_sha256"] = initial[1]
        configs.append(_write_config(d / "config.yaml", {
            "output": {"dir": str(d / "output")},
            "dataset": {"source": "encrypted-file", "path": str(d / "data"), "dataset_id": dataset_id,
                        "owner_public_key": pub.hex(), "key": {"source": "file", "file": str(d / "dataset.key")}},
            "training": {"max_steps": plan.max_steps, "save_steps": plan.max_steps},
            "federation": federation}))
    aggregator: dict[str, Any] = {
        "rounds": plan.rounds, "strategy": plan.strategy, "min_clients": plan.min_clients or plan.clients,
        "round_timeout_s": ROUND_TIMEOUT_S, "client_compose_hashes": [compose], "clients": owners,
        "secure_aggregation": plan.secure_aggregation}
    if initial is not None:
        aggregator["initial_adapter"] = str(initial[0])
    agg = _write_config(out / "aggregator" / "config.yaml",
                        {"output": {"dir": str(out / "aggregator" / "output")}, "federation": aggregator})
    return Prepared(agg, tuple(configs), policy_file, out / "aggregator" / "output" / "rounds" / FEDERATION_ID)


def _write_config(path: Path, cfg: dict[str, Any]) -> Path:
    from app.config import load_config

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# written by cvm-tune federated simulate\n{yaml.safe_dump(cfg, sort_keys=False)}")
    load_config(path)  # what the simulated CVMs will read must validate here, before any of them starts
    return path


def _initial_adapter(d: Path) -> tuple[Path, str]:
    """FedYogi steps from a global model: a fresh LoRA adapter of the tiny model, as a client would initialise it
    (same LoRA settings and seed). Returns its file and the SHA-256 the clients pin for a first round."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from attestation.io.hashing import sha256_hex

    from app.config import load_config
    from app.federated.transport import arrays_to_safetensors, safetensors_to_arrays
    from app.training import build_tiny_model

    s = load_config(None).training
    build_tiny_model(d / "tiny-llama")
    torch.manual_seed(s.seed)
    model = AutoModelForCausalLM.from_pretrained(str(d / "tiny-llama"), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=s.lora.r, lora_alpha=s.lora.alpha, lora_dropout=s.lora.dropout,
                                            target_modules=list(s.lora.target_modules), task_type="CAUSAL_LM",
                                            bias="none"))
    with warnings.catch_warnings():  # transformers 5.2x asks a PEFT model about checkpointing by its old name
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft.save_pretrained(str(d / "adapter"))
    path = d / "adapter" / "adapter_model.safetensors"
    return path, sha256_hex(arrays_to_safetensors(safetensors_to_arrays(path)))


class TrainPartition:
    """The ClientApp's train handler: simulated SuperNode *i* is data owner *i* (picklable for ray's actors).

    A failed run replies with a one-line Flower error naming the owner and the cvm-tune error (what the aggregator
    records as the rejection reason), not the ray traceback the engine would send; ``debug`` lets the exception
    through instead, so that Flower logs its traceback."""

    def __init__(self, configs: tuple[Path, ...], *, debug: bool = False) -> None:
        self.configs, self.debug = configs, debug

    def __call__(self, msg: Any, context: Any) -> Any:
        from flwr.app import Error, Message

        from app.federated.client_app import train_round

        path = self.configs[int(context.node_config["partition-id"])]
        try:
            return train_round(msg, path)
        except Exception as exc:
            if self.debug:
                raise
            what = exc.message if isinstance(exc, CvmTuneError) else f"internal error: {_first_line(exc)}"
            return Message(error=Error(code=2, reason=f"{path.parent.name}: {type(exc).__name__}: {what}"),
                           reply_to=msg)  # 2: Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def run_rounds(prepared: Prepared, progress: Callable[[str], None] = lambda _m: None) -> Any:
    """Run the federation on Flower's in-process simulation engine; return the ServerApp's FederationResult.
    ``progress`` gets a line as each round goes out to the clients and as its round bundle is written.

    Raises:
        RoundFailedError: a round admitted fewer than ``federation.min_clients`` bundles (exit 6).
        TrainingError: the simulation engine stopped without finishing the rounds.
        CvmTuneError: the aggregator's own error (configuration, guest agent, round export).
    """
    with _quiet_engine():
        from flwr.clientapp import ClientApp
        from flwr.serverapp import Grid, ServerApp
        from flwr.simulation import run_simulation

        from app.config import load_config
        from app.federated.server_app import run_federation

        cfg = load_config(prepared.aggregator_config)
        results: list[Any] = []
        server = ServerApp()

        @server.main()
        def main(grid: Grid, context: Any) -> None:
            results.append(run_federation(grid, cfg, FEDERATION_ID, progress))

        client = ClientApp()
        client.train()(TrainPartition(prepared.client_configs, debug=logging.getLogger().isEnabledFor(logging.DEBUG)))
        n = len(prepared.client_configs)
        try:
            run_simulation(server_app=server, client_app=client, num_supernodes=n, backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": max(1, min(n, os.cpu_count() or 1)), "include_dashboard": False,
                              "log_to_driver": logging.getLogger().isEnabledFor(logging.DEBUG)}})
        except RoundFailedError as exc:  # its reasons come from the clients: keep the error on one line
            raise RoundFailedError(" ".join(exc.message.split()), fix=(
                f"the error names each rejected client and why; a client's output volume is "
                f"{prepared.aggregator_config.parent.parent / 'clients'}/<client>/output (--debug: the tracebacks)"
            )) from exc
        except CvmTuneError:
            raise
        except Exception as exc:
            raise TrainingError(f"Flower's simulation engine stopped: {type(exc).__name__}: {_first_line(exc)}",
                                fix="rerun with --debug to see the engine's error") from exc
    if not results or len(results[0].rounds) != cfg.federation.rounds:
        done = len(results[0].rounds) if results else 0
        raise RoundFailedError(f"the simulation ended after {done} of {cfg.federation.rounds} round(s)",
                               fix="rerun with --debug to see the engine's log")
    return results[0]


def _first_line(exc: BaseException) -> str:
    return (str(exc.__cause__ or exc).strip().splitlines() or [""])[0]


class _Quieter(logging.Filter):
    """Drop Flower's notice that ``run_simulation`` is deprecated (we call it on purpose: in-process, no SuperLink)
    and, without --debug, the tracebacks its engine logs (the error and its reason say what failed)."""

    def __init__(self, debug: bool) -> None:
        super().__init__()
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "run_simulation` function is deprecated" in text:
            return False
        return self.debug or not ("Traceback (most recent call last)" in text or "ray::ClientAppActor" in text)


@contextlib.contextmanager
def _quiet_engine() -> Iterator[None]:
    """No telemetry from Flower or ray (unless the user set it), ray shut down and PYTHONPATH restored on exit."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    pythonpath = os.environ.get("PYTHONPATH")  # Flower's ray backend rewrites it for its workers
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    flwr_log, drop = logging.getLogger("flwr"), _Quieter(debug)
    flwr_log.addFilter(drop)
    propagate = flwr_log.propagate  # Flower prints its own progress; the root handler would print it twice
    flwr_log.propagate = debug  # --debug: Flower's debug lines too
    try:
        with warnings.catch_warnings(), summarised(debug):  # Flower's banners: a line per round of ours instead
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            with contextlib.suppress(ImportError):
                import flwr.supercore.telemetry as telemetry  # read at import: a process that imported Flower earlier

                telemetry.FLWR_TELEMETRY_ENABLED = os.environ["FLWR_TELEMETRY_ENABLED"]
            yield
    finally:
        flwr_log.removeFilter(drop)
        flwr_log.propagate = propagate
        with contextlib.suppress(ImportError):
            import ray

            if ray.is_initialized():
                ray.shutdown()
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath


def verify_last(prepared: Prepared, rounds: list[tuple[int, Path]], *, now: int | None = None) -> tuple[Any, list[str]]:
    """The last round bundle's verdict under the simulator's test policy, and its link to the previous round.

    Raises:
        StateError: the round bundle is rejected or does not continue the previous round (exit 7).
    """
    from attestation.policy import load_policy
    from attestation.rounds.verify import check_round_link, verify_round

    last = rounds[-1][1]
    verdict = verify_round(last, policy=load_policy(prepared.policy_file), now=int(time.time()) if now is None else now)
    link = check_round_link(last, rounds[-2][1]) if len(rounds) > 1 else []
    if not verdict.accepted or link:
        failed = ", ".join([c.name for c in verdict.failed] + link)
        raise StateError(f"the round bundle {last} failed verification: {failed}",
                         fix=f"see the failed checks: cvm-tune verify {last} --policy {prepared.policy_file}")
    return verdict, link

