"""argparse value types, the ``-o/--out`` option and the parser class shared by the command-line modules (``app.cli``
and the command families it registers).

Stdlib only: ``cvm-tune --help`` imports this.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


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


def out_option(p: argparse.ArgumentParser, *old: str, dest: str = "out", **kw: object) -> argparse.Action:
    """Add ``-o/--out``, the one spelling of "where to write": ``old`` spellings (``--output``, ``--out-dir``, …) are
    still accepted, as the same option, but never shown in ``--help`` (:class:`Parser`)."""
    action = p.add_argument("-o", "--out", *old, dest=dest, type=Path, **kw)  # type: ignore[arg-type]
    action.hidden_aliases = old  # type: ignore[attr-defined]
    return action


class _Formatter(argparse.HelpFormatter):
    """Help without an option's hidden aliases (see :func:`out_option`)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, "hidden_aliases", ())
        if hidden:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in hidden]
        return super()._format_action_invocation(action)


class Parser(argparse.ArgumentParser):
    """``cvm-tune``'s parser (its subcommands' parsers are of the same class): hidden aliases stay out of ``--help``,
    and a mistyped subcommand or choice is answered with the closest valid one ("did you mean verify?")."""

    def __init__(self, *args: object, **kw: object) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        for action in self._actions:  # "required: -o/--out", not the hidden aliases too
            if getattr(action, "hidden_aliases", ()):
                shown = [s for s in action.option_strings if s not in action.hidden_aliases]  # type: ignore[attr-defined]
                message = message.replace("/".join(action.option_strings), "/".join(shown))
        super().error(did_you_mean(message))


def did_you_mean(message: str) -> str:
    """argparse's "invalid choice: 'verfy' (choose from 'run', 'verify', …)" with the closest choice named first."""
    m = re.match(r"(.*invalid choice: '([^']*)') \(choose from (.*)\)$", message, flags=re.S)
    if m is None:
        return message
    close = difflib.get_close_matches(m.group(2), re.findall(r"'([^']*)'", m.group(3)), n=1)
    return f"{m.group(1)}: did you mean {close[0]}? (choose from {m.group(3)})" if close else message


def printable(line: str) -> str:
    """A line whose text comes from an unverified manifest, with control characters (terminal escapes, newlines)
    shown escaped instead of acted on."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line)
