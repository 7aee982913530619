"""The ``training`` and ``evaluation`` sections of the configuration (re-exported by :mod:`app.config`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from attestation.privacy.dp import NOISE_MAX, NOISE_MIN, PRV_MAX_STEPS

from app.config.base import _Closed


class LoraSettings(_Closed):
    """LoRA adapter shape."""

    r: int = Field(8, ge=1, le=1024)
    alpha: int = Field(16, ge=1, le=1 << 20)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), min_length=1
    )


class LossWatchdogSettings(_Closed):
    """Abort a diverging run (NaN/Inf loss, or a loss spike that lasts) before it is checkpointed or exported."""

    enabled: bool = True
    spike_factor: float = Field(5.0, gt=1.0, description="A logged loss above this multiple of the median of the "
                                "previous `window` losses is a spike.")
    window: int = Field(10, ge=1, le=1000, description="Losses the spike median is taken over.")
    patience: int = Field(3, ge=1, le=1000, description="Consecutive spikes that abort the run (NaN/Inf abort at once). "
                          "No checkpoint is sealed while a spike lasts.")
class GpuTrainingSettings(_Closed):
    """GPU-path settings (Unsloth, QLoRA, multi-GPU, OOM back-off); the defaults change nothing on a CPU."""

    devices: int = Field(
        1, ge=1, le=8,
        description="Training processes (one per GPU, DDP). >1: the HF backend only; on a machine without CUDA the "
        "processes run on the CPU with gloo (for testing). Hopper CC mode: DDP traffic between GPUs is slow and, "
        "over NVLink, not encrypted (see docs/gpu.md, Multi-GPU).",
    )
    quantization: Literal["none", "4bit"] = Field(
        "none", description="4bit: QLoRA (NF4 base weights via bitsandbytes; CUDA only). none: bf16/fp32 base weights."
    )
    gradient_checkpointing: Literal["auto", "off", "on", "unsloth"] = Field(
        "auto",
        description="auto: off on CPU, on for HF on a GPU, Unsloth's offloaded checkpointing for Unsloth. unsloth: "
        "activations offloaded to CPU RAM (in CC mode every copy crosses the encrypted bounce buffer).",
    )
    batching: Literal["padded", "padding_free", "packed"] = Field(
        "padded",
        description="padded: one padded row per example (any backend; resumable and reproducible). padding_free: "
        "examples of a micro-batch concatenated, same examples per step (Unsloth only). packed: examples packed "
        "into max_length rows, which changes what a step is (Unsloth only).",
    )
    auto_batch_size: bool = Field(
        False,
        description="Start at the largest micro-batch (micro-batch = effective batch) and halve it on CUDA OOM until it "
        "fits; gradient accumulation grows so the effective batch stays per_device_batch_size x gradient_accumulation_steps.",
    )
    oom_retries: int = Field(
        3, ge=0, le=10,
        description="CUDA OOM before the first optimizer step: halve the micro-batch and double gradient accumulation, "
        "at most this many times (each change is an audit event and in the manifest). Eval OOM halves only the eval batch.",
    )


class PrivacySettings(_Closed):
    """Differential privacy for the adapter: DP-SGD with Opacus on the LoRA parameters (docs/differential-privacy.md)."""

    mode: Literal["off", "dp-sgd"] = Field(
        "off", description="dp-sgd: per-example gradient clipping and Gaussian noise at every optimizer step, Poisson "
        "sampling of each step's rows, (epsilon, delta) accounted and recorded in the attested manifest. Runs on the hf "
        "backend only (backend auto falls back to it; backend unsloth is refused).",
    )
    target_epsilon: float = Field(8.0, ge=0.01, le=1000, description="The run's privacy budget epsilon (0.01 to "
                                  "1000): the noise is derived so that max_steps spend at most this; a run never "
                                  "spends more.")
    target_delta: float | None = Field(
        None, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; must be below 1/N (N: rows after "
        "deduplication and the token policy), checked once N is known. Unset: 1/N^2.",
    )
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Per-example clipping norm C (L2, over all LoRA "
                                 "parameters; at most 1e6).")
    noise_multiplier: float | None = Field(
        None, ge=NOISE_MIN, le=NOISE_MAX, description="sigma: noise standard deviation / C, from 0.01 to 1e6. Unset: "
        "the smallest sigma (Opacus' get_noise_multiplier search) that fits max_steps into target_epsilon. Set: a run "
        "whose max_steps do not fit is refused.",
    )
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus privacy accountant: rdp (Renyi DP) or prv "
                                              "(privacy loss random variables; tighter, slower; at most 100000 "
                                              "max_steps, and refused when its mesh would exceed 4194304 points).")
    lifetime_epsilon: float | None = Field(
        None, gt=0, le=1e6, description="Cap on the epsilon spent on one dataset version across all runs on this output "
        "volume (summed: basic composition; at most 1e6). A run whose target_epsilon would exceed what is left is "
        "refused. Unset: no cap.",
    )


class DpoSettings(_Closed):
    """Preference training (``training.objective: dpo``): TRL's DPOTrainer on the LoRA model, the base model with the
    adapter disabled as the reference (docs/dpo.md)."""

    beta: float = Field(0.1, gt=0.0, le=100.0, description="Strength of the pull towards the reference (the base "
                        "model): higher keeps the adapter closer to it.")
    loss_type: Literal["sigmoid", "hinge", "ipo"] = Field(
        "sigmoid", description="sigmoid: the DPO loss -log sigmoid(beta x margin). hinge: max(0, 1 - beta x margin) "
        "(SLiC). ipo: (margin per token - 1 / (2 beta))^2 (IPO).")


class TrainingSettings(_Closed):
    """Optimisation settings shared by both backends."""

    objective: Literal["sft", "dpo"] = Field(
        "sft", description="sft: supervised fine-tuning on text or chat rows. dpo: preference training (DPO) on "
        "prompt / chosen / rejected rows (training.dpo).",
    )
    backend: Literal["auto", "hf", "unsloth"] = Field(
        "auto", description="auto: Unsloth when it imports and a CUDA GPU is present, else transformers+PEFT+TRL."
    )
    seed: int = Field(42, ge=0, le=2**32 - 1)
    max_steps: int = Field(30, ge=1, le=10_000_000)
    per_device_batch_size: int = Field(4, ge=1, le=65536)
    gradient_accumulation_steps: int = Field(2, ge=1, le=65536)
    learning_rate: float = Field(5e-3, gt=0)
    max_length: int = Field(128, ge=8, le=1 << 20, description="Tokens per example; longer examples are truncated by TRL.")
    save_steps: int = Field(10, ge=1, le=10_000_000, description="Checkpoint interval (optimizer steps) on the output volume.")
    logging_steps: int = Field(1, ge=1, le=10_000_000)
    assistant_only_loss: bool = False
    cpu_threads: Literal["auto"] | int = Field(
        "auto", description="Threads torch computes with on the CPU (torch.set_num_threads, before training; in the run "
        "report). auto: the CPUs this process may use (affinity mask, capped by the cgroup CPU quota), less those other "
        "processes keep busy (1-minute load average, rounded down), divided among the training processes; at least 1 "
        "(docs/performance.md). The training API (CPU) reads it too, and its auto leaves one more CPU to the server's "
        "request handling.",
    )
    eval_fraction: float = Field(
        0.0, ge=0.0, le=0.5,
        description="Share of rows held out (seeded) for an eval loss every save_steps and at the end; 0: no eval.",
    )
    per_device_eval_batch_size: int | None = Field(None, ge=1, le=65536, description="Eval micro-batch; unset: per_device_batch_size.")
    init: Literal["auto", "base", "previous"] = Field(
        "auto",
        description="Where the adapter starts. base: fresh LoRA weights on the base model. previous: continue from the "
        "last promoted adapter on this output volume (verified first; none yet: base). auto: previous for "
        "`cvm-tune serve`, base for `cvm-tune run`.",
    )
    lora: LoraSettings = LoraSettings()
    loss_watchdog: LossWatchdogSettings = LossWatchdogSettings()
    gpu: GpuTrainingSettings = GpuTrainingSettings()
    privacy: PrivacySettings = PrivacySettings()
    dpo: DpoSettings = DpoSettings()

    @field_validator("cpu_threads", mode="before")
    @classmethod
    def _threads(cls, value: object) -> object:
        if value != "auto" and not (type(value) is int and 1 <= value <= 4096):
            raise ValueError(f"must be auto or a whole number of threads from 1 to 4096, not {value!r}")
        return value

    @model_validator(mode="after")
    def _gpu_combinations(self) -> TrainingSettings:
        # What the backend alone decides; the rest (CUDA present, Unsloth importable) is checked at run time.
        g = self.gpu
        if self.backend == "hf" and g.batching != "padded":
            raise ValueError(f"training.gpu.batching '{g.batching}' needs the Unsloth backend (set padded for hf)")
        if self.backend == "hf" and g.gradient_checkpointing == "unsloth":
            raise ValueError("training.gpu.gradient_checkpointing 'unsloth' needs the Unsloth backend")
        if self.backend == "unsloth" and g.devices > 1:
            raise ValueError("training.gpu.devices > 1 runs the hf backend only")
        if self.objective == "dpo":
            dpo = {"training.privacy.mode dp-sgd (the DP-SGD path clips per-example SFT losses; DPO's paired loss "
                   "with its reference pass is not accounted: train DPO without DP, or use objective sft)":
                   self.privacy.mode == "dp-sgd",
                   "training.assistant_only_loss (DPO trains on the chosen and rejected answers only already)":
                   self.assistant_only_loss,
                   f"training.gpu.batching '{g.batching}' (padded only)": g.batching != "padded"}
            bad = [name for name, hit in dpo.items() if hit]
            if bad:
                raise ValueError(f"training.objective dpo does not support {'; '.join(bad)}")
        if self.privacy.mode == "dp-sgd":
            dp = {f"training.max_steps above {PRV_MAX_STEPS} with training.privacy.accountant 'prv' (its memory grows "
                  "with the steps: use rdp)": self.privacy.accountant == "prv" and self.max_steps > PRV_MAX_STEPS,"training.backend 'unsloth' (Opacus cannot hook Unsloth's fused LoRA kernels: use auto or hf)":
                  self.backend == "unsloth",
                  "training.gpu.devices > 1 (one process only)": g.devices > 1,
                  f"training.gpu.batching '{g.batching}' (padded only)": g.batching != "padded",
                  f"training.gpu.gradient_checkpointing '{g.gradient_checkpointing}' (auto or off)":
                  g.gradient_checkpointing in ("on", "unsloth"),
                  "training.eval_fraction > 0 (held-out rows would be evaluated and reported without DP)":
                  self.eval_fraction > 0}
            bad = [name for name, hit in dp.items() if hit]
            if bad:
                raise ValueError(f"training.privacy.mode dp-sgd does not support {'; '.join(bad)}")
        return self


class EvaluationSettings(_Closed):
    """The promotion gate: the new adapter replaces the promoted one only if it is not worse on the owner's eval rows."""

    gate: Literal["off", "loss"] = Field(
        "off",
        description="off: every exported adapter is promoted. loss: evaluate the candidate and its parent (the promoted "
        "adapter, or the base model for a first run) on the dataset's eval rows (rows with \"split\": \"eval\") and "
        "promote only if the candidate's mean loss is at most the parent's times (1 + max_regression). With "
        "training.objective dpo the loss is the mean DPO loss against the base model (preference accuracy is recorded "
        "too).",
    )
    max_regression: float = Field(0.0, ge=0.0, le=10.0, description="Relative eval-loss increase still promoted "
                                  "(0.0: the candidate must not be worse).")
    min_rows: int = Field(1, ge=1, le=1_000_000, description="gate loss: refuse the run when the dataset has fewer eval rows.")
