"""Sampling throughput: the API's sampler against transformers' batched ``generate`` on the same model.

    python bench/api_sampling.py [--samples 8] [--tokens 64] [--rounds 7] [--tenants 4]
                                 [--out bench/results/api-sampling-cpu.json]

Parts, each a ratio of tokens a second measured in one run (alternating blocks, medians):

* **in-process**: ``Engine.sample`` (``num_samples`` sequences of ``max_tokens`` tokens, never stopped early) against
  ``model.generate(num_return_sequences=num_samples)`` on the engine's own model, with the same temperature, top-k
  and top-p (goal >= 1.0);
* **through the API**: the unmodified tinker SDK's ``SamplingClient.sample`` against ``cvm-tune api serve`` on
  loopback (simulator, tiny model), against the same ``generate`` (goal >= 0.8);
* **tenants**: ``--tenants`` processes, each with its own key, trained adapter and sampler checkpoint, sampling
  ``--tenant-samples`` x ``--tenant-tokens`` tokens at once, against one of them alone: aggregate tokens a second
  (goal >= 2).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from api_overhead import KEY, _server, _server_threads  # bench/: the script directory is on sys.path
from api_tenants import SHAPES, _base
from timing import write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARAMS = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
PROMPT = [(7 * i) % 700 + 3 for i in range(16)]


def _tenant(url: str, base: str, key: str, samples: int, tokens: int, rounds: int,
            start: "mp.synchronize.Barrier", out: "mp.Queue[tuple[int, float]]") -> None:
    """One tenant: its own key, a LoRA trained one step, saved for the sampler; then ``rounds`` samples after the
    barrier. Puts (tokens sampled, seconds) on ``out``."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=sum(key.encode()) % 1000).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client(name=f"s-{key[-4:]}").result()
    params = types.SamplingParams(max_tokens=tokens, stop=[], **PARAMS)  # no seed, as an RL loop samples
    prompt = types.ModelInput.from_ints(PROMPT)
    sampler.sample(prompt=prompt, num_samples=samples, sampling_params=params).result()  # warm: adapter loaded
    start.wait()
    t = time.perf_counter()
    got = 0
    for _ in range(rounds):
        res = sampler.sample(prompt=prompt, num_samples=samples, sampling_params=params).result()
        got += sum(len(s.tokens) for s in res.sequences)
    out.put((got, time.perf_counter() - t))


def _tenants(url: str, base: str, n: int, samples: int, tokens: int, rounds: int) -> float:
    """Aggregate tokens a second of ``n`` tenants sampling at once."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=_tenant, args=(url, base, f"{KEY}-{i}", samples, tokens, rounds, start, out))
             for i in range(n)]
    for p in procs:
        p.start()
    start.wait()
    t = time.perf_counter()
    done = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t
    for p in procs:
        p.join(60)
    return sum(tok for tok, _ in done) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tenants", type=int, default=4, help="0: skip the tenants part")
    ap.add_argument("--tenant-samples", type=int, default=4)
    ap.add_argument("--tenant-tokens", type=int, default=32)
    ap.add_argument("--tenant-rounds", type=int, default=12)
    ap.add_argument("--base", choices=sorted(SHAPES), default="embedded",
                    help="the base model: the embedded tiny model, or a random-init shape (bench/api_tenants.py)")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()

    import torch
    import tinker
    from tinker import types

    from app.api.engine import sampling
    from app.api.engine.engine import Engine
    from app.training import threads

    keys = ",".join([KEY] + [f"{KEY}-{i}" for i in range(args.tenants)])  # each tenant its own key
    with tempfile.TemporaryDirectory(prefix="api-sampling-") as d:
        tmp = Path(d)
        base_dir, base, config = _base(tmp, args.base)
        proc, url = _server(tmp, f"api:\n  max_sample_tokens: 256\n{config}", keys)
        srv_threads = _server_threads(tmp)
        try:
            cpu = threads.apply("auto")
            engine = Engine(base_dir)
            n, k = args.samples, args.tokens
            stop = sampling.Stop()  # never early: every sequence is k tokens, as generate's min_new_tokens makes it
            ids = torch.tensor([PROMPT], device=engine.device)

            def ours() -> float:
                t = time.perf_counter()
                engine.sample(None, PROMPT, num_samples=n, max_tokens=k, seed=1, stop=stop, prompt_logprobs=False,
                              **PARAMS)
                return n * k / (time.perf_counter() - t)

            def library() -> float:
                t = time.perf_counter()
                with torch.no_grad():
                    out = engine.net.generate(ids, do_sample=True, num_return_sequences=n, max_new_tokens=k,
                                              min_new_tokens=k, pad_token_id=0, **PARAMS)
                assert out.shape == (n, len(PROMPT) + k)
                return n * k / (time.perf_counter() - t)

            sc = tinker.ServiceClient(base_url=url, api_key=KEY)
            sampler = sc.create_sampling_client(base_model=base).result()
            params = types.SamplingParams(max_tokens=k, stop=[], seed=1, **PARAMS)

            def via_api() -> float:
                t = time.perf_counter()
                res = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=n,
                                     sampling_params=params).result()
                assert sum(len(s.tokens) for s in res.sequences) == n * k
                return n * k / (time.perf_counter() - t)

            for f in (ours, library, via_api):  # warm-up
                f()
            got: dict[str, list[float]] = {"ours": [], "generate": [], "api": []}
            for _ in range(args.rounds):
                got["ours"].append(ours())
                got["generate"].append(library())
                got["api"].append(via_api())
            tenants = {}
            if args.tenants:
                one = _tenants(url, base, 1, args.tenant_samples, args.tenant_tokens, args.tenant_rounds)
                many = _tenants(url, base, args.tenants, args.tenant_samples, args.tenant_tokens, args.tenant_rounds)
                tenants = {"tenants": args.tenants, "one_tokens_per_s": one, "many_tokens_per_s": many,
                           "ratio_many_over_one": many / one, "samples": args.tenant_samples,
                           "tokens": args.tenant_tokens}
        finally:
            proc.terminate()
            proc.wait(30)
        batching = next((x for x in (tmp / "serve.log").read_text().splitlines() if x.startswith("engine batching:")),
                        "")
    med = {name: statistics.median(v) for name, v in got.items()}
    result = {
        "machine": platform.platform(), "cpus": os.cpu_count(), "in_process_threads": cpu["threads"],
        "server_threads": srv_threads, "load_average": os.getloadavg(), "base": args.base, "samples": n, "tokens": k,
        "rounds": args.rounds, "params": PARAMS, "tokens_per_s": got, "median_tokens_per_s": med,
        "ratio_in_process_over_generate": med["ours"] / med["generate"],
        "ratio_api_over_generate": med["api"] / med["generate"], **tenants, "server_batching": batching,
    }
    print(f"torch threads: in-process {cpu['threads']}, server {srv_threads}")
    print(f"{n} samples x {k} tokens, tokens/s (median of {args.rounds}): sampler in-process {med['ours']:,.0f}, "
          f"transformers generate {med['generate']:,.0f}, via the API (SDK) {med['api']:,.0f}")
    print(f"ratio in-process / generate {result['ratio_in_process_over_generate']:.2f} (goal >= 1.0); "
          f"API / generate {result['ratio_api_over_generate']:.2f} (goal >= 0.8)")
    if tenants:
        print(f"{args.tenants} tenants sampling {args.tenant_samples} x {args.tenant_tokens} tokens at once: "
              f"{tenants['many_tokens_per_s']:,.0f} tokens/s in all vs {tenants['one_tokens_per_s']:,.0f} alone "
              f"(ratio {tenants['ratio_many_over_one']:.2f}, goal >= 2)")
    print(batching)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
