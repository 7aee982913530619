"""Size and depth limits at the parsing boundary (stdlib + PyYAML only, cheap to import).

Every file a user hands over (config, policy, manifest, quote, event log, collateral) is read
through :func:`read_regular`: a regular file only (a FIFO or device is refused without blocking),
at most ``limit`` bytes read. JSON and YAML are parsed with a nesting limit, so a document nested
100,000 levels deep is an input error, not a ``RecursionError``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

MAX_DEPTH = 64  # nesting of JSON arrays/objects and YAML sequences/mappings in any input document

ErrorFactory = Callable[..., Exception]  # an error class taking (message, *, fix=...)


class InputLimitError(ValueError):
    """A plain error for callers without their own category (message, optional fix)."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix


def read_regular(path: Path, limit: int, error: ErrorFactory, what: str) -> bytes:
    """Read a regular file of at most ``limit`` bytes (opened non-blocking; never a FIFO or device).

    Raises:
        error: missing, unreadable, not a regular file, or longer than ``limit``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}", fix=f"pass an existing {what} file") from exc
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise error(f"{what} {path} is not a regular file", fix=f"pass an existing {what} file")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise error(f"cannot read {what} {path}: {exc.strerror}", fix=f"pass an existing {what} file") from exc
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit} bytes; this is not a {what}")
    return data


def json_depth_ok(data: str | bytes, max_depth: int = MAX_DEPTH) -> bool:
    """True when brackets outside strings nest at most ``max_depth`` deep (a linear scan, no recursion)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if text.count("[") + text.count("{") <= max_depth:
        return True
    depth, in_str, escaped = 0, False, False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads_json(data: str | bytes, error: ErrorFactory, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with a nesting limit; any failure is ``error``."""
    if not json_depth_ok(data, max_depth):
        raise error(f"{source} is nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise error(f"{source} looks like JSON but does not parse: {str(exc)[:200]}") from exc


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (YAML's last-one-wins hides mistakes)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (list, dict)):
            continue  # unhashable: SafeLoader reports it below
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def loads_yaml(raw: bytes, error: ErrorFactory, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a small YAML document: UTF-8, nesting at most ``max_depth``, no duplicate keys, no aliases.

    Raises:
        error: any of the above, or a YAML syntax error (the message names the line).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source} is not UTF-8 text (byte {exc.start})", fix=f"save {source} as UTF-8") from exc
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events only: no recursion, no objects yet
            if isinstance(event, yaml.AliasEvent):
                raise error(f"{source} uses a YAML alias (*name)", fix="write the values out")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > max_depth:
                    raise error(f"{source} is nested deeper than {max_depth} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        where = f" at line {exc.problem_mark.line + 1}" if exc.problem_mark is not None else ""
        raise error(f"{source} is not valid YAML: {exc.problem or exc.context}{where}") from exc
    except yaml.YAMLError as exc:
        raise error(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from exc
