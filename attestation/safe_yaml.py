"""YAML for configs and policies, and nesting limits for parsed JSON/YAML (no third-party imports but PyYAML).

Hostile input is refused with one clear error, never a crash: a key given twice (YAML would keep the last),
nesting deeper than a real file has (``MAX_DEPTH``), or nesting so deep the parser would recurse out.
"""

from __future__ import annotations

import yaml


MAX_DEPTH = 32  # nesting of a config, policy or manifest: a few levels; refuse before it hurts a recursive step


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (YAML would silently keep the last)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    seen = set()
    for key, (knode, _) in zip(keys, node.value):
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", knode.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def depth(obj: object) -> int:
    """Nesting depth of parsed YAML/JSON, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def parse_yaml(text: str | bytes, what: str, error: type, *, max_depth: int = MAX_DEPTH) -> object:
    """Parse a YAML config or policy: unique keys, bounded nesting; ``error(message)`` otherwise.

    Pure-Python SafeLoader on purpose: libyaml overflows the C stack on deeply nested input."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {str(exc).strip().splitlines()[0]}") from exc
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a cvm-tune file") from None
    if depth(data) > max_depth:
        raise error(f"{what} is nested more than {max_depth} levels deep: not a cvm-tune file")
    return data

