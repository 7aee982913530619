"""YAML for configs and policies, bounded JSON, and nesting limits for both (no third-party imports but PyYAML).

Hostile input is refused with one clear error, never a crash: a key given twice (YAML would keep the last),
nesting deeper than a real file has (``MAX_DEPTH``), nesting so deep the parser would recurse out, a document over
its size limit, or an integer too long to convert.
"""

from __future__ import annotations

import json

import yaml


MAX_DEPTH = 32  # nesting of a config, policy or manifest: a few levels; refuse before it hurts a recursive step


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (YAML would silently keep the last)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    seen = set()
    for key, (knode, _) in zip(keys, node.value):
        if not isinstance(key, (str, int, float, bool)):
            continue  # an unhashable (complex) key: construct_mapping refuses it with a YAMLError
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", knode.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)

_CSafeLoader = getattr(yaml, "CSafeLoader", None)  # libyaml, when PyYAML was built with it: ~9x faster
_UniqueKeyCLoader: type | None = None
if _CSafeLoader is not None:
    _UniqueKeyCLoader = type("_UniqueKeyCLoader", (_CSafeLoader,), {"__doc__": "libyaml SafeLoader refusing duplicate keys."})
    _UniqueKeyCLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def deeper_than(text: str | bytes, limit: int) -> bool:
    """Whether the collections of ``text`` nest more than ``limit`` deep, from libyaml's event stream.

    libyaml's parser keeps its own stack (no recursion) and this stops at the first level past the limit, so
    the composer, which recurses on the C stack, never sees input deeper than a real file. Every libyaml load of
    untrusted text goes through this first (``parse_yaml`` here, ``attestation.compose_yaml.parse``)."""
    level = 0
    for event in yaml.parse(text, Loader=_CSafeLoader or yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            level += 1
            if level > limit:
                return True
        elif isinstance(event, yaml.CollectionEndEvent):
            level -= 1
    return False


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

    libyaml (``CSafeLoader``) when available, after a nesting check on its event stream (its composer would
    overflow the C stack on deeply nested input); the pure-Python SafeLoader otherwise, which raises
    RecursionError instead."""
    deep = f"{what} is nested more than {max_depth} levels deep: not a cvm-tune file"
    try:
        if _UniqueKeyCLoader is not None:
            if deeper_than(text, max_depth):
                raise error(deep)
            data = yaml.load(text, Loader=_UniqueKeyCLoader)  # noqa: S506  (a CSafeLoader subclass)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {str(exc).strip().splitlines()[0]}") from exc
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a cvm-tune file") from None
    if depth(data) > max_depth:
        raise error(deep)
    return data


MAX_JSON_BYTES = 16 << 20  # a manifest, app-compose, listing or reply: a few KB; refuse past this before parsing


def parse_json(raw: str | bytes, what: str, error: type, *, max_bytes: int = MAX_JSON_BYTES,
               max_depth: int = MAX_DEPTH) -> object:
    """Parse untrusted JSON with a size and nesting bound; ``error(message)`` on anything else.

    Refused: more than ``max_bytes``, invalid UTF-8 or JSON, ``NaN``/``Infinity``, an integer longer than Python
    converts (``ValueError``), nesting the C parser recurses out of (``RecursionError``) or deeper than
    ``max_depth``. Every untrusted JSON document (bundle files, app-compose, server replies) goes through here."""
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes} bytes")

    def _constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        data = json.loads(text, parse_constant=_constant)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a cvm-tune file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if depth(data) > max_depth:
        raise error(f"{what} is nested more than {max_depth} levels deep: not a cvm-tune file")
    return data
