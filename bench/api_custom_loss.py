"""A server-side custom loss costs no more than the same built-in loss: ``forward_backward`` steps of the training
API's engine on the tiny model, cross_entropy against the custom loss ``-(logprobs * weights).sum()`` (the same
value), interleaved in one run. Prints the time per step of each and their ratio (goal: custom <= 1.10 x built-in).

    python bench/api_custom_loss.py [--steps N] [--datums D] [--tokens T] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def neg_ll(logprobs, weights):  # noqa: ANN001, ANN201
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def main() -> int:
    import numpy as np
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from app.api import wire
    from app.api.engine.custom_loss import Loss, canonical
    from app.api.engine.engine import Engine
    from app.training import build_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--datums", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args()
    handle = trace_loss(neg_ll, {"logprobs": 1, "weights": 1}, "bench")
    inputs = [i.model_dump(mode="json") for i in handle.inputs]
    loss_id, doc = canonical(handle.name, inputs, encode_graph(handle).model_dump(mode="json"))
    custom = Loss(doc)
    custom.id = loss_id
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "tiny"
        build_tiny_model(base)
        engine = Engine(base)
        try:
            engine.create("m", {"rank": 8, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": False})
            data = [wire.Datum(rng.integers(1, 200, args.tokens).tolist(),
                               {"target_tokens": rng.integers(1, 200, args.tokens).astype(np.int64),
                                "weights": np.ones(args.tokens, np.float32)}) for _ in range(args.datums)]
            times = {"builtin": [], "custom": []}
            for step in range(args.steps + 2):  # one model, the two losses in alternating order: same work, no bias
                for name in (("builtin", "custom") if step % 2 else ("custom", "builtin")):
                    op = wire.Op("m", "cross_entropy" if name == "builtin" else "custom", False, data,
                                 None if name == "builtin" else {"loss_id": loss_id})
                    if name == "custom":
                        op.extra["custom"] = custom
                    t0 = time.perf_counter()
                    engine.forward_backward(op)
                    if step >= 2:  # the first two are warm-up
                        times[name].append(time.perf_counter() - t0)
                    engine.models["m"].pending = 0
            b, c = (float(np.median(times[k])) for k in ("builtin", "custom"))
        finally:
            engine.stop()
    if args.out is not None:
        import json
        import os

        args.out.write_text(json.dumps({"steps": args.steps, "datums": args.datums, "tokens": args.tokens,
                                        "builtin_ms": b * 1000, "custom_ms": c * 1000, "ratio": c / b,
                                        "load_average": os.getloadavg()[0]}, indent=2) + "\n")
    print(f"forward_backward, {args.datums} x {args.tokens} tokens, median of {args.steps}: built-in cross_entropy "
          f"{b * 1000:.1f} ms, custom loss {c * 1000:.1f} ms, ratio {c / b:.3f} (goal <= 1.10)")
    return 0 if c / b <= 1.10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
