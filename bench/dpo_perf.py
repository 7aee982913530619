"""DPO training speed against a bare TRL DPOTrainer, and Parquet loading against JSONL.

    python bench/dpo_perf.py [--steps 30] [--repeats 5] [--rows 20000] [--out bench/results/dpo-perf-cpu.json]

1. **DPO steps/s**: cvm-tune's DPO path (``app.training.train`` with ``training.objective: dpo``: sealed
   checkpoints, loss watchdog, stop hooks) and a bare ``trl.DPOTrainer`` on the same tiny model, rows, seed and
   optimisation settings (LoRA through ``peft_config``, reference = adapter disabled, the same plain saves), in one
   process, alternating, ``--repeats`` times each; steps 2..N per wall second and per CPU second of this process
   (the CPU figure is the one a machine busy with other work distorts least), and the ratios of the medians.
2. **Dataset load**: the same ``--rows`` rows (text and chat, as the bundled sample) encrypted once as JSONL and once
   as Parquet, then decrypted in memory, validated and turned into rows (``parse_jsonl`` vs ``parse_table``);
   median of 5 each.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from timing import write_json  # bench/timing.py: the script directory is on sys.path

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")

REPO = Path(__file__).resolve().parent.parent
SUBJECTS = ["the cat", "a dog", "the river", "my friend", "the city", "a teacher", "the garden", "an engine",
            "the moon", "a song", "the market", "a child", "the sea", "a tree", "the road", "a lamp"]


def _pairs() -> list[dict[str, str]]:
    return [{"prompt": f"Tell me about {s}.", "chosen": f"Sure, {s} is lovely and kind.",
             "rejected": f"No. I refuse to talk about {s}."} for s in SUBJECTS]


def _settings(steps: int, threads: int) -> Any:
    from app.config import TrainingSettings

    return TrainingSettings(objective="dpo", max_steps=steps, per_device_batch_size=4, gradient_accumulation_steps=1,
                            learning_rate=5e-3, max_length=64, save_steps=10, logging_steps=1, cpu_threads=threads)


class _Clock:
    """Wall and CPU (this process) time at the end of step 1 and of the last step: the steps in between, with the
    checkpoints they seal, measured the same way for both trainers (CPU time is what the busy machine distorts least)."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, float, float]] = []

    def step(self, step: int) -> None:
        self.marks.append((step, time.perf_counter(), time.process_time()))

    def rates(self) -> tuple[float, float]:
        (s0, w0, c0), (s1, w1, c1) = self.marks[0], self.marks[-1]
        return (s1 - s0) / (w1 - w0), (s1 - s0) / (c1 - c0)


def cvm_tune_run(base: Path, tmp: Path, steps: int, threads: int) -> tuple[float, float]:
    from app.training import TrainRequest, train

    clock = _Clock()
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    train(TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=_pairs(), run_dir=run_dir,
                       settings=_settings(steps, threads), fingerprint="ab" * 32, checkpoint_key=bytes(32),
                       on_step_end=lambda step: clock.step(step)))
    return clock.rates()


def bare_trl_run(base: Path, tmp: Path, steps: int, threads: int) -> tuple[float, float]:
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import DPOTrainer

    from app.training.dpo import dpo_config
    from app.training.options import OPTIMIZER_ARGS

    s = _settings(steps, threads)
    torch.set_num_threads(threads)
    transformers.set_seed(s.seed)
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
    lora = s.lora
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), task_type="CAUSAL_LM", bias="none")
    args = dpo_config(s, str(Path(tempfile.mkdtemp(dir=tmp))), cuda=False, save_strategy="steps",
                      save_steps=s.save_steps, save_total_limit=3,  # the same saves, plain (cvm-tune seals them)
                      gradient_checkpointing=False,  # as cvm-tune on a CPU (TRL's config default is True)
                      per_device_train_batch_size=s.per_device_batch_size, gradient_accumulation_steps=1,
                      **OPTIMIZER_ARGS)
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=Dataset.from_list(_pairs()),
                         processing_class=tok, peft_config=peft_config)
    clock = _Clock()

    class Tick(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.step(int(state.global_step))

    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.add_callback(Tick())
    trainer.train()
    return clock.rates()


def load_bench(n: int) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.dataset import encrypt_stream, open_encrypted, parse_jsonl
    from app.dataset.tabular import PARQUET, parse_table

    sample = [json.loads(x) for x in (REPO / "app" / "data" / "sample.jsonl").read_text().splitlines() if x.strip()]
    rows = [sample[i % len(sample)] | ({"text": f"{sample[i % len(sample)]['text']} #{i}"}
                                       if "text" in sample[i % len(sample)] else {}) for i in range(n)]
    plain_jsonl = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("messages", message), ("text", pa.string())])), buf)
    plain_parquet = buf.getvalue()
    key = bytes(range(32))
    files = {}
    for name, data, ct in (("jsonl", plain_jsonl, "application/jsonl"), ("parquet", plain_parquet, PARQUET)):
        out = io.BytesIO()
        encrypt_stream(io.BytesIO(data), out, key, dataset_id="bench", content_type=ct)
        files[name] = out.getvalue()

    def load(name: str) -> int:
        stream = open_encrypted(io.BytesIO(files[name]), key, content_type=("application/jsonl", PARQUET))
        if name == "jsonl":
            got, _ = parse_jsonl(stream, source="b", max_row_bytes=1 << 20)
        else:
            got, _ = parse_table(stream, PARQUET, source="b")
        return len(got)

    times: dict[str, list[float]] = {"jsonl": [], "parquet": []}
    for _ in range(5):
        for name in times:
            t = time.perf_counter()
            assert load(name) == n
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": n, "plaintext_bytes": {"jsonl": len(plain_jsonl), "parquet": len(plain_parquet)},
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "rows_per_s": {k: round(n / v) for k, v in med.items()},
            "parquet_over_jsonl_time": round(med["parquet"] / med["jsonl"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both trainers")
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    from app.training import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="cvm-tune-dpo-bench-") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "tiny"
        build_tiny_model(base)
        ours, bare = [], []
        cvm_tune_run(base, tmp, 2, args.threads)  # warm-up: imports, first-call costs
        load_start = os.getloadavg()[0]
        for i in range(args.repeats):  # alternate which goes first
            pair = [cvm_tune_run, bare_trl_run] if i % 2 == 0 else [bare_trl_run, cvm_tune_run]
            for fn in pair:
                (ours if fn is cvm_tune_run else bare).append(fn(base, tmp, args.steps, args.threads))
        load_end = os.getloadavg()[0]

    def summary(runs: list[tuple[float, float]], k: int) -> dict[str, Any]:
        vals = sorted(r[k] for r in runs)
        return {"min": round(vals[0], 3), "median": round(statistics.median(vals), 3), "max": round(vals[-1], 3)}

    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "load_average_1min": [round(load_start, 2), round(load_end, 2)],
        "steps": args.steps, "threads": args.threads, "repeats": args.repeats,
        "steps_per_wall_s": {"cvm_tune": summary(ours, 0), "bare_trl": summary(bare, 0)},
        "steps_per_cpu_s": {"cvm_tune": summary(ours, 1), "bare_trl": summary(bare, 1)},
        "ratio_median_wall": round(statistics.median(r[0] for r in ours) / statistics.median(r[0] for r in bare), 3),
        "ratio_median_cpu": round(statistics.median(r[1] for r in ours) / statistics.median(r[1] for r in bare), 3),
        "note": "steps 2..N of each run (from the end of step 1 to the end of the last); both save a checkpoint every "
                "10 steps (two fall inside that span): cvm-tune seals it (AES-GCM onto the output volume, plaintext "
                "deleted), the bare trainer leaves it plain",
        "load": load_bench(args.rows),
    }
    print(json.dumps(report, indent=2))
    write_json(report, args.out)


if __name__ == "__main__":
    main()
