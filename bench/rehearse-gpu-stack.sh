#!/usr/bin/env bash
# rehearse-gpu-stack.sh: run cvm-tune on the GPU machine's software stack, on a machine without a GPU, before
# spending device time: the CPU test suite, `pytest -m gpu` (must skip cleanly), one demo `run` and the benchmark's dry
# run, all under Python 3.12 with the GPU image's packages (shared/gpu/README.md: torch 2.11.0, transformers 5.17.0,
# peft 0.21, accelerate 1.15.0, huggingface_hub 1.33) and the two carried tarballs first on sys.path, as there.
#
# What it cannot show: anything that needs CUDA (Unsloth refuses to import without a GPU; that path has unit tests
# and the GPU tests). One file differs from the GPU machine: trl 1.15's fused LM head is a Triton kernel with no CPU
# path (README "GPU path"), so trl 1.16's trl/kernels/chunked_logprob.py (same ChunkedLogProbFunction, torch ops off
# CUDA) replaces it in the rehearsal copy of site.tgz; the rest of trl 1.15, SFTTrainer included, runs as shipped.
#
# Run from the repo root, after bash shared/gpu/make-bundle.sh and bash bench/make-gpu-extras.sh, on a machine that
# reaches PyPI (the venv is about 5 GiB: PyPI's torch 2.11.0 is the CUDA build, which also runs on the CPU):
#     bash bench/rehearse-gpu-stack.sh            # PYTHON312=... picks the interpreter, WORK=... the folder
set -euo pipefail

PY=${PYTHON312:-python3.12}
WORK=${WORK:-${TMPDIR:-/tmp}/cvm-tune-gpu-rehearsal}
IMAGE_PACKAGES=(torch==2.11.0 transformers==5.17.0 peft==0.21.2 accelerate==1.15.0 huggingface_hub==1.33.0
  numpy pyarrow pandas psutil xxhash requests rich pyyaml sentencepiece tqdm typer packaging python-dateutil)
# Identity checks, not stack checks: they assert that this environment IS requirements/cpu.lock (it is not, on purpose).
NOT_THIS_STACK=(tests/test_deploy.py::test_this_environment_is_the_cpu_lock
  tests/test_deploy.py::test_container_command_runs_against_the_simulator
  tests/test_deploy.py::test_bundle_server_serves_only_with_the_token)

say() { echo "rehearse-gpu-stack: $*"; }
die() { echo "rehearse-gpu-stack: error: $*" >&2; exit 1; }

[ -f requirements/gpu-extras.txt ] || die "run this from the cvm-tune repo root"
[ -f .gpu/site.tgz ] && [ -f .gpu/extras.tgz ] || die "build .gpu/site.tgz (shared/gpu/make-bundle.sh) and .gpu/extras.tgz (bench/make-gpu-extras.sh) first"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || die "$PY is not Python 3.12 (set PYTHON312=...)"
REPO=$PWD

rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/extras" "$WORK/wheels"
say "venv with the GPU image's packages"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "${IMAGE_PACKAGES[@]}"
tar xzf .gpu/site.tgz -C "$WORK/site"
tar xzf .gpu/extras.tgz -C "$WORK/extras"
"$WORK/venv/bin/pip" download -q --no-deps trl==1.16.0 -d "$WORK/wheels"
"$WORK/venv/bin/python" -m zipfile -e "$WORK"/wheels/trl-1.16.0-*.whl "$WORK/wheels/trl"
cp "$WORK/wheels/trl/trl/kernels/chunked_logprob.py" "$WORK/site/trl/kernels/chunked_logprob.py"
# Ahead of site-packages in every interpreter of this venv, test subprocesses included (they set PYTHONPATH themselves):
# the GPU machine's PYTHONPATH=/tmp/site:/tmp/extras:$PWD.
purelib=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sys; sys.path[:0] = ['$WORK/site', '$WORK/extras', '$REPO']" > "$purelib/cvm_tune_rehearsal.pth"
"$WORK/venv/bin/python" -c 'import torch, transformers, trl, datasets, peft, pydantic
print("rehearse-gpu-stack:", ", ".join(f"{m.__name__} {m.__version__}" for m in (torch, transformers, trl, datasets, peft, pydantic)),
      "; cuda", torch.cuda.is_available())'

export HF_HUB_OFFLINE=1
deselect=()
for t in "${NOT_THIS_STACK[@]}"; do deselect+=(--deselect "$t"); done
say "CPU test suite"
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider "${deselect[@]}"
say "pytest -m gpu (no GPU here: every test must skip)"
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider -m gpu -rs
say "demo run"
mkdir -p "$WORK/run" && (cd "$WORK/run" && "$WORK/venv/bin/python" -m app run)
say "benchmark dry run"
"$WORK/venv/bin/python" "$REPO/bench/gpu_train.py" --dry-run --out "$WORK/bench"
say "ok: the GPU machine's stack passed everything a CPU can run ($WORK)"
