"""GPU training benchmark: the HF backend (transformers + PEFT + TRL) against Unsloth, same shape, data and settings.

    python bench/gpu_train.py [--backends hf,unsloth] [--batches 4,8] [--seq 2048] [--steps 40] [--warmup 10]
                              [--grad-ckpt auto|on|off|unsloth] [--out bench/results]
    python bench/gpu_train.py --dry-run --out DIR     # tiny shape on the CPU: exercises every code path in ~20 s

Shape: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256, tied
embeddings; 1.236 B parameters), random init, built locally (nothing downloaded), bf16. Data: random
token ids, every row exactly ``--seq`` tokens (no padding). LoRA r=16, alpha 16, dropout 0 on all
seven linear projections. One optimizer step = one micro-batch of ``batch`` rows (no accumulation).
Both backends go through cvm-tune's own loading and trainer code (``app.training.backend``), with the
app's defaults for the GPU (bf16, gradient checkpointing: HF non-reentrant, Unsloth offloaded).

Each (backend, batch) runs in its own subprocess: Unsloth patches transformers/TRL/PEFT process-wide,
and a fresh process gives a clean peak-memory reading.

Measured per run, steady state = the steps after ``--warmup``:
  tokens/s      batch x seq x steady steps / their wall time (``torch.cuda.synchronize`` at each step end)
  peak memory   ``torch.cuda.max_memory_allocated`` over the whole worker (weights included), GiB
  MFU           tokens/s x FLOPs per token / peak dense bf16 FLOP/s of the GPU (table below)
                * 6N: N = parameters of the base model, tied embedding counted once (= the LM-head
                  matmul; the embedding lookup does no matmul), LoRA parameters not counted. 6N is the
                  usual 2N forward + 4N backward; for LoRA with activation checkpointing it is also what
                  runs: 2N forward + 2N recomputed forward + 2N input gradients (no gradients for
                  frozen weights).
                * 6N + attention: adds 12 x layers x hidden x seq per token (QK^T and AV, forward and
                  backward, causal mask not discounted), as in PaLM's appendix B.
  first step    seconds from ``trainer.train()`` start to the end of step 1 (Unsloth compiles here)
  load          seconds to load the model and attach LoRA

Output: ``<out>/gpu-train-<gpu>-<date>.json`` and ``.md`` (dry run: ``gpu-train-dry-run.*``) with the GPU
name, its CC mode (``app.run.gpu`` evidence), the imported library versions of each backend, and the
Unsloth/HF ratios at each batch size against the targets (>= 1.8x tokens/s and <= 0.6x peak memory at
batch 8; MFU >= 45% at 6N).

Offline on the GPU machine (bundle from shared/gpu/make-bundle.sh, carried as .gpu/site.tgz):
    mkdir -p /tmp/site && tar xzf .gpu/site.tgz -C /tmp/site
    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 python3 bench/gpu_train.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCHEMA = "cvm-tune/bench-gpu-train/v1"
LLAMA_3_2_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
TINY = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True}
# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's datasheets.
PEAK_BF16 = (("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("H800", 989.4e12),
             ("B200", 2250e12), ("A100", 312e12))
TARGETS = {"tokens_per_s_ratio_min": 1.8, "peak_memory_ratio_max": 0.6, "mfu_6n_min": 0.45, "at_batch": 8}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- model ---------------------------------------------------------------------------------------------------


def build_model(out: Path, shape: dict[str, Any], *, cuda: bool) -> None:
    """Random-init Llama of ``shape`` + the tiny model's tokenizer into ``out`` (bf16 safetensors)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from app.training import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="cvm-tune-tok-") as tmp:
        build_tiny_model(Path(tmp) / "tiny")
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "tiny", local_files_only=True)
        out.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(out)
        shutil.rmtree(Path(tmp) / "tiny")
    cfg = LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def flops_per_token(params: int, shape: dict[str, Any], seq: int) -> dict[str, float]:
    """``{"6n": 6N, "6n_attn": 6N + 12 * layers * hidden * seq}`` (see the module docstring)."""
    six_n = 6.0 * params
    return {"6n": six_n, "6n_attn": six_n + 12.0 * shape["num_hidden_layers"] * shape["hidden_size"] * seq}


def peak_flops(gpu_name: str | None) -> float | None:
    """Dense bf16 peak of a known GPU (first matching name fragment), else None."""
    for fragment, value in PEAK_BF16:
        if gpu_name and fragment.lower() in gpu_name.lower():
            return value
    return None


# --- one measurement (worker subprocess) --------------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps of one backend at one batch size; return the measurement."""
    from app.config import LoraSettings, TrainingSettings
    from app.errors import CvmTuneError
    from app.training import TrainRequest
    from app.training.options import check_triton_toolchain, imported_versions, library_names

    out: dict[str, Any] = {"backend": args.backend, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                           "warmup": args.warmup, "status": "ok"}
    settings = TrainingSettings(
        backend=args.backend, max_steps=args.steps, per_device_batch_size=args.batch, gradient_accumulation_steps=1,
        learning_rate=1e-4, max_length=args.seq, save_steps=args.steps + 1, logging_steps=1,
        lora=LoraSettings(r=16, alpha=16, dropout=0.0, target_modules=LORA_TARGETS),
        gpu={"gradient_checkpointing": args.grad_ckpt})
    try:
        from app.training import backend as B

        backend = B.prepare_backend(settings)  # Unsloth before trl/transformers/peft, as in the app
        import torch
        from datasets import Dataset

        from app.training.batch import BatchPlan

        cuda = torch.cuda.is_available()
        B.check_options(backend, settings, cuda=cuda)
        check_triton_toolchain(cuda=cuda)
        with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-run-") as run_dir:
            req = TrainRequest(base_model_dir=Path(args.model), base_model_name="bench/llama-shape", rows=[],
                               run_dir=Path(run_dir), settings=settings, fingerprint="0" * 64)
            t = time.perf_counter()
            model, tok, peft_config = (B._load_unsloth if backend == "unsloth" else B._load_hf)(req, cuda)
            out["load_s"] = round(time.perf_counter() - t, 3)
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            out["params"] = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, base.config.vocab_size, (args.steps * args.batch, args.seq), generator=g)
            data = Dataset.from_dict({"input_ids": ids.tolist()})
            sealing = {"key": os.urandom(32), "inputs": {"fingerprint": req.fingerprint}, "root": Path(run_dir) / "checkpoints"}
            trainer = B._make_trainer(req, model, tok, peft_config, data, None, Path(run_dir) / "scratch", cuda=cuda,
                                      backend=backend, plan=BatchPlan(args.batch, 1, args.batch), world=1, sealing=sealing)
            out["optimizer"] = str(getattr(trainer.args.optim, "value", trainer.args.optim))  # the same for both backends
            times: list[float] = []
            trainer.add_callback(_timer(times, cuda))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            seen = int(trainer.state.num_input_tokens_seen or 0)
        steady = [b - a for a, b in zip(times[args.warmup:], times[args.warmup + 1:], strict=False)]
        tokens_per_step = args.batch * args.seq
        out.update(
            device=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            time_to_first_step_s=round(times[1] - times[0], 3),
            step_time_s_median=round(statistics.median(steady), 4),
            tokens_per_s=round(tokens_per_step * len(steady) / sum(steady), 1),
            tokens_seen=seen, tokens_expected=tokens_per_step * args.steps,
            peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
            peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else None,
            peak_rss_gib=round(_max_rss_bytes() / 2**30, 3),
            loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
            libraries=imported_versions(library_names(backend)))
    except CvmTuneError as exc:
        out.update(status="skipped", error=exc.message)
    except Exception as exc:  # a measurement that failed is reported, not hidden
        out.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400])
    return out


def _timer(times: list[float], cuda: bool) -> Any:
    from transformers import TrainerCallback

    class _Timer(TrainerCallback):  # type: ignore[misc]
        def _mark(self) -> None:
            if cuda:
                import torch

                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            self._mark()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self._mark()

    return _Timer()


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the run (parent) ------------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]], *, shape: dict[str, Any], seq: int, gpu_name: str | None) -> dict[str, Any]:
    """Add MFU to each result and the Unsloth/HF ratios per batch size (pure; unit-tested)."""
    peak = peak_flops(gpu_name)
    for r in results:
        if r["status"] == "ok":
            f = flops_per_token(r["params"], shape, seq)
            r["mfu_6n"] = round(r["tokens_per_s"] * f["6n"] / peak, 4) if peak else None
            r["mfu_6n_attn"] = round(r["tokens_per_s"] * f["6n_attn"] / peak, 4) if peak else None
    ratios: dict[str, dict[str, float | None]] = {}
    for batch in sorted({r["batch"] for r in results}):
        by = {r["backend"]: r for r in results if r["batch"] == batch and r["status"] == "ok"}
        if "hf" in by and "unsloth" in by:
            hf, us = by["hf"], by["unsloth"]
            ratios[str(batch)] = {
                "tokens_per_s": round(us["tokens_per_s"] / hf["tokens_per_s"], 3),
                "peak_memory": (round(us["peak_allocated_gib"] / hf["peak_allocated_gib"], 3)
                                if us.get("peak_allocated_gib") and hf.get("peak_allocated_gib") else None)}
    return {"peak_bf16_flops": peak, "ratios": ratios}


def markdown(doc: dict[str, Any]) -> str:
    """The results table (bench/results/*.md)."""
    optimizers = sorted({r["optimizer"] for r in doc["results"] if r.get("optimizer")})
    lines = [f"# GPU training benchmark ({'DRY RUN: tiny shape on the CPU, not a measurement' if doc['dry_run'] else doc['date']})",
             "", f"GPU: {doc['gpu']['name'] or 'none'} x{doc['gpu']['count']}; CC mode {doc['gpu']['cc_mode']}; "
             f"driver {doc['gpu']['driver'] or 'n/a'}. Shape: {doc['shape_name']} ({doc['params'] or '?'} parameters), "
             f"seq {doc['seq']}, LoRA r=16 on all linear layers, {doc['steps']} steps, steady state after {doc['warmup']}.",
             f"Optimizer (as the trainer resolved it): {', '.join(optimizers) or 'n/a'}.",
             f"MFU: tokens/s x FLOPs per token / {doc['summary']['peak_bf16_flops'] or 'unknown'} FLOP/s (dense bf16); "
             "6N with N = base parameters (tied embedding once), 6N+attn adds 12 x layers x hidden x seq.", "",
             "| backend | batch | tokens/s | step s (median) | peak alloc GiB | MFU 6N | MFU 6N+attn | first step s | load s | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(v: Any, pct: bool = False) -> str:
        return "n/a" if v is None else (f"{v:.1%}" if pct else str(v))

    for r in doc["results"]:
        lines.append(f"| {r['backend']} | {r['batch']} | {cell(r.get('tokens_per_s'))} | {cell(r.get('step_time_s_median'))} | "
                     f"{cell(r.get('peak_allocated_gib'))} | {cell(r.get('mfu_6n'), True)} | {cell(r.get('mfu_6n_attn'), True)} | "
                     f"{cell(r.get('time_to_first_step_s'))} | {cell(r.get('load_s'))} | {r['status']}"
                     + (f": {r['error']}" if r.get("error") else "") + " |")
    lines.append("")
    for batch, ratio in doc["summary"]["ratios"].items():
        lines.append(f"Batch {batch}: Unsloth / HF tokens/s = {ratio['tokens_per_s']}x, peak memory = {cell(ratio['peak_memory'])}x.")
    t = TARGETS
    lines += ["", f"Targets (batch {t['at_batch']}): tokens/s >= {t['tokens_per_s_ratio_min']}x, peak memory <= "
              f"{t['peak_memory_ratio_max']}x, MFU (6N) >= {t['mfu_6n_min']:.0%}.", "", "Libraries (as imported):"]
    for r in doc["results"]:
        if r.get("libraries"):
            lines.append(f"- {r['backend']} (batch {r['batch']}): " + ", ".join(f"{k} {v}" for k, v in sorted(r["libraries"].items())))
    return "\n".join(lines) + "\n"


def _gpu_context() -> dict[str, Any]:
    from app.run.gpu import collect

    info = collect("0" * 64, attest_timeout_s=1).info
    return {"name": info.devices[0].name if info.devices else None, "count": len(info.devices),
            "driver": info.devices[0].driver_version if info.devices else None, "cc_mode": info.cc_mode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="hf,unsloth")
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--grad-ckpt", choices=("auto", "on", "off", "unsloth"), default="auto")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU, few steps: checks the script, measures nothing")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (backend, batch) worker")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.seq, args.steps, args.warmup = min(args.seq, 32), min(args.steps, 5), min(args.warmup, 1)
        if args.batches == "4,8":
            args.batches = "2"
    shape = TINY if args.dry_run else LLAMA_3_2_1B
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU run even on a GPU machine
    if args.build_model:
        import torch

        build_model(args.build_model, shape, cuda=torch.cuda.is_available() and not args.dry_run)
        return 0
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    gpu = _gpu_context() if not args.dry_run else {"name": None, "count": 0, "driver": None, "cc_mode": "n/a"}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        build = [sys.executable, __file__, "--build-model", str(model_dir)] + (["--dry-run"] if args.dry_run else [])
        subprocess.run(build, check=True, env=env, timeout=args.timeout)
        for batch in [int(b) for b in args.batches.split(",")]:
            for backend in args.backends.split(","):
                cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--batch", str(batch), "--model",
                       str(model_dir), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--grad-ckpt", args.grad_ckpt]
                print(f"bench: {backend} batch {batch} ...", file=sys.stderr, flush=True)
                results.append(_run_worker(cmd, env, args.timeout, backend, batch))
                r = results[-1]
                print(f"bench: {backend} batch {batch}: {r['status']} {r.get('tokens_per_s', '')} tok/s "
                      f"{r.get('peak_allocated_gib', '')} GiB {r.get('error', '')}", file=sys.stderr, flush=True)
    params = next((r["params"] for r in results if r["status"] == "ok"), None)
    gpu_name = next((r["device"] for r in results if r["status"] == "ok" and not args.dry_run), gpu["name"])
    doc = {"schema": SCHEMA, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "dry_run": args.dry_run,
           "gpu": {**gpu, "name": gpu_name}, "shape_name": "tiny (dry run)" if args.dry_run else "Llama-3.2-1B, random init",
           "shape": shape, "params": params, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
           "grad_ckpt": args.grad_ckpt, "lora": {"r": 16, "alpha": 16, "targets": list(LORA_TARGETS)},
           "flop_formula": "6N per token (N = base parameters, tied embedding once); also 6N + 12*layers*hidden*seq",
           "targets": TARGETS, "results": results}
    doc["summary"] = summarize(results, shape=shape, seq=args.seq, gpu_name=gpu_name)
    slug = "dry-run" if args.dry_run else f"{re.sub(r'[^a-z0-9]+', '-', (gpu_name or 'cpu').lower()).strip('-')}-{doc['date'][:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu-train-{slug}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / f"gpu-train-{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


def _run_worker(cmd: list[str], env: dict[str, str], timeout: int, backend: str, batch: int) -> dict[str, Any]:
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "batch": batch, "status": "error", "error": f"timed out after {timeout} s"}
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        return json.loads(last)
    except ValueError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"backend": backend, "batch": batch, "status": "error", "error": f"worker exit {proc.returncode}: {tail[:300]}"}


if __name__ == "__main__":
    raise SystemExit(main())
