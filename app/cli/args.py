"""argparse value types shared by the command-line modules (``app.cli`` and the command families it registers).

Stdlib only: ``cvm-tune --help`` imports this.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi] (out of range is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return parse
