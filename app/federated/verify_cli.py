"""``cvm-tune verify ROUND_DIR [--parent PREVIOUS_ROUND_DIR]``: a federated round bundle, recursively (light)."""

from __future__ import annotations

import argparse
from typing import Any

from attestation.round_verify import check_round_link, verify_round


def verify_round_cli(args: argparse.Namespace, policy: Any, now: int, collateral: Any) -> int:
    """Verify ``args.bundle`` (and with ``--parent``, the previous round and the link); 0 accepted, 1 rejected."""
    from app.cli_verify import _print_verdict, _print_with_parent

    verdict = verify_round(args.bundle, policy=policy, now=now, collateral=collateral)
    if args.parent is None:
        return _print_verdict(verdict, as_json=args.json)
    parent = verify_round(args.parent, policy=policy, now=now)
    return _print_with_parent(verdict, parent, check_round_link(args.bundle, args.parent), as_json=args.json,
                              names=("round", "previous", f"previous round {args.parent}", "link"),
                              linked="this round continued the previous one (manifest hash, round number, global "
                              "adapter)")
