"""docker-compose YAML as data that remembers where each key and list item came from.

The compose audit must judge what Docker Compose will run, so anchors, aliases and ``<<`` merge keys are resolved
exactly as PyYAML's safe loader resolves them (libyaml's ``CSafeLoader`` when PyYAML was built with it, else the pure
Python ``SafeLoader``: same results). Each mapping and sequence carries the 1-based source line of its keys / items,
so a finding can name the offending line even when the value was merged in from an anchor elsewhere in the file.
A key written twice in one mapping is an error (PyYAML would keep the last, Docker Compose refuses the file).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.resolver import BaseResolver

from attestation.safe_yaml import MAX_DEPTH, deeper_than

BASE_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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


def parse(text: str, loader: type = LOADER) -> Any:
    """Parse one YAML document with line information. Raises ``yaml.YAMLError``, also for collections nested more
    than ``MAX_DEPTH`` deep: checked on the event stream first, because libyaml's composer recurses on the C stack and
    crashes the process on deeply nested input (an app-compose.json in a bundle is untrusted)."""
    if deeper_than(text, MAX_DEPTH):
        raise yaml.YAMLError(f"collections nested more than {MAX_DEPTH} levels deep")
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
