"""docker-compose YAML as data that remembers where each key and list item came from.

The compose audit must judge what Docker Compose will run, so anchors, aliases and ``<<`` merge keys are resolved
exactly as PyYAML's safe loader resolves them (libyaml's ``CSafeLoader`` when PyYAML was built with it, else the pure
Python ``SafeLoader``: same results). Each mapping and sequence carries the 1-based source line of its keys / items,
so a finding can name the offending line even when the value was merged in from an anchor elsewhere in the file.
A key written twice in one mapping is an error (PyYAML would keep the last, Docker Compose refuses the file).

Docker Compose reads YAML 1.2's core schema: strings, numbers, booleans, null, sequences and mappings. PyYAML's safe
loader also honours ``!!binary``, ``!!timestamp``, ``!!set``, ``!!omap`` and ``!!pairs``, which turn text that
Compose reads as a string (``network_mode: !!binary aG9zdA==`` is "host" to Compose) into values an audit of
strings would never see; so any explicit tag beyond the core schema is refused, with its line. So are documents
whose aliases expand past ``safe_yaml.MAX_NODES`` nodes (``safe_yaml.expanded_nodes``).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.resolver import BaseResolver

from attestation.io.safe_yaml import MAX_DEPTH, MAX_NODES, YAMLLimitError, load_bounded

BASE_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE = "tag:yaml.org,2002:"
CORE_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))


class LinedDict(dict):
    """A YAML mapping; ``lines[key]`` = the line its (last) definition starts on."""

    lines: dict[Any, int]

    def line(self, key: Any, default: int = 0) -> int:
        return self.lines.get(key, default)


class LinedList(list):
    """A YAML sequence; ``lines[i]`` = the line item ``i`` starts on."""

    lines: list[int]

    def line(self, i: int, default: int = 0) -> int:
        return self.lines[i] if 0 <= i < len(self.lines) else default


def _mapping(loader: Any, node: yaml.MappingNode) -> LinedDict:
    seen: set[str] = set()
    for key_node, _ in node.value:  # before `<<` merges are flattened: a key written twice is refused, as Compose does
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
            seen.add(key_node.value)
    data = LinedDict(loader.construct_mapping(node, deep=True))  # flattens `<<` merges into node.value first
    data.lines = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            data.lines[key] = key_node.start_mark.line + 1
    return data


def _sequence(loader: Any, node: yaml.SequenceNode) -> LinedList:
    data = LinedList(loader.construct_sequence(node, deep=True))
    data.lines = [item.start_mark.line + 1 for item in node.value]
    return data


def make_loader(base: type = BASE_LOADER) -> type:
    """A safe loader class (subclass of ``base``) building :class:`LinedDict` / :class:`LinedList`."""
    loader = type(f"Lined{base.__name__}", (base,), {})
    loader.add_constructor(BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    loader.add_constructor(BaseResolver.DEFAULT_SEQUENCE_TAG, _sequence)
    return loader


LOADER = make_loader()


def check_events(text: str, loader: type = LOADER, *, max_depth: int = MAX_DEPTH) -> None:
    """One pass over the event stream, before anything is composed: collections nested more than ``max_depth``
    (libyaml's composer recurses on the C stack and crashes the process on deeply nested input) and explicit tags
    outside the core schema are refused.

    Raises:
        yaml.YAMLError: either (``YAMLLimitError``: one line, with the line and column), or a syntax error.
    """
    level = 0
    for event in yaml.parse(text, Loader=loader):
        tag = getattr(event, "tag", None)  # None unless written out (``!!binary``, ``!foo``, ``!``)
        if tag is not None and tag not in CORE_TAGS:
            mark = event.start_mark
            short = "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag
            raise YAMLLimitError(f"line {mark.line + 1}, column {mark.column + 1}: tag {short} is not in the YAML core "
                                 "schema Docker Compose reads (str, int, float, bool, null, seq, map); write the plain value")
        if isinstance(event, yaml.CollectionStartEvent):
            level += 1
            if level > max_depth:
                raise YAMLLimitError(f"collections nested more than {max_depth} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            level -= 1


def parse(text: str, loader: type = LOADER) -> Any:
    """Parse one YAML document with line information (the checks of :func:`check_events` first, and at most
    ``MAX_NODES`` nodes with aliases expanded).

    Raises:
        yaml.YAMLError: not YAML, or over one of those limits (an app-compose.json in a bundle is untrusted).
    """
    check_events(text, loader)
    return load_bounded(text, loader, max_nodes=MAX_NODES)
