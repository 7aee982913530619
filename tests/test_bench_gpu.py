"""bench/gpu_train.py cannot rot: its dry run (tiny shape, CPU) runs end to end; its arithmetic is checked.

Run: ``python -m pytest tests/test_bench_gpu.py -q`` (the dry run takes ~30 s: two worker processes).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_train.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_json_and_markdown(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-train-dry-run.json").read_text())
    assert doc["schema"] == "cvm-tune/bench-gpu-train/v1" and doc["dry_run"] is True
    by = {r["backend"]: r for r in doc["results"]}
    hf = by["hf"]
    assert hf["status"] == "ok" and hf["tokens_per_s"] > 0 and hf["step_time_s_median"] > 0
    assert hf["tokens_seen"] == hf["tokens_expected"] == hf["batch"] * hf["seq"] * hf["steps"]  # no padding
    assert hf["time_to_first_step_s"] > 0 and hf["load_s"] > 0 and hf["params"] == doc["params"]
    assert set(hf["libraries"]) >= {"torch", "transformers", "peft", "trl"} and "unsloth" not in hf["libraries"]
    assert hf["optimizer"] == "adamw_torch_fused"  # explicit: Unsloth's SFTConfig would default to 8-bit AdamW
    assert by["unsloth"]["status"] == "skipped" and "CUDA" in by["unsloth"]["error"]  # Unsloth is GPU-only
    md = (tmp_path / "gpu-train-dry-run.md").read_text()
    assert "DRY RUN" in md and "| hf | 2 |" in md and "| backend | batch | tokens/s |" in md
    assert "Optimizer (as the trainer resolved it): adamw_torch_fused." in md


def test_llama_3_2_1b_shape_and_flop_formula() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bench = _bench()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**bench.LLAMA_3_2_1B))
    n = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert n == 1_235_814_400
    f = bench.flops_per_token(n, bench.LLAMA_3_2_1B, 2048)
    assert f["6n"] == 6 * n and f["6n_attn"] == 6 * n + 12 * 16 * 2048 * 2048
    assert bench.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and bench.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert bench.peak_flops(None) is None and bench.peak_flops("Tesla T4") is None


def test_ratios_and_mfu() -> None:
    bench = _bench()
    n = 1_235_814_400
    common = {"status": "ok", "params": n, "seq": 2048}
    results = [{**common, "backend": "hf", "batch": 8, "tokens_per_s": 29115.0, "peak_allocated_gib": 6.34},
               {**common, "backend": "unsloth", "batch": 8, "tokens_per_s": 49967.0, "peak_allocated_gib": 3.98},
               {**common, "backend": "hf", "batch": 4, "tokens_per_s": 26081.0, "peak_allocated_gib": 4.42},
               {"backend": "unsloth", "batch": 4, "status": "error", "error": "x"}]
    s = bench.summarize(results, shape=bench.LLAMA_3_2_1B, seq=2048, gpu_name="NVIDIA H100 80GB HBM3")
    assert s["ratios"] == {"8": {"tokens_per_s": 1.716, "peak_memory": 0.628}}  # no pair at batch 4
    assert results[1]["mfu_6n"] == pytest.approx(49967 * 6 * n / 989.4e12, abs=1e-4)
    assert results[1]["mfu_6n_attn"] > results[1]["mfu_6n"]
    doc = {"dry_run": False, "date": "2026-11-23T00:00:00Z", "gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 1,
           "driver": "580.159.03", "cc_mode": "off"}, "shape_name": "Llama-3.2-1B", "params": n, "seq": 2048, "steps": 40,
           "warmup": 10, "summary": s, "results": results}
    md = bench.markdown(doc)
    assert "Batch 8: Unsloth / HF tokens/s = 1.716x, peak memory = 0.628x." in md and "| unsloth | 4 | n/a" in md
