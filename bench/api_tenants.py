"""Many tenants on one server: N training clients (each its own process, its own API key's session and LoRA model,
the unmodified tinker SDK) running small steps at once, against one client alone and against the same steps run one
after another in-process on the same engine.

    python bench/api_tenants.py [--tenants 4] [--steps 40] [--tokens 32] [--batch 1] [--backend hf]
                                [--base embedded|tiny|llama-1b] [--out FILE]

A step is ``forward_backward`` (B datums of T tokens, cross-entropy) + ``optim_step``, submitted back to back and
waited for, as the SDK's loops do. Prints aggregate steps/s for 1 and N tenants, their ratio (goal on the 2-core CPU
with the tiny model, 4 tenants of 1x32 tokens: >= 1.5), the ratio to the in-process sequential steps, and the
server's batching counters (how many operations ran in a shared base-model pass). Packed passes need the
transformers + PEFT backend (``--backend hf``, the default here; on a GPU the server's own default is Unsloth).

``--base``: the base model the server trains on. ``embedded`` (default) is the server's own tiny model; ``tiny`` and
``llama-1b`` are random-init models of bench/gpu_train.py's shapes built here, bf16 on a GPU (``llama-1b``: the
Llama-3.2-1B shape, what the GPU part of bench/gpu-checks.sh measures: on the tiny model a GPU step is all launch
overhead, and packing has no matrix work to share).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from api_overhead import BASE, KEY, _server, _server_threads  # bench/: the script directory is on sys.path
from gpu_train import LLAMA_3_2_1B, TINY, build_model
from timing import write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _tenant(url: str, base: str, steps: int, batch: int, tokens: int, seed: int, start: "mp.synchronize.Barrier",
            out: "mp.Queue[tuple[float, float, float]]") -> None:
    import tinker
    from tinker import types

    toks = [(7 * i + 13 * seed) % 700 + 3 for i in range(tokens + 1)]
    datums = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                          loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * tokens})
              for _ in range(batch)]
    adam = types.AdamParams(learning_rate=1e-4)
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=seed).result()
    for _ in range(3):  # warm-up
        tc.forward_backward(datums, "cross_entropy").result()
        tc.optim_step(adam).result()
    start.wait()
    t0, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()
    out.put((t0, time.perf_counter(), time.process_time() - cpu))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _round(url: str, base: str, server: int, n: int, steps: int, batch: int, tokens: int) -> dict[str, float]:
    """Aggregate steps/s of ``n`` tenants running ``steps`` steps each at once (first start to last end), and the
    CPU milliseconds a step took in the clients and in the server."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n + 1), ctx.Queue()  # this process passes it too: the server's CPU from then
    procs = [ctx.Process(target=_tenant, args=(url, base, steps, batch, tokens, i, start, out)) for i in range(n)]
    for p in procs:
        p.start()
    start.wait(900)
    cpu = _cpu_s(server)
    spans = [out.get(timeout=900) for _ in procs]
    cpu = _cpu_s(server) - cpu
    for p in procs:
        p.join(60)
    wall = max(e for _s, e, _c in spans) - min(s for s, _e, _c in spans)
    return {"steps_s": n * steps / wall, "client_cpu_ms_step": 1000 * sum(c for _s, _e, c in spans) / (n * steps),
            "server_cpu_ms_step": 1000 * cpu / (n * steps)}


def _in_process(base_dir: Path, n: int, steps: int, batch: int, tokens: int) -> float:
    """Steps/s of the same n x steps run one after another on an engine in this process (1 torch thread, as the
    server's engine on this machine)."""
    import numpy as np
    import torch

    from app.api import wire
    from app.api.engine.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(base_dir)
    lora = {"rank": 8, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
    toks = [(7 * i) % 700 + 3 for i in range(tokens + 1)]
    models = [engine.create(f"t{i}", lora) for i in range(n)]
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    def op(m):  # noqa: ANN001, ANN202
        return wire.Op(m.id, "cross_entropy", False, [wire.Datum(toks[:-1], {
            "target_tokens": np.asarray(toks[1:], dtype="int64"), "weights": np.ones(tokens, dtype="float32")})
            for _ in range(batch)])
    ops = [op(m) for m in models]
    for o, m in zip(ops, models):  # warm-up
        engine.forward_backward(o)
        engine.optim_step(m.id, adam)
    t = time.perf_counter()
    for _ in range(steps):
        for o, m in zip(ops, models):
            engine.forward_backward(o)
            engine.optim_step(m.id, adam)
    return n * steps / (time.perf_counter() - t)


SHAPES = {"embedded": None, "tiny": TINY, "llama-1b": LLAMA_3_2_1B}


def _base(tmp: Path, name: str) -> tuple[Path, str, str]:
    """(model directory, base model name, config YAML) of ``--base name``; the embedded model is built by the server."""
    if SHAPES[name] is None:
        return tmp / "out" / "models" / "tiny-llama", BASE, ""
    import torch

    path = tmp / "base"
    build_model(path, SHAPES[name], cuda=torch.cuda.is_available())
    hub_id = f"bench/{name}"
    return path, hub_id, f"base_model:\n  source: local-dir\n  path: {path}\n  hub_id: {hub_id}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="alternate 1 and N tenants this many times")
    ap.add_argument("--backend", choices=("auto", "hf", "unsloth"), default="hf", help="the server's api.backend")
    ap.add_argument("--base", choices=sorted(SHAPES), default="embedded", help="the base model (see above)")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="api-tenants-") as d:
        tmp = Path(d)
        base_dir, base, config = _base(tmp, args.base)
        proc, url = _server(tmp, f"api:\n  backend: {args.backend}\n{config}")
        try:
            one, many = [], []
            for _ in range(args.repeats):  # alternating, so the machine's load hits both
                one.append(_round(url, base, proc.pid, 1, args.steps, args.batch, args.tokens))
                many.append(_round(url, base, proc.pid, args.tenants, args.steps, args.batch, args.tokens))
            seq = _in_process(base_dir, args.tenants, args.steps, args.batch, args.tokens)
            threads = _server_threads(tmp)
        finally:
            proc.terminate()
            proc.wait(30)
        log = (tmp / "serve.log").read_text()
    batched = [x for x in log.splitlines() if x.startswith("engine batching:")]
    import statistics

    best_one = max(one, key=lambda r: r["steps_s"])
    best_many = max(many, key=lambda r: r["steps_s"])
    med_one = statistics.median(r["steps_s"] for r in one)
    med_many = statistics.median(r["steps_s"] for r in many)
    result = {"machine": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "server_threads": threads, "base": args.base, "tenants": args.tenants, "steps_per_tenant": args.steps,
              "batch": args.batch, "tokens": args.tokens, "one_tenant": one, "tenants_runs": many,
              "in_process_sequential_steps_s": seq, "ratio_tenants_over_one": best_many["steps_s"] / best_one["steps_s"],
              "ratio_tenants_over_in_process": best_many["steps_s"] / seq,
              "median_ratio_tenants_over_one": med_many / med_one,
              "tenants_tokens_s": best_many["steps_s"] * args.batch * args.tokens,
              "sequential_tokens_s": seq * args.batch * args.tokens,
              "server_batching": batched[-1] if batched else None}
    print(f"server torch threads: {threads}; {args.batch}x{args.tokens} tokens a step, {args.steps} steps a tenant")
    print(f"1 tenant: {best_one['steps_s']:.1f} steps/s; {args.tenants} tenants: {best_many['steps_s']:.1f} steps/s in "
          f"all; ratio {result['ratio_tenants_over_one']:.2f} (goal >= 1.5 for 4 x 1x32 on the tiny CPU model)")
    print(f"  medians of {args.repeats} alternating runs: 1 tenant {med_one:.1f}, {args.tenants} tenants {med_many:.1f} "
          f"steps/s; ratio {med_many / med_one:.2f}")
    for label, r in (("1 tenant", best_one), (f"{args.tenants} tenants", best_many)):
        print(f"  CPU a step, {label}: clients {r['client_cpu_ms_step']:.1f} ms, server {r['server_cpu_ms_step']:.1f} ms")
    print(f"in-process, one after another: {seq:.1f} steps/s; {args.tenants} tenants through the API / that: "
          f"{result['ratio_tenants_over_in_process']:.2f} (aggregate tokens/s {result['tenants_tokens_s']:.0f} vs "
          f"{result['sequential_tokens_s']:.0f}; GPU goal >= 2 with 8 tenants)")
    if batched:
        print(batched[-1])
    write_json(result, args.out)


if __name__ == "__main__":
    main()
