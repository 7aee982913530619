"""The training API's overhead: forward_backward + optim_step through the API (the unmodified tinker SDK, HTTP on
loopback, the state database, the op chain) vs the same steps in-process (the same engine, called directly).

    python bench/api_overhead.py [--steps N] [--batch B] [--tokens T] [--out bench/results/api-overhead-cpu.json]

Starts ``cvm-tune api serve --plain-http`` (simulator, tiny model) on a free loopback port, runs N steps of B datums
of T tokens each way, alternating blocks so machine noise hits both, and prints: the ratio in-process / API for a
step (goal >= 0.9 on the tiny CPU model), and the future round-trip: a 1-token sample through the API minus the same
sample in-process (submit, queue, database commit, long-poll retrieve, protobuf both ways). Also the same steps
pipelined: five steps submitted back to back before waiting, as a training loop that keeps the server busy does.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from timing import write_json  # bench/timing.py: the script directory is on sys.path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's app, not an installed copy
KEY = "tml-bench"
BASE = "cvm-tune/tiny-llama"


def _server(tmp: Path, config: str = "", keys: str = KEY) -> tuple[subprocess.Popen[bytes], str]:
    """``api serve --plain-http`` on a free loopback port, its output volume in ``tmp`` (``config``: more YAML;
    ``keys``: the API keys it accepts, comma-separated)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp / "api.yaml"
    cfg.write_text(f"output:\n  dir: {tmp / 'out'}\n{config}")
    log = tmp / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "app", "api", "serve", "--plain-http", "--listen",
                             f"127.0.0.1:{port}", "--config", str(cfg)], stdout=open(log, "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, env={**os.environ, "CVM_TUNE_API_KEYS": keys,
                                                           "HF_HUB_OFFLINE": "1",
                                                           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    while b"listening on" not in log.read_bytes():
        if proc.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def _server_threads(tmp: Path) -> str:
    """The server's ``cpu threads: …`` start-up line."""
    line = next((x for x in (tmp / "serve.log").read_text().splitlines() if x.startswith("cpu threads:")), "")
    return line.removeprefix("cpu threads: ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()

    import tinker
    from tinker import types

    from app.api.engine import sampling
    from app.api import wire
    from app.api.engine.engine import Engine

    with tempfile.TemporaryDirectory(prefix="api-bench-") as d:
        tmp = Path(d)
        proc, url = _server(tmp)
        srv_threads = _server_threads(tmp)
        try:
            base_dir = tmp / "out" / "models" / "tiny-llama"
            from app.training import threads

            cpu = threads.apply("auto")  # in-process: torch's threads as a nightly run picks them
            engine = Engine(base_dir)
            toks = [(7 * i) % 700 + 3 for i in range(args.tokens + 1)]
            datums = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                  loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * args.tokens})
                      for _ in range(args.batch)]
            adam = types.AdamParams(learning_rate=1e-4)
            lora = {"rank": 8, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
            local = engine.create("bench", lora)
            op = wire.Op("bench", "cross_entropy", False, [wire.Datum(toks[:-1], {
                "target_tokens": __import__("numpy").asarray(toks[1:], dtype="int64"),
                "weights": __import__("numpy").ones(args.tokens, dtype="float32")}) for _ in range(args.batch)])

            def in_process() -> float:
                t = time.perf_counter()
                engine.forward_backward(op)
                engine.optim_step(local.id, adam.model_dump(mode="json"))
                return time.perf_counter() - t

            sc = tinker.ServiceClient(base_url=url, api_key=KEY)
            tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()

            def via_api() -> float:
                t = time.perf_counter()
                fb = tc.forward_backward(datums, "cross_entropy")
                opt = tc.optim_step(adam)
                fb.result()
                opt.result()
                return time.perf_counter() - t

            def pipelined(k: int = 5) -> float:  # k steps submitted back to back, as a training loop may: per step
                t = time.perf_counter()
                futures = [f for _ in range(k) for f in (tc.forward_backward(datums, "cross_entropy"), tc.optim_step(adam))]
                for f in futures:
                    f.result()
                return (time.perf_counter() - t) / k

            sampler = sc.create_sampling_client(base_model=BASE).result()
            prompt = types.ModelInput.from_ints(toks[:16])
            one = types.SamplingParams(max_tokens=1, temperature=0.0)

            def sample_api() -> float:
                t = time.perf_counter()
                sampler.sample(prompt=prompt, num_samples=1, sampling_params=one).result()
                return time.perf_counter() - t

            def sample_local() -> float:
                t = time.perf_counter()
                engine.sample(None, toks[:16], num_samples=1, max_tokens=1, temperature=0.0, top_k=-1, top_p=1.0,
                              seed=0, stop=sampling.Stop(), prompt_logprobs=False)
                return time.perf_counter() - t

            for f in (in_process, via_api, pipelined, sample_api, sample_local):  # warm-up
                f()
            local_t, api_t, piped_t, s_api, s_local = [], [], [], [], []
            for _ in range(max(1, args.steps // 5)):
                local_t += [in_process() for _ in range(5)]
                api_t += [via_api() for _ in range(5)]
                piped_t.append(pipelined(5))
                s_local += [sample_local() for _ in range(5)]
                s_api += [sample_api() for _ in range(5)]
        finally:
            proc.terminate()
            proc.wait(30)
    med = statistics.median
    result = {
        "machine": platform.platform(), "cpus": os.cpu_count(), "in_process_threads": cpu["threads"],
        "server_threads": srv_threads, "load_average": os.getloadavg(), "steps": len(local_t), "batch": args.batch,
        "tokens_per_datum": args.tokens,
        "step_in_process_s": {"median": med(local_t), "min": min(local_t)},
        "step_via_api_s": {"median": med(api_t), "min": min(api_t)},
        "ratio_in_process_over_api": {"median": med(local_t) / med(api_t), "min": min(local_t) / min(api_t)},
        "step_via_api_pipelined_s": {"median": med(piped_t), "min": min(piped_t)},
        "ratio_in_process_over_api_pipelined": {"median": med(local_t) / med(piped_t)},
        "sample_1_token_in_process_s": med(s_local), "sample_1_token_via_api_s": med(s_api),
        "future_round_trip_overhead_ms": 1000 * (med(s_api) - med(s_local)),
    }
    print(f"torch threads: in-process {cpu['threads']}, server {srv_threads}")
    print(f"step (fwd/bwd {args.batch}x{args.tokens} tokens + Adam): in-process {med(local_t) * 1000:.1f} ms, "
          f"via the API {med(api_t) * 1000:.1f} ms (median of {len(local_t)}); "
          f"ratio {result['ratio_in_process_over_api']['median']:.3f} (goal >= 0.9)")
    print(f"pipelined (5 steps submitted before waiting): via the API {med(piped_t) * 1000:.1f} ms per step; ratio "
          f"{result['ratio_in_process_over_api_pipelined']['median']:.3f}")
    print(f"future round trip (1-token sample, API minus in-process): {result['future_round_trip_overhead_ms']:.1f} ms")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
