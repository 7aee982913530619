"""YAML for configs and policies, bounded JSON, and nesting limits for both (no third-party imports but PyYAML).

Hostile input is refused with one clear error, never a crash: a key given twice (YAML would keep the last),
nesting deeper than a real file has (``MAX_DEPTH``), nesting so deep the parser would recurse out, anchors and
aliases that expand to more than ``MAX_NODES`` nodes (an "alias bomb": a few KB that a reader would walk as 10^8
items), a document over its size limit, or an integer too long to convert. YAML errors name their line and column.
"""

from __future__ import annotations

import json

import yaml


MAX_DEPTH = 32  # nesting of a config, policy or manifest: a few levels; refuse before it hurts a recursive step
MAX_NODES = 100_000  # nodes of a YAML document with every alias expanded: a real file has a few hundred


class YAMLLimitError(yaml.YAMLError):
    """A YAML document over one of the limits above (its message is one line, with the line where known)."""


def error_text(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: ``line L, column C: problem (context)`` when PyYAML knows where it is."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        if exc.problem and exc.context:
            what += f" ({' '.join(str(exc.context).split())})"
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def expanded_nodes(root: yaml.Node, limit: int = MAX_NODES) -> int:
    """How many nodes the document under ``root`` has with every alias expanded (what a reader walks).

    Counted once per distinct node (an alias is the same node object again), so counting costs the size of the text,
    not of its expansion; iterative, so a long chain of aliases cannot recurse out.

    Raises:
        YAMLLimitError: more than ``limit``, or an alias inside its own anchor (a recursive structure).
    """
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            active.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            if size[key] > limit:
                raise YAMLLimitError(f"line {node.start_mark.line + 1}: anchors and aliases expand to more than {limit} "
                                     "nodes (an alias bomb?)")
            continue
        if key in size:
            continue
        if key in active:
            raise YAMLLimitError(f"line {node.start_mark.line + 1}: an alias refers to its own anchor "
                                 "(a recursive structure)")
        active.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    return size[id(root)]


def load_bounded(text: str | bytes, loader: type, *, max_nodes: int = MAX_NODES) -> object:
    """``yaml.load`` with :func:`expanded_nodes` checked between composing the node graph and building objects (the
    composer keeps aliases as shared nodes; everything after it would walk their expansion)."""
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        expanded_nodes(node, max_nodes)
        return parser.construct_document(node)
    finally:
        parser.dispose()


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
    untrusted text goes through this first (``parse_yaml`` here, ``attestation.compose.located_yaml.parse``)."""
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


def parse_yaml(text: str | bytes, what: str, error: type, *, max_depth: int = MAX_DEPTH,
               max_nodes: int = MAX_NODES) -> object:
    """Parse a YAML config or policy: unique keys, bounded nesting and alias expansion; ``error(message)`` otherwise
    (with the line and column of a syntax error).

    A nesting check on the event stream first (libyaml's composer would overflow the C stack on deeply nested
    input), then libyaml (``CSafeLoader``) when available, else the pure-Python SafeLoader; the composed node graph
    is counted (:func:`expanded_nodes`) before any object is built."""
    deep = f"{what} is nested more than {max_depth} levels deep: not a cvm-tune file"
    try:
        if deeper_than(text, max_depth):
            raise error(deep)
        data = load_bounded(text, _UniqueKeyCLoader or _UniqueKeyLoader, max_nodes=max_nodes)
    except YAMLLimitError as exc:
        raise error(f"{what}: {exc}: not a cvm-tune file") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {error_text(exc)}") from exc
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
