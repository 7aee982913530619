"""Training rows of the CPU benchmark (tiny model, CPU): the project's run next to its bound, measured in one run.

    python bench/train_perf.py [--steps 30] [--repeat 3] [--out bench/results/train-perf.json]

Rows (median of ``--repeat`` interleaved passes):

* **tokens/s, whole training step of a run** (both at ``--threads`` torch threads): the token policy (``tokenize_rows``) + ``backend.train`` (model load,
  TRL's preparation of the policy's token ids, training, a sealed checkpoint every ``save_steps``, adapter export)
  / a bare ``SFTTrainer`` on the same rows with the same arguments and the same saves (plain, unsealed), which
  tokenizes the rows itself. Tokens are the non-padding tokens trained on (equal in both: checked).
* **dataset preparation, 2,400 rows**: the token policy + handing its ids to TRL / TRL tokenizing the same rows
  itself (the least a run that counts tokens before training can do: one tokenization); the previous revision's
  path (policy, then TRL tokenizing the rows again) is measured alongside.
* **report/loss.png**: rendering it (warm, 30 losses) / the same figure laid out with ``tight_layout`` (the
  previous revision), interleaved; the one-off ``import matplotlib`` of a fresh process is printed alongside.
* **ms per optimizer step vs torch threads**: ``training.cpu_threads: auto`` (what it resolves to here) / 1 thread,
  same run, interleaved; > 1 means auto is slower on this machine at this load.

Also importable: :func:`train_rows` is what ``bench/cpu_perf.py`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from timing import write_json  # bench/timing.py: the script directory is on sys.path

HERE = Path(__file__).resolve().parents[1]
KEY = bytes(range(32))


def _rows(n: int) -> list[dict[str, Any]]:
    sample = [json.loads(line) for line in (HERE / "app" / "data" / "sample.jsonl").read_text().splitlines() if line]
    return [sample[i % len(sample)] for i in range(n)]


def _settings(steps: int, **kw: Any) -> Any:
    from app.config import TrainingSettings

    return TrainingSettings(max_steps=steps, save_steps=max(1, steps // 3), backend="hf", **kw)


def _project(base: Path, run_dir: Path, rows: list[dict[str, Any]], settings: Any) -> tuple[float, int, float]:
    """(wall s, tokens trained, trainer.train s) of the token policy + backend.train."""
    from app.training import TrainRequest
    from app.training.backend import train
    from app.training.tokens import tokenize_rows

    t = time.perf_counter()
    kept, ids, _ = tokenize_rows(rows, base_model_dir=base, max_length=settings.max_length,
                                 assistant_only_loss=settings.assistant_only_loss, too_long="truncate")
    res = train(TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=kept, run_dir=run_dir,
                             settings=settings, fingerprint="ab" * 32, checkpoint_key=KEY, tokenized=ids))
    return time.perf_counter() - t, int(res.tokens_seen or 0), res.train_runtime_s


def _bare(base: Path, out: Path, rows: list[dict[str, Any]], settings: Any) -> tuple[float, int]:
    """(wall s, tokens trained) of a plain SFTTrainer: load, LoRA, TRL tokenizes, train with plain saves, save."""
    import transformers
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from app.training.options import OPTIMIZER_ARGS
    from app.training.sft_data import build_dataset

    t = time.perf_counter()
    transformers.set_seed(settings.seed)
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    lora = settings.lora
    peft = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
                      task_type="CAUSAL_LM", bias="none")
    args = SFTConfig(output_dir=str(out), max_steps=settings.max_steps, learning_rate=settings.learning_rate,
                     lr_scheduler_type="constant", logging_steps=settings.logging_steps, save_strategy="steps",
                     save_steps=settings.save_steps, save_total_limit=3, max_length=settings.max_length,
                     per_device_train_batch_size=settings.per_device_batch_size,
                     gradient_accumulation_steps=settings.gradient_accumulation_steps, report_to="none",
                     seed=settings.seed, data_seed=settings.seed, dataloader_num_workers=0, disable_tqdm=True,
                     use_cpu=True, include_num_input_tokens_seen="non_padding", gradient_checkpointing=False,
                     dataloader_pin_memory=False, **OPTIMIZER_ARGS)  # as the project's run on a CPU
    trainer = SFTTrainer(model=model, args=args, processing_class=tok, peft_config=peft,
                         train_dataset=build_dataset(rows, tok, assistant_only_loss=settings.assistant_only_loss))
    trainer.train()
    trainer.save_model(str(out / "adapter"))
    return time.perf_counter() - t, int(trainer.state.num_input_tokens_seen)


def _prep(base: Path, rows: list[dict[str, Any]], settings: Any, *, mode: str) -> float:
    """Seconds from rows to a constructed SFTTrainer (its dataset prepared). ``mode``: ``handed`` (policy, then TRL
    on its ids), ``trl`` (TRL tokenizes the rows), ``twice`` (policy, then TRL tokenizes the rows again: the
    previous revision). The model and tokenizer are loaded before the clock starts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from app.training.sft_data import sft_dataset
    from app.training.tokens import tokenize_rows

    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_length=settings.max_length, report_to="none", use_cpu=True)
        t = time.perf_counter()
        kept, ids = rows, None
        if mode != "trl":
            kept, ids, _ = tokenize_rows(rows, base_model_dir=base, max_length=settings.max_length,
                                         assistant_only_loss=False, too_long="truncate")
        data = sft_dataset(kept, ids if mode == "handed" else None, tok, assistant_only_loss=False, backend="hf")
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        elapsed = time.perf_counter() - t
    if len(trainer.train_dataset) != len(rows):
        raise SystemExit("the prepared dataset lost rows")
    return elapsed


def png_row(n: int = 30) -> dict[str, Any]:
    """The loss.png row (module docstring)."""
    import subprocess

    from app.export.report import loss_png

    losses = [[i, 3.0 / i] for i in range(1, 31)]

    def tight() -> bytes:  # the previous revision's layout: one extra draw to measure the labels
        import io

        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 3.5), dpi=100)
        ax = fig.add_subplot()
        ax.plot([s for s, _ in losses], [v for _, v in losses], marker=".")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_title("r: training loss")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
        return buf.getvalue()

    loss_png(losses, title="r")
    tight()
    now, before = [], []
    for _ in range(n):
        t = time.perf_counter()
        loss_png(losses, title="r")
        now.append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        tight()
        before.append(1000 * (time.perf_counter() - t))
    code = ("import time, numpy; t = time.perf_counter(); import matplotlib; matplotlib.use('Agg'); "
            "from matplotlib.figure import Figure; print(1000 * (time.perf_counter() - t))")
    imports = [float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
               for _ in range(5)]
    return {"row": "report/loss.png render (fixed margins vs tight_layout)", "unit": "ms", "project": _stats(now),
            "bound": _stats(before), "ratio": round(statistics.median(now) / statistics.median(before), 3),
            "import_matplotlib_ms": _stats(imports)}


def _stats(v: list[float], nd: int = 1) -> dict[str, float]:
    return {"min": round(min(v), nd), "median": round(statistics.median(v), nd), "n": len(v)}


def train_rows(steps: int = 30, repeat: int = 3, threads: int = 1) -> list[dict[str, Any]]:
    """The rows described in the module docstring; ``threads``: torch threads of the tokens/s row (both sides)."""
    import torch

    from app.training import build_tiny_model, set_offline_env
    from app.training.threads import resolve

    set_offline_env()
    import datasets

    datasets.disable_progress_bars()
    threads_before = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-train-") as tmp:
        base = Path(tmp) / "tiny"
        build_tiny_model(base)
        rows, settings = _rows(240), _settings(steps, cpu_threads=threads)
        mine: list[float] = []
        bare: list[float] = []
        tokens: set[int] = set()
        for i in range(repeat + 1):  # the first pass warms imports and caches: dropped
            wall, n, _ = _project(base, Path(tmp) / f"p{i}", rows, settings)
            torch.set_num_threads(threads)  # the same as the project's run
            wall_bare, n_bare = _bare(base, Path(tmp) / f"b{i}", rows, settings)
            tokens |= {n, n_bare}
            if i:
                mine.append(n / wall)
                bare.append(n_bare / wall_bare)
        if len(tokens) != 1:
            raise SystemExit(f"the project and bare SFTTrainer trained on different token counts: {sorted(tokens)}")
        big = _rows(2400)
        prep: dict[str, list[float]] = {"handed": [], "trl": [], "twice": []}
        for _ in range(repeat + 1):
            for mode, samples in prep.items():
                samples.append(1000 * _prep(base, big, settings, mode=mode))
        auto = resolve("auto")
        step_ms: dict[Any, list[float]] = {"auto": [], 1: []}
        for i in range(repeat + 1):
            for setting in ("auto", 1):
                _, _, train_s = _project(base, Path(tmp) / f"t{setting}{i}", rows, _settings(steps, cpu_threads=setting))
                if i:
                    step_ms[setting].append(1000 * train_s / steps)
        torch.set_num_threads(threads_before)

    def row(name: str, p: dict[str, float], b: dict[str, float], unit: str, **extra: Any) -> dict[str, Any]:
        return {"row": name, "unit": unit, "project": p, "bound": b, "ratio": round(p["median"] / b["median"], 3),
                **extra}

    return [
        row(f"training tokens/s, tiny model, {steps} steps (run vs bare SFTTrainer)", _stats(mine, 0), _stats(bare, 0),
            "tokens/s", tokens=tokens.pop(), torch_threads=threads),
        row("dataset preparation, 2400 rows (policy + TRL vs TRL alone)", _stats(prep["handed"][1:]),
            _stats(prep["trl"][1:]), "ms", previous_revision=_stats(prep["twice"][1:])),
        row(f"ms per optimizer step, cpu_threads auto ({auto['threads']}) vs 1", _stats(step_ms["auto"]),
            _stats(step_ms[1]), "ms", auto=auto),
        png_row(),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the tokens/s row (default 1)")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = os.getloadavg()[0]
    rows = train_rows(args.steps, args.repeat, args.threads)
    for r in rows:
        p, b = r["project"], r["bound"]
        print(f"{r['row']:66} {p['min']:>9} / {p['median']:<9} {b['min']:>9} / {b['median']:<9} {r['unit']:8} "
              f"ratio {r['ratio']:.3f}")
    report = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_average_before_after": [round(load, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    print(f"load average before/after {report['load_average_before_after']}")
    write_json(report, args.out)


if __name__ == "__main__":
    main()
