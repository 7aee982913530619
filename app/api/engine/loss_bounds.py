"""The bounds of a server-side custom loss's work (:mod:`app.api.engine.custom_loss`), checked node by node before each
node computes, so that no node of any graph takes more than a bounded time or memory (one Python operation on huge
numbers holds the interpreter, and every request with it; docs/api.md "What a custom loss may compute"):

* a Python integer is at most :data:`MAX_INT_BITS` bits (constants and every result); ``pow`` of integers is refused
  before it computes when its result would be larger;
* a string is at most :data:`MAX_STR` characters and never an operand of arithmetic (``"a" * n``, ``"%d" % n``);
* a tuple or list has at most :data:`MAX_LIST` items (``shape + (1,)`` is fine, ``(x,) * 10**9`` not);
* the tensors a loss makes hold together at most :data:`ELEMENTS_PER_TOKEN` elements per token of the datum (at
  least :data:`MIN_ELEMENTS`): each node's result size is computed from its operands' shapes (broadcast, ``cat`` and
  ``stack`` summed, advanced indexing on storage-less tensors) and refused before it is allocated.
"""

from __future__ import annotations

import math
from typing import Any

from app.api.errors import BadRequest

MAX_LIST = 64  # items of a list in the document, and of a tuple or list a node makes
MAX_INT_BITS = 64  # a Python integer of a loss: |n| < 2**63 (an index, a dimension, a count: what int64 holds)
MAX_STR = 256  # characters of a string argument (a name: "sum", a dtype)
ELEMENTS_PER_TOKEN = 256  # what the tensors a loss makes hold together, per token of its datum (256 nodes of [T])
MIN_ELEMENTS = 1 << 16  # ... and at least this many (a [256, 256] product for a short datum)
_ARITHMETIC = frozenset(f"operator.{n}" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos",
                                                  "pow", "and_", "or_", "invert"))


def short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def check_scalar(v: Any, what: str) -> None:
    """A Python value of a loss within its bounds (module docstring).

    Raises:
        BadRequest: an integer of more than :data:`MAX_INT_BITS` bits, a string of more than :data:`MAX_STR`
            characters, a tuple or list of more than :data:`MAX_LIST` items.
    """
    if isinstance(v, int) and v.bit_length() >= MAX_INT_BITS:
        raise BadRequest(f"custom loss: {what} is an integer of {v.bit_length()} bits; at most {MAX_INT_BITS - 1} "
                         "(a loss computes on tensors)")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise BadRequest(f"custom loss: {what} is a string of {len(v)} characters; at most {MAX_STR}")
    if isinstance(v, (tuple, list)) and len(v) > MAX_LIST:
        raise BadRequest(f"custom loss: {what} is a sequence of {len(v)} items; at most {MAX_LIST}")


def _tensors(values: Any) -> list[Any]:
    """The tensors among ``values`` (nested in tuples, lists and dicts), in order."""
    import torch

    out: list[Any] = []
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return out


def before(target: str, a: list[Any], kw: dict[str, Any], budget: list[int], node: str) -> None:
    """Refuse node ``node`` (``target`` of ``a``, ``kw``) before it runs when its result would pass a bound.

    Raises:
        BadRequest: arithmetic on a string, ``pow`` of integers past :data:`MAX_INT_BITS` bits, a sequence past
            :data:`MAX_LIST` items, or tensors past the loss's element budget.
    """
    import torch

    if target in _ARITHMETIC:
        if any(isinstance(x, (str, bytes)) for x in a):
            raise BadRequest(f"node {node}: {target} of a string (a loss computes on tensors)")
        if target == "operator.pow" and len(a) == 2 and all(isinstance(x, int) for x in a):
            base, exp = a
            if exp > 0 and abs(base) > 1 and (abs(base).bit_length() - 1) * exp + 1 > MAX_INT_BITS:  # its fewest bits
                raise BadRequest(f"node {node}: {short(base)} ** {exp} is an integer of more than {MAX_INT_BITS} "
                                 "bits (a loss computes on tensors)")
        if target == "operator.mul" and len(a) == 2:
            for seq, n in (a, a[::-1]):
                if isinstance(seq, (tuple, list)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_LIST:
                    raise BadRequest(f"node {node}: a sequence of {len(seq)} items repeated {n} times; at most "
                                     f"{MAX_LIST} items")
        if target == "operator.add" and len(a) == 2 and all(isinstance(x, (tuple, list)) for x in a) \
                and len(a[0]) + len(a[1]) > MAX_LIST:
            raise BadRequest(f"node {node}: a sequence of {len(a[0]) + len(a[1])} items; at most {MAX_LIST}")
    tensors = _tensors([a, kw])
    if not tensors:
        return
    if target in ("torch.cat", "torch.stack"):
        size = sum(t.numel() for t in tensors)
    elif target == "operator.getitem" and len(a) == 2 and isinstance(a[0], torch.Tensor):
        size = _indexed(a[0], a[1])  # a list or tensor index gathers: its size, not the tensor's
    else:
        try:
            size = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
        except RuntimeError:  # not elementwise (gather, reshape, ...): no larger than its largest operand
            size = max(t.numel() for t in tensors)
    if size > budget[0]:
        raise BadRequest(f"node {node}: a tensor of {size} elements; this loss may make {budget[0]} more (its "
                         f"tensors hold at most {ELEMENTS_PER_TOKEN} elements per token, at least {MIN_ELEMENTS})")


def _indexed(x: Any, index: Any) -> int:
    """The elements of ``x[index]`` (advanced indexing), from shapes alone: the same indexing of storage-less
    tensors; a boolean mask (a size that depends on its values) at most ``x``'s elements per integer index."""
    import torch

    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, (tuple, list)):
            return type(v)(meta(i) for i in v)
        return v

    try:
        return int(meta(x)[meta(index)].numel())
    except Exception:  # data-dependent (a mask), or an index the real call refuses too
        lists = [len(i) for i in (index if isinstance(index, tuple) else (index,)) if isinstance(i, list)]
        return x.numel() * math.prod(lists) * math.prod(max(t.numel(), 1) for t in _tensors([index])
                                                        if t.dtype != torch.bool)


def after(value: Any, budget: list[int], node: str) -> None:
    """Count what node ``node`` made against the budget; its Python values within their bounds.

    Raises:
        BadRequest: past a bound (an integer product of two large integers, say).
    """
    import torch

    items = value if isinstance(value, (tuple, list)) else (value,)
    check_scalar(value, f"node {node}'s result")
    for v in items:
        if isinstance(v, torch.Tensor):
            budget[0] -= v.numel()
        else:
            check_scalar(v, f"node {node}'s result")
    if budget[0] < 0:
        raise BadRequest(f"node {node}: the loss's tensors pass {ELEMENTS_PER_TOKEN} elements per token")
