"""One base-model pass for many models' data: the datums of several forward_backward ops (each op one model's, each
model its own LoRA adapter) packed into one row of tokens, every LoRA layer adding each segment's own adapter to
its rows, attention computed per segment.

Every row-wise part of the model (embeddings, norms, the base model's linear layers, the unembedding) runs once on
all the rows; what is not row-wise stays per datum, exactly as for a datum alone: the LoRA product of a segment's
rows (so an adapter's gradient sums the same products) and attention (a segment's tokens attend only to its own
earlier tokens, with sdpa at the segment's own length). A datum's logits and an op's gradient are therefore the
same whether its op ran alone or packed with other models' ops, which is what lets ``verify --replay`` re-run one
client's ops alone and reach the server's weights bit for bit on a CPU (tests/test_api_batching.py checks it).
Row-wise means the same bits for a row whatever the other rows: a CPU's matrix kernels give that only from some
number of rows on (:func:`rows_min`; fewer rows take other kernels), so a pass of fewer tokens, alone or packed, is
padded to it with rows that no adapter, loss or other segment sees.

Available with the transformers + PEFT backend when the base uses sdpa attention and every LoRA layer is a linear
one (:func:`install`); elsewhere the engine runs one datum at a time, as before.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

NAME = "cvm_packed"  # the attention implementation registered with transformers
_pass = threading.local()  # the segment bounds of the packed pass in progress, on the engine's thread


def install(model: Any) -> bool:
    """Route the model's attention through :func:`_attention` (plain sdpa outside a packed pass); True when packed
    passes are possible for it."""
    from peft.tuners.lora.layer import Linear, LoraLayer
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or "sdpa" not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    if any(isinstance(m, LoraLayer) and not isinstance(m, Linear) for m in model.modules()):
        return False
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    config._attn_implementation = NAME
    return True


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = getattr(_pass, "bounds", None)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sizes = [b - a for a, b in bounds]  # split, not sliced: one backward node, not a full-size gradient per segment
    outs = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0] for q, k, v in
            zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))]
    return torch.cat(outs, dim=1), None


def _mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    if getattr(_pass, "bounds", None) is not None:
        return None  # each segment is causal on its own (_attention); no mask across the packed row
    return sdpa_mask(*args, **kwargs)


def _routed_forward(layer: Any, segments: list[tuple[str, int, int]], x: Any, *args: Any, dim: int = 1,
                    **kwargs: Any) -> Any:
    """A LoRA linear layer's forward in a packed pass: the base layer on every row, each segment's adapter on its
    own rows (a segment whose adapter does not target this layer gets the base alone). The adapter's two linear
    maps are called as ``F.linear`` on their weights, which is what their modules' forward does, without the
    module call's overhead (a packed pass makes a few of these a segment and layer). Segments run along ``dim``:
    the packed row's tokens (1), or a decode batch's sequences (0)."""
    import torch
    from torch.nn import Identity
    from torch.nn.functional import linear

    result = layer.base_layer(x, *args, **kwargs)
    dtype = result.dtype
    sizes = [b - a for _adapter, a, b in segments]  # split, not sliced: one backward node for all segments
    out = []
    for (adapter, _a, _b), rows, base in zip(segments, x.split(sizes, dim=dim), result.split(sizes, dim=dim)):
        if adapter not in layer.lora_A:
            out.append(base)
            continue
        lora_a, lora_b, dropout = layer.lora_A[adapter], layer.lora_B[adapter], layer.lora_dropout[adapter]
        rows = rows.to(lora_a.weight.dtype)
        if not isinstance(dropout, Identity):
            rows = dropout(rows)
        delta = linear(linear(rows, lora_a.weight, lora_a.bias), lora_b.weight, lora_b.bias)
        out.append(base + (delta * layer.scaling[adapter]).to(dtype))
    return torch.cat(out, dim=dim)


@contextlib.contextmanager
def routed(layers: list[Any], segments: list[tuple[str, int, int]]) -> Iterator[None]:
    """Within: the LoRA ``layers`` (every one of the model's) and attention follow ``segments`` ((adapter, first
    row, end row), covering the packed row in order). A decode batch's sequences go through :class:`RowRouter`."""
    for layer in layers:
        layer.forward = functools.partial(_routed_forward, layer, segments)
    _pass.bounds = [(a, b) for _adapter, a, b in segments]
    try:
        yield
    finally:
        _pass.bounds = None
        for layer in layers:
            del layer.forward


class RowRouter:
    """A decode batch's sequences each through its own adapter, every LoRA layer adding all of them in two products
    whatever the number of adapters (:func:`_rows_forward`): ``route(segments)`` ((adapter, first row, end row)
    along dim 0) is entered around each forward. The stacked weights are built once per set of segments, so one
    router serves one decode (the adapters' weights do not change during it). For inference only (no dropout;
    a layer with a LoRA bias takes :func:`routed`'s path); a row's bits may differ from a pass alone, so a draw that
    must reproduce exactly decodes alone."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self._plans: dict[tuple[tuple[str, int], ...], list[Any]] = {}

    @contextlib.contextmanager
    def route(self, segments: list[tuple[str, int, int]]) -> Iterator[None]:
        key = tuple((name, b - a) for name, a, b in segments)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = [self._plan(layer, segments) for layer in self.layers]
        for layer, forward in zip(self.layers, plan, strict=True):
            layer.forward = forward
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    @staticmethod
    def _plan(layer: Any, segments: list[tuple[str, int, int]]) -> Any:
        import torch

        names = [name for name, *_ in segments]
        if any(n in layer.lora_A and (layer.lora_A[n].bias is not None or layer.lora_B[n].bias is not None)
               for n in names):
            return functools.partial(_routed_forward, layer, segments, dim=0)
        present = [(i, n) for i, n in enumerate(names) if n in layer.lora_A]
        if not present:
            return layer.base_layer
        a = torch.cat([layer.lora_A[n].weight for _i, n in present])  # (sum of ranks, in)
        b = torch.cat([layer.lora_B[n].weight for _i, n in present], dim=1)  # (out, sum of ranks)
        scale = a.new_zeros(len(segments), a.shape[0])  # a segment -> its adapter's columns, scaled
        col = 0
        for i, n in present:
            rank = layer.lora_A[n].weight.shape[0]
            scale[i, col:col + rank] = layer.scaling[n]
            col += rank
        sizes = torch.tensor([end - first for _name, first, end in segments], device=scale.device)
        return functools.partial(_rows_forward, layer, a, b, scale.repeat_interleave(sizes, dim=0))


def _rows_forward(layer: Any, a: Any, b: Any, rows: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The base layer on every row, plus ``((x @ A.T) * rows) @ B.T``: A and B every adapter's, stacked along the
    rank, and ``rows`` each row's own adapter's scaling on its columns (zero on the others')."""
    from torch.nn.functional import linear

    result = layer.base_layer(x, *args, **kwargs)
    mask = rows if x.dim() == 2 else rows.view(rows.shape[0], *([1] * (x.dim() - 2)), rows.shape[1])
    delta = linear(linear(x.to(a.dtype), a) * mask, b)
    return result + delta.to(result.dtype)


def lora_layers(model: Any) -> list[Any]:
    """The model's LoRA layers, which a packed pass routes."""
    from peft.tuners.lora.layer import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def pack_bytes(tokens: int, vocab: int) -> int:
    """What a packed pass's logits take (float32): a pass stays under :data:`PASS_BYTES`."""
    return 4 * tokens * vocab


PASS_BYTES = 1 << 30  # an op whose own logits would pass this runs one datum at a time, alone (so always alike)


@functools.lru_cache(maxsize=None)
def rows_min(threads: int, width: int = 256, most: int = 128) -> int | None:
    """The fewest rows from which this CPU's matrix kernels, with ``threads`` torch threads, give each row of a
    linear map (forward, ``x @ W.T``, and backward, ``g @ W``) the same bits whatever the number of rows and the
    row's place among them: every count from it to ``most`` is checked against one product of ``2 * most`` rows
    (measured on x86-64: 4 rows with one thread, 12 with two). None: not even ``most`` rows (packed passes could
    not be bit-identical to ops alone). ``threads`` is torch's thread count, already set: it keys the cache."""
    import torch
    from torch.nn.functional import linear

    assert threads == torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(width, width, generator=g), torch.randn(2 * most, width, generator=g)
    forward, backward = linear(x, w), x @ w
    for rows in range(most, 0, -1):
        for start in (0, 1, 5):
            part = x[start:start + rows]
            if not (torch.equal(linear(part, w), forward[start:start + rows])
                    and torch.equal(part @ w, backward[start:start + rows])):
                return None if rows == most else rows + 1
    return 1


def pad_rows(device: str) -> int | None:
    """The rows a pass on ``device`` is padded to (:func:`rows_min` with torch's threads on a CPU; 1 elsewhere, where
    no replay is bit-exact); None: packed passes could not be bit-identical to ops alone here."""
    import torch

    return rows_min(torch.get_num_threads()) if device == "cpu" else 1


def token_bytes(model: Any) -> int:
    """About what one token of a packed pass holds until its backward, for the pass budget (:func:`budget`): its
    logits and their log-softmax in float32 (what the loss reads), and what each decoder layer keeps for the
    backward, about ``10 * hidden_size + 4 * intermediate_size`` elements at the model's element size (the inputs of
    its norms, projections and attention, and its MLP's gate, up, activation and product)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    inner = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    size = model.get_input_embeddings().weight.element_size()
    return 8 * int(text.vocab_size) + int(text.num_hidden_layers) * size * (10 * hidden + 4 * inner)


def budget(free: int | None) -> int:
    """What one packed pass may hold (in :func:`token_bytes` terms): half the memory free once the base model is
    loaded (the GPU's, or the system's available memory), or :data:`PASS_BYTES` when that is unknown. A pass that
    runs out of memory all the same lowers it (:func:`out_of_memory`)."""
    return free // 2 if free else PASS_BYTES


def out_of_memory(exc: BaseException, device: str) -> bool:
    """Whether ``exc``, raised by a packed pass itself (its base-model forward or its backward: an operation's own
    failure, a custom loss's included, fails that operation alone inside :func:`forward_backward`), is the allocator
    running out of memory: the device's (``torch.OutOfMemoryError``), the CPU allocator's (a ``RuntimeError`` that
    says it cannot allocate) or Python's. The device's cache is then emptied."""
    import torch

    cpu = isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    if not (cpu or isinstance(exc, (MemoryError, torch.OutOfMemoryError))):
        return False
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return True


def forward_backward(engine: Any, items: list[tuple[Any, Any]]) -> list[Any]:
    """The ops ``items`` ((op, its model), at most one op a model, none with DP-SGD) in one packed pass: each op's
    ``(outputs, metrics)``, or the exception that refused it (a loss that is not finite, a custom loss that fails);
    a refused op changes nothing. The ops that train get their gradient from one backward pass over the sum of
    their losses, and are linked into their models' op chains.

    Raises:
        Exception: the pass itself failed (every training op's gradient is as before).
    """
    import math

    import torch

    from app.api.engine import losses
    from app.api.errors import ApiError, BadRequest
    from app.api.engine.history import applied, link

    refused: dict[int, Exception] = {}
    heads = {}
    for op, m in items:  # an op with no canonical record is refused alone, before the pass
        if not op.forward_only:
            try:
                heads[id(op)] = link(m.op_head, op.record())
            except ApiError as exc:
                refused[id(op)] = exc
    asked, items = items, [(op, m) for op, m in items if id(op) not in refused]
    segments, tokens, positions, spans = [], [], [], []
    for op, m in items:
        first = len(segments)
        for d in op.data:
            segments.append((m.adapter, len(tokens), len(tokens) + len(d.tokens)))
            tokens += d.tokens
            positions += range(len(d.tokens))
        spans.append((first, len(segments)))
    if len(tokens) < engine.pad_rows:  # filler rows: no adapter, loss or other segment sees them (rows_min)
        pad = engine.pad_rows - len(tokens)
        segments.append(("", len(tokens), engine.pad_rows))
        tokens += [0] * pad
        positions += range(pad)
    training = [(op, m) for op, m in items if not op.forward_only]
    snapshots = {id(op): engine._grad_snapshot(m) for op, m in training}
    engine._mode(bool(training))
    for op, m in items:
        for p in engine._params(m.adapter):
            p.requires_grad_(not op.forward_only)
    results: list[Any] = []
    kept = []
    if not items:
        return [refused[id(op)] for op, _m in asked]
    try:
        device = engine.device
        with torch.set_grad_enabled(bool(training)), routed(engine.lora_layers(), segments):
            logits = engine.net(input_ids=torch.tensor([tokens], device=device),
                                position_ids=torch.tensor([positions], device=device)).logits[0]
            rows = logits.split([b - a for _adapter, a, b in segments])  # one backward node for all datums
        for (op, _m), (first, end) in zip(items, spans):
            try:
                extra: dict[str, float] = {}
                outputs, parts, weight = [], [], 0.0
                for d, datum_logits in zip(op.data, rows[first:end]):
                    logp, datum_weight, output = losses.score(datum_logits, d)
                    parts.append(losses.loss(op.loss_fn, logp, d.inputs, op.loss_fn_config, op.extra.get("custom"),
                                             extra))
                    weight += datum_weight
                    outputs.append(output)
                total = sum(float(x.detach()) for x in parts)
                if not op.forward_only and not math.isfinite(total):
                    raise BadRequest(f"the loss is not finite ({total}); nothing was applied")
            except torch.OutOfMemoryError:  # the device's allocator: the pass's memory, not this op's mistake
                raise
            except Exception as exc:  # this op's own failure (its loss, its inputs): it alone fails, nothing applied
                if out_of_memory(exc, "cpu") and not isinstance(exc, MemoryError):
                    raise  # the CPU allocator: the pass's memory
                results.append(exc)
                continue
            results.append((outputs, losses.op_metrics(total, weight, extra, len(op.data))))
            if not op.forward_only:
                kept += [x for x in parts if x.requires_grad]
        if kept:
            torch.stack(kept).sum().backward()
    except BaseException:
        for op, m in training:
            engine._grad_restore(m, snapshots[id(op)])
        raise
    for (op, m), result in zip(items, results):
        if op.forward_only:
            continue
        if isinstance(result, BaseException):  # its rows shared the pass: zeros may have reached its gradient
            engine._grad_restore(m, snapshots[id(op)])
            continue
        applied(m, op, heads[id(op)], result[1]["loss:sum"])
    done = {id(op): r for (op, _m), r in zip(items, results)}
    return [refused[id(op)] if id(op) in refused else done[id(op)] for op, _m in asked]
