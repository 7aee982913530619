# cvm-tune training service image.
# The install step uses the same lock file as CI (requirements/cpu.txt). Hardening for production
# (base image pinned by digest, CUDA runtime, GPU lock for the [gpu] extra) is tracked separately.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TZ=UTC \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    UNSLOTH_DISABLE_STATISTICS=1

WORKDIR /opt/cvm-tune
COPY requirements/cpu.txt requirements/cpu.txt
RUN pip install --no-cache-dir -r requirements/cpu.txt
COPY pyproject.toml README.md ./
COPY app app
COPY attestation attestation
RUN pip install --no-cache-dir --no-deps . && rm -rf /root/.cache
COPY configs/dstack.yaml /etc/cvm-tune/config.yaml

RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin cvmtune
USER 10001
ENTRYPOINT ["cvm-tune"]
CMD ["run", "--config", "/etc/cvm-tune/config.yaml"]
