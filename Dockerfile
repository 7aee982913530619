# syntax=docker/dockerfile:1
# cvm-tune image for dstack CVMs (Intel TDX + NVIDIA H100). Everything dstack measures through this image is pinned:
# the base image by digest, every Python package by SHA-256 (requirements/*.lock, installed by requirements/install.sh,
# the same script and cpu.lock that CI runs), and cvm-tune itself from this source tree (its hash is in every manifest).
#
# Base: the official PyTorch 2.13.0 runtime image (CUDA 12.6, cuDNN 9, Python 3.12; Hopper/H100 supported; CUDA 12.6
# needs an NVIDIA driver >= 560 in the CVM: dstack's OS layer ships 580.x/595.x, meta-nvidia at dstack 312dc605). It
# provides torch 2.13.0 and its CUDA stack (torchvision, triton, nvidia-*), which the locks never download.
# Digest source: NOT resolved from the registry by the author (no registry access from the machine this was written
# on). It is the digest two independent public projects pin for this tag (saschagobel/tlmtc, Dockerfile GPU_BASE_IMAGE;
# a CHTC experiment script, CONTAINER_IMAGE). Check it before the first build:
#   docker buildx imagetools inspect docker.io/pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
# and change it only deliberately: a new base is a new image digest, a new compose-hash and a new key release.
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime@sha256:6acf597eeb8e376a96580dde4952f37cc017fef732bb40bfc73f28f25e3f64b4
# gpu: requirements/gpu.lock (the [gpu] extra: Unsloth). cpu: requirements/cpu.lock, exactly the lock CI tests.
ARG FLAVOR=gpu

FROM ${BASE_IMAGE} AS build
ARG FLAVOR
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY requirements/ requirements/
COPY pyproject.toml README.md ./
COPY app/ app/
COPY attestation/ attestation/
# The browser verifier (bundles serve's /verify): app/service/verify.html links to it; the wheel carries the file.
COPY web/dist/verify.html web/dist/verify.html
# --system-site-packages: the venv sees the base's torch stack; everything else comes from the lock, hash-checked.
RUN python3 -m venv --system-site-packages /opt/venv \
 && sh requirements/install.sh /opt/venv requirements/${FLAVOR}.lock \
 && /opt/venv/bin/python -c "from importlib.metadata import version as v; t = v('torch'); assert t.split('+')[0] == '2.13.0', t" \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

# Final stage: the base plus the venv and two files. No compilers, no pip cache, no source tree, no build outputs.
FROM ${BASE_IMAGE}
ARG FLAVOR
ARG BASE_IMAGE
COPY --from=build /opt/venv /opt/venv
COPY requirements/${FLAVOR}.lock /opt/cvm-tune/requirements/${FLAVOR}.lock
COPY configs/dstack.yaml /etc/cvm-tune/config.yaml
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TZ=UTC \
    HOME=/home/cvmtune \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    UNSLOTH_DISABLE_STATISTICS=1 \
    CVM_TUNE_LOCK_FILE=/opt/cvm-tune/requirements/${FLAVOR}.lock \
    CVM_TUNE_BASE_IMAGE=${BASE_IMAGE}
# GPU flavor: Triton (Unsloth's kernels, TRL's fused LM head on CUDA) builds a C launcher per kernel at run time with the
# image's C compiler and Python headers. Fail the build here, not the first nightly run, if the base lacks them.
RUN if [ "$FLAVOR" = gpu ]; then python -c "import sys; from app.training.options import triton_toolchain_problem as p; sys.exit(p())"; fi
# The output volume's mount point belongs to the app user, so a new named volume starts writable for it.
RUN useradd --uid 10001 --create-home --home-dir /home/cvmtune --shell /usr/sbin/nologin cvmtune \
 && mkdir -p /data/dataset /data/output \
 && chown 10001:10001 /data/output
USER 10001
WORKDIR /home/cvmtune
HEALTHCHECK --interval=60s --timeout=20s --start-period=300s --retries=3 \
    CMD ["cvm-tune", "status", "--health", "--config", "/etc/cvm-tune/config.yaml"]
ENTRYPOINT ["cvm-tune"]
CMD ["serve", "--config", "/etc/cvm-tune/config.yaml"]
