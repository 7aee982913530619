"""Server-side custom losses (``ServiceClient.create_custom_loss``): a torch.fx graph sent as data, rebuilt here from
an explicit allow-list of operations, and identified by a hash the op chain and the manifest carry.

The SDK traces the client's per-datum loss ``fn(logprobs, *inputs) -> (loss, metrics)`` and sends its nodes as
plain data (``CustomLossGraph``). Nothing in it is executable: every ``call_function`` target and ``call_method``
name must be one of :data:`FUNCTIONS` / :data:`METHODS` (anything else is refused with the node named), every argument
is decoded from the SDK's encoding (``{"ref": node}``, ``{"tuple": …}``, ``{"float": "inf"}``, …), the graph is
bounded in size (:data:`MAX_NODES`) and nesting (:data:`MAX_DEPTH`), and it is run node by node on tensors only.

**Bounded work** (:mod:`app.api.engine.loss_bounds`). A loss computes on tensors of one value per token; the Python
numbers, strings and sequences a graph may also pass around, and the size of every tensor a node makes, are bounded
before the node computes, so that no node of any graph takes more than a bounded time or memory.

A node that fails at run time (a shape mismatch, a wrong type, a bound above) fails its op with the reason (category
``user``, a 400), never as a server error.

The loss's **canonical hash** is the hex SHA-256 of the JSON of ``{"name", "inputs", "graph"}`` as the SDK sent them
(keys sorted, no spaces): it is the ``loss_id`` the server answers, the ``loss_fn_config.loss_id`` of every
``forward_backward`` op that uses it (so the op chain commits to it), and the key of the loss's document in the
manifest's ``op_chain.custom_losses`` (docs/verifier-spec.md section 15). A client proves which loss trained its
adapter by recomputing the hash from what it sent.
"""

from __future__ import annotations

import math
import operator
import re
import time
from collections.abc import Callable
from typing import Any

from attestation.outputs.op_chain import custom_loss_id

from app.api.errors import ApiError, BadRequest
from app.api.engine.loss_bounds import ELEMENTS_PER_TOKEN, MAX_LIST, MIN_ELEMENTS, after, before, check_scalar, short

MAX_NODES = 256
MAX_DEPTH = 8
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
METRIC = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_TORCH_FUNCTIONS = ("abs", "clamp", "clip", "exp", "expm1", "log", "log1p", "sqrt", "square", "sigmoid", "tanh",
                    "minimum", "maximum", "sum", "mean", "where", "ones_like", "zeros_like", "full_like", "pow",
                    "neg", "sign", "detach", "logsumexp", "dot", "stack", "cat", "softmax", "log_softmax", "exp2",
                    "add", "sub", "mul", "div", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or",
                    "logical_not", "isfinite", "nan_to_num", "reciprocal", "rsqrt", "relu")
_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "pow", "getitem", "lt", "le", "gt",
              "ge", "eq", "ne", "and_", "or_", "invert")
METHODS = frozenset({"abs", "clamp", "clip", "exp", "expm1", "log", "log1p", "sqrt", "square", "sigmoid", "tanh",
                     "sum", "mean", "detach", "pow", "neg", "sign", "unsqueeze", "squeeze", "reshape", "view",
                     "float", "double", "to", "size", "dim", "numel", "min", "max", "gather", "masked_fill", "where",
                     "softmax", "log_softmax", "logsumexp", "add", "sub", "mul", "div", "lt", "le", "gt", "ge", "eq",
                     "ne", "minimum", "maximum", "reciprocal", "rsqrt", "relu", "nan_to_num", "isfinite"})
_ATTRIBUTES = frozenset({"shape", "ndim", "dtype"})
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool")


def functions() -> dict[str, Callable[..., Any]]:
    """The ``call_function`` targets a custom loss may name, by the qualified name the SDK sends."""
    import torch
    import torch.nn.functional as F

    out: dict[str, Callable[..., Any]] = {f"torch.{n}": getattr(torch, n) for n in _TORCH_FUNCTIONS}
    out.update({f"operator.{n}": getattr(operator, n) for n in _OPERATORS})
    out.update({f"torch.nn.functional.{n}": getattr(F, n) for n in ("logsigmoid", "softplus", "relu", "softmax",
                                                                      "log_softmax")})
    out.update({f"math.{n}": getattr(math, n) for n in ("exp", "log", "sqrt", "log1p", "expm1")})
    out["builtins.getattr"] = _getattr
    return out


def _getattr(obj: Any, name: str) -> Any:
    if name not in _ATTRIBUTES:
        raise BadRequest(f"custom loss: attribute {name!r} is not allowed (allowed: {', '.join(sorted(_ATTRIBUTES))})")
    return getattr(obj, name)


def canonical(name: str, inputs: list[dict[str, Any]], graph: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(id, document) of a custom loss as the SDK sent it (:func:`attestation.outputs.op_chain.custom_loss_id`)."""
    doc = {"name": name, "inputs": inputs, "graph": graph}
    return custom_loss_id(doc), doc


class Loss:
    """A custom loss rebuilt from its document: ``loss(logprobs, *inputs) -> (scalar loss, {metric: tensor})``."""

    def __init__(self, doc: dict[str, Any]) -> None:
        """Check the whole document before anything runs.

        Raises:
            BadRequest: a node the allow-list does not hold (named), a malformed or oversized graph, inputs that do
                not match its placeholders, or an output that is not (loss, {metric: tensor}).
        """
        graph = doc.get("graph") if isinstance(doc, dict) else None
        if not isinstance(graph, dict) or not isinstance(doc.get("name", ""), str):
            raise BadRequest("custom loss: a document is {\"name\", \"inputs\", \"graph\": {\"format\", \"nodes\"}}")
        self.name = doc.get("name", "")
        inputs, nodes = doc.get("inputs"), graph.get("nodes")
        if not isinstance(inputs, list) or not inputs or not isinstance(nodes, list) or not nodes:
            raise BadRequest("custom loss: inputs and graph.nodes must be non-empty lists")
        if len(nodes) > MAX_NODES:
            raise BadRequest(f"custom loss: {len(nodes)} nodes; at most {MAX_NODES}")
        self.inputs = [(str(i.get("name")), i.get("rank")) for i in inputs if isinstance(i, dict)]
        if len(self.inputs) != len(inputs) or self.inputs[0] != ("logprobs", 1) or any(
                r != 1 or not NAME.fullmatch(n) for n, r in self.inputs):
            raise BadRequest("custom loss: inputs are logprobs then loss_fn_inputs, each of rank 1 ([T], one value "
                             "per token; scalars and [T, K] are not served)")
        self.id, self.doc = "", doc
        self.deadline: float | None = None  # time.monotonic() past which a node is refused (verify --replay's budget)
        self.fns = functions()
        self.nodes: list[tuple[str, str, str, Any, Any]] = []
        seen: set[str] = set()
        placeholders = []
        for i, node in enumerate(nodes):
            if not isinstance(node, dict):
                raise BadRequest(f"custom loss: node {i} is not an object")
            op, name, target = node.get("op"), str(node.get("name", "")), str(node.get("target", ""))
            if not NAME.fullmatch(name) or name in seen:
                raise BadRequest(f"custom loss: node {i} has no unique name")
            args, kwargs = node.get("args", []), node.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict) or "out" in kwargs:
                raise BadRequest(f"custom loss: node {name}: args must be a list and kwargs an object (without out=: "
                                 "a node makes a new value)")
            for a in [*args, *kwargs.values()]:
                _check_arg(a, seen, name, 0)
            if op == "placeholder":
                placeholders.append(target)
            elif op == "call_function" and target not in self.fns:
                raise BadRequest(f"custom loss: node {name} calls {short(repr(target))}, which is not an allowed "
                                 "operation")
            elif op == "call_method" and target not in METHODS:
                raise BadRequest(f"custom loss: node {name} calls method {short(repr(target))}, which is not allowed")
            elif op in ("get_attr", "call_module"):
                raise BadRequest(f"custom loss: node {name} is a {op} ({short(repr(target))}): a custom loss reads "
                                 "only its inputs and calls allowed functions")
            elif op not in ("placeholder", "call_function", "call_method", "output"):
                raise BadRequest(f"custom loss: node {name} has op {short(op)}")
            if op == "output" and i != len(nodes) - 1:
                raise BadRequest(f"custom loss: node {name} is an output before the last node")
            seen.add(name)
            self.nodes.append((op, name, target, args, kwargs))
        if placeholders != [n for n, _r in self.inputs]:
            raise BadRequest(f"custom loss: the graph takes {placeholders}, the inputs declare "
                             f"{[n for n, _r in self.inputs]}")
        if self.nodes[-1][0] != "output":
            raise BadRequest("custom loss: the graph has no output node")
        self.metric_names = _check_output(self.nodes[-1][3])

    def __call__(self, logprobs: Any, *inputs: Any) -> tuple[Any, dict[str, Any]]:
        """The loss of one datum, node by node, each node's work bounded before it runs (module docstring).

        Raises:
            BadRequest: a node would pass a bound, or fails (its reason), or the output is not (a scalar loss that
                depends on ``logprobs`` when it trains, {metric: scalar}).
        """
        import torch

        env: dict[str, Any] = {}
        values = iter([logprobs, *inputs])
        budget = [max(MIN_ELEMENTS, ELEMENTS_PER_TOKEN * int(logprobs.numel()))]  # elements the loss may still make
        for op, name, target, args, kwargs in self.nodes:
            if op == "placeholder":
                env[name] = next(values)
                continue
            a = [_decode(x, env) for x in args]
            kw = {k: _decode(v, env) for k, v in kwargs.items()}
            if op == "output":
                return self._output(a[0], logprobs)
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise BadRequest(f"custom loss {self.name}: node {name} comes past the op's time budget")
            try:
                if op == "call_function":
                    before(target, a, kw, budget, name)
                    env[name] = self.fns[target](*a, **kw)
                else:
                    obj, *rest = a
                    if not isinstance(obj, torch.Tensor):
                        raise BadRequest(f"node {name} calls {target}() on something that is not a tensor")
                    before(target, a, kw, budget, name)
                    env[name] = getattr(obj, target)(*rest, **kw)
                after(env[name], budget, name)
            except ApiError as exc:
                raise BadRequest(f"custom loss {self.name}: {str(exc).removeprefix('custom loss: ')}") from None
            except torch.OutOfMemoryError:  # the device's allocator: the pass's, not this loss's (app.api.engine.packed)
                raise
            except Exception as exc:  # an allowed operation that fails on these values: the loss's own mistake
                raise BadRequest(f"custom loss {self.name}: node {name} ({target}) failed: {type(exc).__name__}: "
                                 f"{short(str(exc), 300)}") from None
        raise BadRequest("custom loss: the graph has no output node")

    def _output(self, out: Any, logprobs: Any) -> tuple[Any, dict[str, Any]]:
        import torch

        loss, metrics = out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise BadRequest(f"custom loss {self.name}: the loss must be a scalar tensor")
        if logprobs.requires_grad and not loss.requires_grad:
            raise BadRequest(f"custom loss {self.name}: the loss does not depend on logprobs (it has no gradient to "
                             "train with)")
        for k, v in metrics.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not (number or isinstance(v, torch.Tensor) and v.numel() == 1):
                raise BadRequest(f"custom loss {self.name}: metric {k} must be a scalar (a number or a one-element "
                                 "tensor)")
        return loss, metrics


def _check_arg(a: Any, seen: set[str], node: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BadRequest(f"custom loss: node {node}: arguments nested more than {MAX_DEPTH} levels")
    if a is None or isinstance(a, (bool, int, float, str)):
        if isinstance(a, float) and not math.isfinite(a):
            raise BadRequest(f"custom loss: node {node}: a non-finite number must be encoded as {{\"float\": …}}")
        check_scalar(a, f"node {node}: a constant")
        return
    if isinstance(a, list):
        if len(a) > MAX_LIST:
            raise BadRequest(f"custom loss: node {node}: a list of more than {MAX_LIST} items")
        for x in a:
            _check_arg(x, seen, node, depth + 1)
        return
    if not isinstance(a, dict) or len(a) != 1:
        raise BadRequest(f"custom loss: node {node}: an argument is not in the SDK's encoding")
    (kind, value), = a.items()
    if kind == "ref":
        if not isinstance(value, str) or value not in seen:
            raise BadRequest(f"custom loss: node {node} refers to {short(value)}, not an earlier node")
    elif kind in ("tuple", "slice"):
        if not isinstance(value, list):
            raise BadRequest(f"custom loss: node {node}: {kind} must be a list")
        _check_arg(value, seen, node, depth + 1)
    elif kind == "dict":
        if not isinstance(value, dict) or len(value) > MAX_LIST:
            raise BadRequest(f"custom loss: node {node}: dict must be an object of at most {MAX_LIST} members")
        _check_arg(list(value.values()), seen, node, depth + 1)
    elif kind == "float":
        if value not in ("inf", "-inf", "nan"):
            raise BadRequest(f"custom loss: node {node}: float {short(value)}")
    elif kind == "dtype":
        if value not in _DTYPES:
            raise BadRequest(f"custom loss: node {node}: dtype {short(value)} is not allowed")
    elif kind == "device":
        if not isinstance(value, str) or value != "cpu" and not re.fullmatch(r"cuda(:[0-9]{1,2})?", value):
            raise BadRequest(f"custom loss: node {node}: device {short(value)}")
    elif kind not in ("ellipsis", "layout", "memory_format"):
        raise BadRequest(f"custom loss: node {node}: argument kind {short(kind)} is not in the SDK's encoding")


def _decode(a: Any, env: dict[str, Any]) -> Any:
    if isinstance(a, list):
        return [_decode(x, env) for x in a]
    if not isinstance(a, dict):
        return a
    (kind, value), = a.items()
    if kind == "ref":
        return env[value]
    if kind == "tuple":
        return tuple(_decode(x, env) for x in value)
    if kind == "dict":
        return {k: _decode(v, env) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_decode(x, env) for x in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(value)
    import torch

    if kind == "dtype":
        return getattr(torch, value)
    if kind == "device":
        return torch.device(value)
    if kind == "layout":
        return torch.strided
    return torch.contiguous_format


def _check_output(args: Any) -> tuple[str, ...]:
    out = args[0] if isinstance(args, list) and len(args) == 1 else None
    pair = out.get("tuple") if isinstance(out, dict) else out
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict) and "ref" in pair[0]
            and isinstance(pair[1], dict) and isinstance(pair[1].get("dict"), dict)):
        raise BadRequest("custom loss: the graph must return (loss, {metric: tensor})")
    names = tuple(pair[1]["dict"])
    bad = [k for k in names if not METRIC.fullmatch(k)]
    if bad:
        raise BadRequest(f"custom loss: metric {bad[0]!r} must be named custom/<name>:sum or custom/<name>:mean")
    return names


def create(req: Any, held: dict[str, Loss]) -> Loss:
    """The loss of a ``CreateCustomLossRequest``, rebuilt and kept in ``held`` (the session's) under its id.

    Raises:
        BadRequest: not rebuildable (see :class:`Loss`), or not encodable as JSON.
    """
    inputs, graph = [i.model_dump(mode="json") for i in req.inputs], req.graph.model_dump(mode="json")
    try:
        loss_id, doc = canonical(req.name, inputs, graph)
    except ValueError as exc:  # NaN or infinity outside the SDK's {"float": …} encoding
        raise BadRequest(f"custom loss: not encodable as JSON: {exc}") from None
    loss = Loss(doc)
    loss.id = loss_id
    held[loss_id] = loss
    return loss


def lookup(held: dict[str, Loss], session: str, op: Any) -> Loss:
    """The session's loss a ``custom`` forward_backward names, its inputs present in every datum.

    Raises:
        BadRequest: no such loss in the session, or a datum without an input the loss takes.
    """
    loss = held.get(str((op.loss_fn_config or {}).get("loss_id")))
    if loss is None:
        raise BadRequest(f"custom loss {(op.loss_fn_config or {}).get('loss_id')!r} was not created in session "
                         f"{session}: create it with ServiceClient.create_custom_loss")
    for i, d in enumerate(op.data):
        missing = [n for n, _rank in loss.inputs[1:] if n not in d.inputs]
        if missing:
            raise BadRequest(f"data[{i}]: custom loss {loss.name} takes loss_fn_inputs.{missing[0]}")
    return loss
