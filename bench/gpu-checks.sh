#!/usr/bin/env bash
# gpu-checks.sh: the GPU checks on the offline GPU machine, each part within its own time limit, every log and result
# file in OUT: the training benchmark (bench/gpu_train.py: HF vs Unsloth), `pytest -m gpu`, and the training API's
# overhead on the GPU (bench/api_overhead.py). A device command may run 10 minutes at most, so the parts can run in
# separate calls on the same warm machine.
#
# Before: build .gpu/site.tgz (Unsloth, TRL, datasets and their needs: bench/gpu_train.py's header) and .gpu/extras.tgz
# (cvm-tune's own dependencies: bash bench/make-gpu-extras.sh), then
# carry .gpu with the working tree. On the GPU machine, from the repo root:
#     bash bench/gpu-checks.sh OUT bench [STEPS] [WARMUP]   # about 4 minutes (defaults 20 and 6)
#     bash bench/gpu-checks.sh OUT tests                    # pytest -m gpu but the API's and padding-free: about 5 minutes
#     bash bench/gpu-checks.sh OUT padding                  # the padding-free test (two Unsloth runs): about 4 minutes
#     bash bench/gpu-checks.sh OUT api                      # the API's GPU tests + its overhead: about 4 minutes
#     bash bench/gpu-checks.sh OUT tenants                  # 8 tenants on one GPU (packed passes): about 3 minutes
#     bash bench/gpu-checks.sh OUT quick                    # one short call, at most 8 minutes: the benchmark at 6
#                                                           # steps, the GPU pipeline test, the API's GPU tests, the
#                                                           # sampling benchmark (1B shape) and 8 tenants at 8 steps
#     bash bench/gpu-checks.sh OUT all                      # all five (too long for one device call)
# Measured on one H200 (2026-11-26): the benchmark 3.6 min at 20 steps; pytest -m gpu (without the API's) about 5 min.
# 2026-11-28: the GPU pipeline test 79 s, the API's Unsloth test 79 s and its 4-bit HF test 27 s (+ 14 s to build the
# model once); the padding-free test needed more than 150 s for its two runs.
set -uo pipefail

OUT=${1:?usage: bench/gpu-checks.sh OUT quick|bench|tests|padding|api|tenants|all [STEPS] [WARMUP]}
PART=${2:-all}
STEPS=${3:-20}
WARMUP=${4:-6}
mkdir -p "$OUT" /tmp/site /tmp/extras
[ -d /tmp/site/unsloth ] || tar xzf .gpu/site.tgz -C /tmp/site || exit 1
[ -d /tmp/extras/tinker ] || tar xzf .gpu/extras.tgz -C /tmp/extras || exit 1
export PYTHONPATH=/tmp/site:/tmp/extras:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
say() { echo "gpu-checks: $(date -u +%H:%M:%S) $*"; }

say "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi conf-compute -f 2>/dev/null
  python3 -W ignore -c 'import sys, unsloth, torch, transformers, peft, trl
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "peft", peft.__version__, "trl", trl.__version__, "unsloth", unsloth.__version__)'; } 2>&1 | tee "$OUT/machine.txt"

if [ "$PART" = bench ] || [ "$PART" = all ]; then
  say "training benchmark (steps $STEPS, warmup $WARMUP)"
  timeout 290 python3 bench/gpu_train.py --steps "$STEPS" --warmup "$WARMUP" --timeout 140 --out "$OUT" 2>&1 \
    | tee "$OUT/gpu-train.log"
  say "training benchmark: rc ${PIPESTATUS[0]}"
fi
# each test at most 150 s, so the run ends with its summary; failures also land at once in OUT
gpu_pytest() {  # NAME TIMEOUT PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  say "pytest -m gpu $*"
  CVM_TUNE_FAILURE_LOG="$OUT/$name-failures.txt" timeout "$limit" python3 -m pytest -m gpu -v -rs --timeout 150 \
    --durations=0 "$@" 2>&1 | tee "$OUT/$name.log"
  say "pytest -m gpu $*: rc ${PIPESTATUS[0]}"
}
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  gpu_pytest pytest-gpu 480 --ignore tests/test_gpu_api.py -k "not padding_free"
fi
if [ "$PART" = padding ] || [ "$PART" = all ]; then
  gpu_pytest pytest-gpu-padding 440 tests/test_gpu.py -k padding_free
fi
if [ "$PART" = api ] || [ "$PART" = all ]; then
  gpu_pytest pytest-gpu-api 300 tests/test_gpu_api.py
  say "training API overhead on the GPU"
  timeout 180 python3 bench/api_overhead.py --steps 10 --out "$OUT/api-overhead-gpu.json" 2>&1 | tee "$OUT/api-overhead.log"
  say "training API overhead: rc ${PIPESTATUS[0]}"
fi
if [ "$PART" = tenants ] || [ "$PART" = all ]; then
  say "8 tenants on one GPU (Llama-3.2-1B shape, packed passes, backend hf) against the same steps one after another"
  timeout 240 python3 bench/api_tenants.py --tenants 8 --steps 20 --batch 8 --tokens 128 --repeats 1 --backend hf \
    --base llama-1b \
    --out "$OUT/api-tenants-gpu.json" 2>&1 | tee "$OUT/api-tenants.log"
  say "tenants: rc ${PIPESTATUS[0]}"
fi
if [ "$PART" = quick ]; then  # each part's limit adds up to 480 s, so the call ends within 8 minutes
  say "quick: training benchmark (6 steps, warmup 2)"
  timeout 100 python3 bench/gpu_train.py --steps 6 --warmup 2 --timeout 45 --out "$OUT" 2>&1 | tee "$OUT/gpu-train.log"
  say "quick: training benchmark: rc ${PIPESTATUS[0]}"
  gpu_pytest pytest-gpu-pipeline 110 tests/test_gpu.py -k pipeline_on_gpu
  gpu_pytest pytest-gpu-api 130 tests/test_gpu_api.py
  say "quick: sampling (Llama-3.2-1B shape): the API's sampler against transformers' generate"
  timeout 60 python3 bench/api_sampling.py --base llama-1b --rounds 3 --tenants 0 \
    --out "$OUT/api-sampling-gpu.json" 2>&1 | tee "$OUT/api-sampling.log"
  say "quick: sampling: rc ${PIPESTATUS[0]}"
  say "quick: 8 tenants (Llama-3.2-1B shape, 8 steps)"
  timeout 80 python3 bench/api_tenants.py --tenants 8 --steps 8 --batch 8 --tokens 128 --repeats 1 --backend hf \
    --base llama-1b --out "$OUT/api-tenants-gpu.json" 2>&1 | tee "$OUT/api-tenants.log"
  say "quick: tenants: rc ${PIPESTATUS[0]}"
fi
