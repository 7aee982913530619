#!/usr/bin/env bash
# make-gpu-extras.sh: build .gpu/extras.tgz, cvm-tune's own dependencies for the offline GPU machine.
#
# The GPU machine's image has torch, transformers, peft, accelerate, pyyaml, httpx, requests, rich...;
# shared/gpu/make-bundle.sh's .gpu/site.tgz adds Unsloth, trl, datasets, pydantic and their needs. Neither
# has what cvm-tune itself imports (cryptography, dcap-qvl, dstack-sdk, eth-keys...) nor pytest, so
# `cvm-tune run`, bench/gpu_train.py and `pytest -m gpu` need this second tarball (about 20 MiB: the
# compiled libraries' debug symbols, C/Cython sources, test folders and matplotlib's sample data are
# left out; unstripped it is 31 MiB, which with site.tgz and the tree came within 2 MiB of the 64 MiB
# carry limit).
#
# Run from the repo root on a machine that reaches a package index (any Python >= 3.8 with pip):
#     bash bench/make-gpu-extras.sh
# Then carry `.gpu` (git-ignored) with the working tree and, on the GPU machine:
#     mkdir -p /tmp/extras && tar xzf .gpu/extras.tgz -C /tmp/extras   # PYTHONPATH=/tmp/site:/tmp/extras:$PWD
#
# The wheels are pinned by version and sha256 in requirements/gpu-extras.txt (cp312, manylinux x86_64).
set -euo pipefail

PY=${PYTHON:-python3}
OUT=.gpu/extras.tgz
LIMIT_MIB=64
PLATFORM_ARGS=(--python-version 3.12 --implementation cp --only-binary=:all:
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

say() { echo "make-gpu-extras: $*"; }
die() { echo "make-gpu-extras: error: $*" >&2; exit 1; }

[ -f requirements/gpu-extras.txt ] || die "run this from the cvm-tune repo root"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY -m pip is not available (set PYTHON=...)"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu-extras.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

say "downloading the pinned wheels"
"$PY" -m pip download -q --no-deps --require-hashes "${PLATFORM_ARGS[@]}" -r requirements/gpu-extras.txt -d "$TMP/wheels"
say "unpacking into one site folder"
if ! "$PY" -m pip install -q --no-deps --no-index --no-compile "${PLATFORM_ARGS[@]}" --target "$TMP/site" "$TMP"/wheels/*.whl; then
  say "pip refused the foreign tags; unzipping the wheels instead"
  for w in "$TMP"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$TMP/site"; done
fi
rm -rf "$TMP/site/bin" "$TMP/site/matplotlib/mpl-data/sample_data"
find "$TMP/site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$TMP/site" -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
find "$TMP/site" -type f \( -name direct_url.json -o -name '*.c' -o -name '*.cpp' -o -name '*.h' -o -name '*.pyx' -o -name '*.pxd' \) -delete
if command -v strip >/dev/null; then  # debug symbols only: the libraries load and run the same (checked on Python 3.12)
  find "$TMP/site" -name '*.so' -exec strip --strip-unneeded {} +
else
  say "strip not found: the tarball keeps the debug symbols (about 10 MiB more)"
fi

mkdir -p .gpu
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$TMP/site" -cf - . | gzip -n -9 > "$OUT"
size=$(stat -c %s "$OUT")
say "wrote $OUT ($((size / 1024 / 1024)) MiB)"
total=$size
[ -f .gpu/site.tgz ] && total=$((total + $(stat -c %s .gpu/site.tgz)))
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((total + tree))
[ "$total" -le $((LIMIT_MIB * 1024 * 1024)) ] || die "site.tgz + extras.tgz + working tree = $((total / 1024 / 1024)) MiB > $LIMIT_MIB MiB carry limit"
say "carry total with .gpu/site.tgz and the working tree: $((total / 1024 / 1024)) MiB of $LIMIT_MIB"
