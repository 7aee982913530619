"""What differential privacy costs on the tiny demo model: held-out loss and training throughput, DP off vs on.

    python bench/dp_utility.py [--steps 30] [--out bench/results/dp-utility.json]

Trains the tiny Llama-shaped model on the bundled sample (duplicates dropped, a seeded 20% held out) three times in
one process: DP off, DP-SGD at epsilon 8 and at epsilon 1 (noise derived by Opacus for the same steps; clipping 1.0,
rdp accountant). Reports each run's mean held-out loss (per-example mean token loss) and trainer tokens/s, and
the ratios against the DP-off run measured in the same process. Warm-up runs (off and DP) first take the imports;
then the variants train ``--repeats`` times, interleaved (throughput: the best run; held-out loss: the mean over
runs, each listed). Shared machines are noisy: read the load average and the per-run figures before trusting a
throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
from pathlib import Path
from typing import Any

from app.config import PrivacySettings, TrainingSettings
from app.training import TrainRequest, build_tiny_model, train
from app.training.privacy import per_example_loss, plan

SAMPLE = Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl"


def _rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    seen, rows = set(), []
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        key = json.dumps(json.loads(line), sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(json.loads(line))
    random.Random(0).shuffle(rows)
    cut = len(rows) // 5
    return rows[cut:], rows[:cut]


def _eval_loss(base: Path, adapter: Path, rows: list[dict[str, Any]], max_length: int) -> float:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()
    texts = [r["text"] + tok.eos_token if "text" in r else tok.apply_chat_template(r["messages"], tokenize=False)
             for r in rows]
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length)
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    with torch.no_grad():
        return float(per_example_loss(model, {**batch, "labels": labels}).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="training runs per variant; tokens/s is the best")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    train_rows, eval_rows = _rows()
    base_settings = TrainingSettings(max_steps=args.steps, per_device_batch_size=4, gradient_accumulation_steps=2,
                                     max_length=64, save_steps=args.steps)
    variants: dict[str, TrainingSettings] = {"off": base_settings}
    for eps in (8.0, 1.0):
        variants[f"dp-eps{eps:g}"] = base_settings.model_copy(
            update={"privacy": PrivacySettings(mode="dp-sgd", target_epsilon=eps, max_grad_norm=1.0)})
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cvm-tune-dp-bench-") as tmp:
        base = Path(tmp) / "tiny-llama"
        build_tiny_model(base)

        def run(name: str, s: TrainingSettings, i: int) -> Any:
            return train(TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=train_rows,
                                      run_dir=Path(tmp) / f"{name}-{i}", settings=s, fingerprint="ab" * 32,
                                      privacy=plan(s, rows=len(train_rows))))

        run("warm-up-off", base_settings, 0)  # imports, first-call kernels
        run("warm-up-dp", variants["dp-eps8"], 0)
        load_before = os.getloadavg()[0]
        results: dict[str, list[Any]] = {name: [] for name in variants}
        for i in range(args.repeats):  # interleaved: a load change on the shared machine hits every variant alike
            for name, s in variants.items():
                results[name].append(run(name, s, i))
        for name, rs in results.items():
            losses = [_eval_loss(base, r.adapter_dir, eval_rows, base_settings.max_length) for r in rs]
            tps = [(r.tokens_seen or 0) / r.train_runtime_s for r in rs]
            dp = rs[0].privacy
            runs[name] = {
                "eval_loss": round(sum(losses) / len(losses), 4),
                "eval_loss_each": [round(x, 4) for x in losses],
                "final_train_loss": round(sum(r.losses[-1][1] for r in rs) / len(rs), 4),
                "tokens_per_s": round(max(tps), 1),
                "tokens_per_s_each": [round(x, 1) for x in tps],
                "train_runtime_s": round(min(r.train_runtime_s for r in rs), 3),
                "epsilon": None if dp is None else round(dp["epsilon"], 4),
                "delta": None if dp is None else dp["delta"],
                "noise_multiplier": None if dp is None else round(dp["noise_multiplier"], 4),
            }
    off = runs["off"]
    for r in runs.values():
        r["eval_loss_ratio_vs_off"] = round(r["eval_loss"] / off["eval_loss"], 4)
        r["tokens_per_s_ratio_vs_off"] = round(r["tokens_per_s"] / off["tokens_per_s"], 4)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "steps": args.steps, "train_rows": len(train_rows), "eval_rows": len(eval_rows), "effective_batch": 8,
        "sample_rate": round(8 / len(train_rows), 5), "runs": runs,
        "repeats": args.repeats,
        "note": "tiny random-init model: losses show the noise's cost, not a real model's; tokens/s is the trainer's "
                "(non-padding tokens / train_runtime), DP includes per-example gradients, clipping, noise, accounting",
    }
    text = json.dumps(report, indent=2) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
