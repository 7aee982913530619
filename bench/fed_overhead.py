"""Per-round cost of attestation in a federated round: client training vs the aggregator's verification.

    python bench/fed_overhead.py [--clients 3] [--steps 20] [--out bench/results/fed-overhead-cpu.json]

One round, measured in one process with the real components (embedded simulators, owner-signed encrypted datasets,
the tiny model): each client trains and exports its bundle (``run_once`` with the round's nonce); the aggregator
admits every reply (bundle tar unpacked, ``verify_bundle``, compose/owner/round checks, weights compared with the
bundle's adapter), aggregates with Flower's FedAvg, and exports the round bundle (quote, self-verification of the
round and every client bundle). A warm-up round runs first (imports, tiny-model build). Flower's transport is left
out: it is the same with or without attestation. Each client's check of the aggregator's round (``verify_round_head``,
before it trains on the next global adapter) is timed once and counted per client. Ratios are computed within the
run.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

from attestation.policy import simulator_policy
from attestation.rounds.verify import verify_round_head

from app.config import Config
from app.dataset import encrypt_stream
from app.federated.admission import Admission, Admitted, RoundTerms
from app.federated.client_app import reply_content
from app.federated.round_export import Aggregator, RoundRecord, export_round
from app.federated.round_input import RoundInput
from app.federated.strategy import make_strategy
from app.run.pipeline import RunHooks, run_once
from app.tee import open_guest_agent
from timing import write_json  # bench/timing.py: the script directory is on sys.path

SAMPLE = Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl"


def _clients(root: Path, n: int, steps: int) -> tuple[list[Config], dict[str, Any]]:
    rows = [line for line in SAMPLE.read_bytes().splitlines() if line.strip()]
    key = bytes(range(32))
    cfgs, listed = [], {}
    for i in range(n):
        name, owner = f"client-{i}", Ed25519PrivateKey.from_private_bytes(bytes([0x60 + i]) * 32)
        d = root / name
        (d / "data").mkdir(parents=True)
        part = b"\n".join(rows[i::n]) + b"\n"
        with open(d / "data" / "set-v1.cvmds", "wb") as fh:
            encrypt_stream(io.BytesIO(part), fh, key, dataset_id=name, dataset_version=1, owner_key=owner)
        (d / "key").write_bytes(key)
        (d / "key").chmod(0o600)
        pub = owner.public_key().public_bytes_raw().hex()
        cfgs.append(Config.model_validate({
            "output": {"dir": str(d / "out")}, "training": {"max_steps": steps, "save_steps": steps},
            "dataset": {"source": "encrypted-file", "path": str(d / "data"), "dataset_id": name,
                        "owner_public_key": pub, "key": {"source": "file", "file": str(d / "key")}},
            "alerts": {"webhook_url_env": "CVM_TUNE_BENCH_NO_WEBHOOK"}, "federation": {"client_name": name}}))
        listed[name] = {"owner_public_keys": [pub]}
    return cfgs, listed


def _reply(node: int, name: str, bundle: Path) -> Message:
    """A client's reply as the SuperLink hands it to the ServerApp (sender: ``node``)."""
    meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=f"m{node}",
                    group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    return Message(content=reply_content(name, bundle), metadata=meta)


def one_round(root: Path, round_no: int, cfgs: list[Config], listed: dict[str, Any], stack: ExitStack) -> dict[str, float]:
    nonce = f"{round_no:02x}" * 32
    t: dict[str, float] = {"train_total_s": 0.0, "trainer_s": 0.0}
    bundles = []
    for cfg in cfgs:
        start = time.perf_counter()
        res = run_once(cfg, run_id=f"fed-r{round_no}-bench", hooks=RunHooks(federation=RoundInput(1, nonce, None, None)))
        t["train_total_s"] += time.perf_counter() - start
        t["trainer_s"] += res.train_runtime_s
        bundles.append(res.bundle_dir)
    agg_cfg = Config.model_validate({"output": {"dir": str(root / f"aggregator-{round_no}")}, "federation": {
        "clients": listed, "client_compose_hashes": ["0" * 64], "min_clients": len(cfgs)}})
    agent = stack.enter_context(open_guest_agent(agg_cfg.tee))
    ident = agent.identity()
    fed = agg_cfg.federation.model_copy(update={"client_compose_hashes": (ident.compose_hash,)})
    policy = simulator_policy(agent.simulator_root_der())
    replies = [_reply(i + 1, cfg.federation.client_name or "", b) for i, (cfg, b) in enumerate(zip(cfgs, bundles))]
    start = time.perf_counter()
    gate = Admission(fed, policy, root / f"work-{round_no}")
    terms = RoundTerms(1, nonce, None, 0.0)
    admitted: list[Admitted] = []
    for msg in replies:
        verdict = gate.check(msg, terms, {a.client for a in admitted})
        if not isinstance(verdict, Admitted):
            raise SystemExit(f"bench: a client bundle was rejected: {verdict.reason}")
        admitted.append(verdict)
    t["admission_s"] = time.perf_counter() - start
    inner, record = make_strategy(fed)
    start = time.perf_counter()
    for msg, a in zip(replies, admitted):
        msg.content = RecordDict({"arrays": a.arrays, "metrics": MetricRecord({"trainable-tokens": a.trainable_tokens})})
    arrays, _ = inner.aggregate_train(1, replies)
    t["aggregate_s"] = time.perf_counter() - start
    aggregator = Aggregator(agent, ident, True, "embedded-simulator", "auto", "", 30.0, policy)
    start = time.perf_counter()
    path, _ = export_round(root / f"rounds-{round_no}", aggregator, RoundRecord("bench", 1, nonce, record, len(cfgs),
                                                                              None, None), arrays, admitted, [])
    t["round_export_s"] = time.perf_counter() - start
    start = time.perf_counter()  # what each client of the next round checks before training on this aggregate
    verdict, _ = verify_round_head(path, policy=policy, now=int(time.time()))
    t["client_aggregator_check_s"] = time.perf_counter() - start
    if not verdict.accepted:
        raise SystemExit(f"bench: the round does not verify: {verdict.failed[0]}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cvm-tune-fed-bench-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        cfgs, listed = _clients(root, args.clients, args.steps)
        one_round(root, 1, cfgs, listed, stack)  # warm-up
        t = one_round(root, 2, cfgs, listed, stack)
    verification = t["admission_s"] + t["round_export_s"] + args.clients * t["client_aggregator_check_s"]
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "clients": args.clients, "steps": args.steps,
        "seconds": {k: round(v, 4) for k, v in t.items()},
        "admission_per_client_s": round(t["admission_s"] / args.clients, 4),
        "verification_over_training": round(verification / t["train_total_s"], 4),
        "verification_over_trainer": round(verification / t["trainer_s"], 4),
        "note": "train_total_s: every client's whole run (decrypt, train, export, quote, self-verify), summed; clients "
                "run in parallel in a real federation. Verification: admission (unpack, verify every bundle, compare "
                "weights) + round export (quote, self-verification of the round and its client bundles) + each "
                "client's check of the aggregator's round.",
    }
    print(json.dumps(report, indent=2))
    write_json(report, args.out)


if __name__ == "__main__":
    main()
