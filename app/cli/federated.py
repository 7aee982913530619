"""``cvm-tune federated simulate``: attested federated rounds on one machine (docs/federated.md).

Registered by :mod:`app.cli` (which catches errors and maps exit codes); like it, this module prints. The work is
in :mod:`app.federated.simulate`, imported when the command runs (Flower and ray are heavy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli.args import bounded_int, out_option, printable


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``federated`` (with its action ``simulate``) to the top-level subparsers."""
    f = sub.add_parser("federated", help="federated rounds on Flower: simulate them on this machine",
                       description="Attested federated rounds on Flower (docs/federated.md).")
    fsub = f.add_subparsers(dest="federated_command", required=True, metavar="ACTION")
    s = fsub.add_parser(
        "simulate", help="run attested rounds with simulated data owners on this machine (needs ray)",
        description="Create one owner key and signed encrypted dataset per simulated data owner (the bundled sample "
        "rows, split among them), every client's and the aggregator's config, run the rounds on Flower's in-process "
        "simulation engine (embedded guest-agent simulators; nothing keeps running afterwards) and verify the last "
        "round bundle under the simulator's test policy. Exit 0 done and verified, 2 bad arguments or --out not "
        "empty, 6 a round failed (too few client bundles admitted) or ray is missing, 7 the round bundle failed "
        "verification.")
    out_option(s, required=True, metavar="DIR",
               help="new or empty directory: keys, datasets, configs, output volumes and round bundles go there")
    s.add_argument("--clients", type=bounded_int(2, 8), default=3, metavar="N", help="simulated data owners (2..8, default 3)")
    s.add_argument("--rounds", type=bounded_int(1, 5), default=2, metavar="R", help="rounds (1..5, default 2)")
    s.add_argument("--strategy", choices=("fedavg", "fedprox", "fedyogi"), default="fedavg",
                   help="Flower strategy (default fedavg; fedyogi starts from a fresh initial adapter)")
    s.add_argument("--max-steps", type=bounded_int(1, 200), default=5, metavar="N",
                   help="training steps per client and round (default 5)")
    s.add_argument("--min-clients", type=bounded_int(1, 8), metavar="M",
                   help="fewest admitted client bundles a round needs (default: every client)")
    s.add_argument("--secure-aggregation", action="store_true",
                   help="federation.secure_aggregation: clients encrypt their updates to the aggregator CVM's attested "
                   "key, and the global adapter is stored encrypted to the admitted clients (docs/federated.md)")


def _federated(args: argparse.Namespace) -> int:
    return {"simulate": _simulate}[args.federated_command](args)


def _simulate(args: argparse.Namespace) -> int:
    from app.federated.simulate import Plan, check_plan, prepare, run_rounds, verify_last

    plan = Plan(args.out, clients=args.clients, rounds=args.rounds, strategy=args.strategy, max_steps=args.max_steps,
                min_clients=args.min_clients, secure_aggregation=args.secure_aggregation)
    check_plan(plan)  # before anything is written
    prepared = prepare(plan)
    print(f"data owners: {', '.join(plan.names)}: keys in {plan.out}/owners, signed encrypted datasets and CVM "
          f"configs in {plan.out}/clients", flush=True)
    print(f"aggregator: {prepared.aggregator_config}", flush=True)
    secure = " with secure aggregation" if plan.secure_aggregation else ""
    print(f"running {plan.rounds} round(s) of {plan.strategy}{secure} with {plan.clients} simulated CVMs on Flower's "
          "simulation engine …", flush=True)
    result = run_rounds(prepared, progress=lambda line: print(line, flush=True))  # each round as it goes
    for n, client, reason in result.rejections:
        print(f"round {n}: rejected {client or '?'}: {reason}")
    verdict, _ = verify_last(prepared, result.rounds)
    last = result.rounds[-1][1]
    print(f"Verdict ({prepared.policy_file.name}): {verdict.summary()}")
    if len(result.rounds) > 1:
        print(f"link: round {result.rounds[-1][0]} continued round {result.rounds[-2][0]}")
    print(f"Verify again: cvm-tune verify {last} --policy {prepared.policy_file}")
    return 0


def round_summary(bundle: Path) -> list[str]:
    """What a round bundle's manifest says the round did: the admitted clients (tokens, weight), the rejected ones
    (why), the aggregate. For ``cvm-tune verify ROUND_BUNDLE`` after its verdict (the manifest is read, not checked):
    nothing when the manifest cannot be read (the verdict says why)."""
    from attestation.rounds import manifest as R

    from app.federated.quiet import round_manifest

    try:
        m = round_manifest(bundle)
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return []
    admitted = ", ".join(f"{a.client} ({a.trainable_tokens} tokens, weight {a.weight:.3f})" for a in m.admitted)
    rejected = "; ".join(f"{r.client or '?'}: {r.reason}" for r in m.rejected)
    adapter = f"global adapter sha256 {m.global_adapter_sha256[:16]}…"
    if m.confidentiality is not None:
        adapter += f", stored as age ciphertext to {len(m.confidentiality.recipients)} recipient(s) (secure aggregation)"
    else:
        adapter += f" ({bundle.resolve() / R.GLOBAL_ADAPTER})"
    lines = [f"admitted: {len(m.admitted)}: {admitted}",
             f"rejected: {len(m.rejected)}" + (f": {rejected}" if rejected else ""),
             f"aggregate: {m.strategy.name} of {len(m.admitted)} update(s) weighted by trainable tokens; {adapter}"]
    return [printable(line) for line in lines]  # a rejected client's name and reason are whatever it sent


COMMANDS = {"federated": _federated}
