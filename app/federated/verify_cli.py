"""``cvm-tune verify ROUND_DIR [--parent PREVIOUS_ROUND_DIR]``: a federated round bundle, recursively (light)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attestation.round_verify import check_round_link, verify_round


def verify_round_cli(args: argparse.Namespace, policy: Any, now: int, collateral: Any) -> int:
    """Verify ``args.bundle`` (and with ``--parent``, the previous round and the link); 0 accepted, 1 rejected."""
    from app.cli import EXIT_REJECTED, _print_verdict, _silence_stdout, _write_verdict

    verdict = verify_round(args.bundle, policy=policy, now=now, collateral=collateral)
    if args.parent is None:
        return _print_verdict(verdict, as_json=args.json)
    parent = verify_round(args.parent, policy=policy, now=now)
    problems = check_round_link(args.bundle, args.parent)
    ok = verdict.accepted and parent.accepted and not problems
    try:
        if args.json:
            print(json.dumps({"accepted": ok, "round": verdict.to_json(), "previous": parent.to_json(),
                              "link_problems": problems}, indent=2))
        else:
            _write_verdict(verdict, as_json=False)
            print(f"previous round {args.parent}: {parent.summary()}")
            for c in parent.failed:
                print(f"  FAIL {c.name}: {c.detail}")
            print("link: " + ("this round continued the previous one (manifest hash, round number, global adapter)"
                              if not problems else "BROKEN: " + "; ".join(problems)))
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    return 0 if ok else EXIT_REJECTED
