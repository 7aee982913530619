"""``cvm-tune deploy-plan``: the resources a cvm-tune CVM needs, and the exact deploy command for a target.

dstack's own defaults cannot run cvm-tune: ``vmm-cli.py deploy`` gives 1 vCPU, 1024 MB and 20 GB unless told
otherwise (``vmm/src/vmm-cli.py``, v0.5.11), and ``phala deploy`` (CLI 1.1.x) makes logs and system information
public unless ``--no-public-logs --no-public-sysinfo`` are given. The plan sizes the machine from the base model and
the output it will keep, refuses resources below that, and prints one command with every setting spelled out.

Sizing rule (estimates from the image's parts, not a measurement: no Docker engine was available where this was
written; raise them, never lower them):

* disk = image (GPU image unpacked, PyTorch CUDA runtime base + locked venv, with its compressed layers during the
  pull: ``IMAGE_GB``) + the base model twice (its image layer, and the compressed blob while it is unpacked during
  the pull; at rest the model is stored once: it is baked into the deployment image at a path that is not a volume)
  + the output volume (runs, sealed checkpoints, bundles; each merged-model export adds the model's size again)
  + ``SYSTEM_GB`` (dstack OS, Docker metadata, logs).
* memory = model (loaded through the page cache) + ``RUNTIME_GB`` (CUDA host allocations, tokenizer, Python, the 2 GB
  ``/dev/shm`` checkpoint scratch, the decrypted dataset kept in memory, at most ``dataset.max_plaintext_bytes``),
  at least ``MIN_MEMORY_GB``.
* vCPU = ``VCPU_PER_GPU`` per GPU (data loading, Triton kernel builds), at least ``MIN_VCPU``.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attestation.compose import app_compose as C
from attestation.compose.audit import audit as compose_audit

from app.deploy.app_compose import check_env, read_env_file
from app.errors import ConfigError

IMAGE_GB, SYSTEM_GB = 20, 10
RUNTIME_GB, MIN_MEMORY_GB = 16, 32
VCPU_PER_GPU, MIN_VCPU = 8, 8
ALERT_ENV = "CVM_TUNE_ALERT_WEBHOOK"
PHALA_CLI = "1.1.x"  # flags from Phala-Network/phala-cloud cli/src/commands/deploy/command.ts (tests/test_deploy_runbook.py)
Target = Literal["phala", "vmm"]
_SIZE = re.compile(r"^(\d+)\s*([GT])?B?$", re.I)


def parse_gb(text: str) -> int:
    """``64``, ``64G``, ``64GB``, ``1T`` -> GB.

    Raises:
        ConfigError: any other form.
    """
    m = _SIZE.match(text.strip())
    if not m:
        raise ConfigError(f"size {text!r} is not N, NG or NT", fix="e.g. --memory 128G --disk 400G")
    return int(m.group(1)) * (1024 if (m.group(2) or "G").upper() == "T" else 1)


@dataclass(frozen=True)
class Needs:
    """The least a cvm-tune CVM may have."""

    vcpu: int
    memory_gb: int
    disk_gb: int


def needs(model_gb: float, output_gb: float, gpus: int = 1) -> Needs:
    """The sizing rule of the module docstring."""
    if model_gb <= 0 or output_gb < 0 or gpus < 1:
        raise ConfigError("--model-gb must be > 0, --output-gb >= 0 and --gpus >= 1")
    return Needs(vcpu=max(MIN_VCPU, VCPU_PER_GPU * gpus),
                 memory_gb=max(MIN_MEMORY_GB, math.ceil(model_gb + RUNTIME_GB)),
                 disk_gb=math.ceil(IMAGE_GB + 2 * model_gb + output_gb + SYSTEM_GB))


@dataclass(frozen=True)
class Plan:
    """One deploy command and what was checked before printing it."""

    argv: list[str]
    needs: Needs
    notes: list[str]

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def _check_inputs(app_compose: Path, env_file: Path) -> list[str]:
    """The app-compose passes its audit and keeps the alert variable; the env file holds only allowed names."""
    from attestation.tdx.inputs import read_bounded

    if not app_compose.is_file():
        raise ConfigError(f"cannot read {app_compose}: no such file", fix="run cvm-tune app-compose first")
    raw = read_bounded(app_compose, C.MAX_APP_COMPOSE, C.ComposeError, "app-compose.json")
    doc = C.load(raw)
    if problems := compose_audit(doc):
        raise ConfigError(f"{app_compose} fails its audit: " + "; ".join(problems), fix="regenerate it with cvm-tune app-compose")
    allowed = doc.get("allowed_envs") or []
    if not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed):
        raise C.ComposeError(f"{app_compose}: allowed_envs is not a list of names")
    if ALERT_ENV not in allowed:
        raise ConfigError(f"{ALERT_ENV} is not in {app_compose}'s allowed_envs: alerts would be dropped",
                          fix="keep `- CVM_TUNE_ALERT_WEBHOOK` in docker-compose.yaml and regenerate")
    values = read_env_file(env_file)  # values are never printed
    check_env(values, allowed)
    if ALERT_ENV not in values:
        raise ConfigError(f"{env_file} does not set {ALERT_ENV}: failures would alert nobody",
                          fix=f"add {ALERT_ENV}=https://... to {env_file}")
    digest = C.compose_hash(raw)
    form, mr = C.expected_mr_config_id(doc, digest, C.app_id(doc, digest))  # what a dstack 0.6 VMM sets
    return [f"{app_compose}: audit clean, allowed_envs {allowed}; {env_file}: {sorted(values)}",
            f"MRCONFIGID {form}: {C.MR_CONFIG_V3 if form == 'v3' else mr or '(needs the app id)'}"]


def plan(target: Target, *, model_gb: float, output_gb: float, gpus: int, vcpu: int | None, memory: str | None,
         disk: str | None, name: str, deploy_dir: Path, env_file: Path, instance_type: str | None = None,
         os_image: str | None = None, kms_url: str | None = None, vmm_url: str | None = None) -> Plan:
    """Check the inputs and the resources, and build the deploy command.

    Raises:
        ConfigError: resources below :func:`needs`, a missing target setting, or inputs that fail their checks.
    """
    need = needs(model_gb, output_gb, gpus)
    notes = _check_inputs(deploy_dir / "app-compose.json", env_file)
    have = {"vCPU": (vcpu, need.vcpu, ""), "memory": (parse_gb(memory) if memory else None, need.memory_gb, " GB"),
            "disk": (parse_gb(disk) if disk else None, need.disk_gb, " GB")}
    short = [f"{k} {v}{unit} < {n}{unit}" for k, (v, n, unit) in have.items() if v is not None and v < n]
    if short:
        raise ConfigError(f"resources below what cvm-tune needs for a {model_gb:g} GB model: {', '.join(short)}",
                          fix=f"give at least {need.vcpu} vCPU, {need.memory_gb} GB memory, {need.disk_gb} GB disk")
    disk_gb = have["disk"][0] or need.disk_gb
    if target == "phala":
        if not instance_type:
            raise ConfigError("phala needs --instance-type (a GPU type, e.g. h200.small)",
                              fix="list the types in the Phala Cloud dashboard; pick one with a GPU")
        argv = ["phala", "deploy", "-n", name, "-c", str(deploy_dir / "docker-compose.yaml"), "-t", instance_type,
                "--disk-size", f"{disk_gb}G", "--no-public-logs", "--no-public-sysinfo", "-e", str(env_file)]
        if vcpu is None or memory is None:
            notes.append(f"{instance_type}: vCPU and memory come from the instance type; check they are at least "
                         f"{need.vcpu} vCPU and {need.memory_gb} GB (or pass them with --vcpu/--memory to have them checked)")
        notes.append("Phala builds app-compose.json itself: read the measured one back and pin ITS hash (docs/deploy.md)")
    else:
        if not (os_image and kms_url):
            raise ConfigError("vmm needs --os-image (a production dstack image, not -dev) and --kms-url")
        if os_image.endswith("-dev") or "-dev-" in os_image:
            raise ConfigError(f"{os_image} is a dev image: its quotes are debug-flagged and every verifier rejects them")
        argv = ["vmm-cli.py", *(["--url", vmm_url] if vmm_url else []), "deploy", "--name", name, "--image", os_image,
                "--compose", str(deploy_dir / "app-compose.json"), "--vcpu", str(vcpu or need.vcpu),
                "--memory", f"{have['memory'][0] or need.memory_gb}G", "--disk", f"{disk_gb}G",
                "--gpu", "all", "--kms-url", kms_url, "--env-file", str(env_file)]
    return Plan(argv, need, notes)
