"""The training engine behind the API: the base model loaded once, one LoRA adapter per model, every operation run
in arrival order on one worker thread (so a model's operations apply in the order they were accepted).

Each model keeps its adapter (PEFT, named ``m<N>``), its Adam optimizer over that adapter's parameters and its op
chain head (:mod:`attestation.outputs.op_chain`): ``forward_backward`` accumulates gradients, ``optim_step`` applies them with
the request's Adam parameters and clears them. Sampler checkpoints are loaded as adapters of their own, once.

The base is loaded by transformers + PEFT (backend ``hf``) or by Unsloth (``unsloth``, :mod:`app.api.backend`); the
adapters, their ``LoraConfig`` and what is saved are the same on both.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attestation.outputs.op_chain import GENESIS

from app.api import dp as dpsgd
from app.api import losses, sampling, wire
from app.api.errors import ApiError, BadRequest, NotFound
from app.api.history import check_adam, fresh_optimizer, link

logger = logging.getLogger(__name__)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
LORA_ALPHA = 32
LORA_DROPOUT = 0.0
MAX_SAMPLERS = 8  # sampler checkpoints kept loaded as adapters


@dataclass
class Model:
    id: str
    adapter: str
    lora: dict[str, Any]
    optimizer: Any
    op_head: str = GENESIS
    ops: int = 0
    steps: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    pending_loss: float = 0.0
    tokens_seen: int = 0
    last_adam: dict[str, float] | None = None
    dp: dict[str, Any] | None = None  # app.api.dp settings and spend; None: no DP
    dp_sums: list[Any] | None = None  # the clipped per-datum gradients summed since the last optim_step
    pending: int = 0  # forward_backward ops whose gradient the next optim_step applies
    custom_losses: dict[str, Any] = field(default_factory=dict)  # id -> document of each custom loss its ops used


class Engine:
    def __init__(self, base_dir: Path, backend: str = "hf", cfg: Any = None) -> None:
        """``backend`` ``unsloth`` needs ``cfg`` (the configuration: the nightly run's Unsloth arguments)."""
        self.base_dir = Path(base_dir)
        self.backend = backend
        if backend == "unsloth":
            from app.api import backend as api_backend

            self.model = api_backend.load_unsloth(self.base_dir, cfg)
            self.placeholder, self.device = api_backend.PLACEHOLDER, next(self.model.parameters()).device.type
            self.net = api_backend.unsloth_head(self.model)  # what forward passes and sampling call
        else:
            self._load_hf(base_dir, cfg)
        config = self.model.config
        self.vocab = int(config.vocab_size)
        self.arch = str(getattr(config, "model_type", "") or "unknown")
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, str] = {}  # checkpoint dir -> adapter name
        self._names = itertools.count(1)
        self._jobs: queue.Queue[tuple[Callable[[], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="api-engine", daemon=True)
        self._thread.start()

    def _load_hf(self, base_dir: Path, cfg: Any) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from app.config import TrainingSettings
        from app.training.options import hf_model_kwargs

        cuda = torch.cuda.is_available()
        self.device = "cuda" if cuda else "cpu"
        kw = hf_model_kwargs(cfg.training if cfg is not None else TrainingSettings(), cuda=cuda)
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), **kw)
        if "device_map" not in kw:  # a 4-bit base is placed by its device_map and cannot be moved
            base = base.to(self.device)
        # A placeholder adapter that stays at zero makes the model a PeftModel once; each API model adds its own.
        self.model = get_peft_model(base, LoraConfig(r=1, target_modules=["q_proj"], lora_dropout=0.0),
                                    adapter_name="base")
        self.placeholder, self.net = "base", self.model  # net: what forward passes and sampling call

    # --- the worker --------------------------------------------------------------------------------

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put((job,))

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            try:
                item[0]()
            except Exception:  # a job reports its own failure; this only keeps the worker alive
                logger.exception("engine job failed")

    def stop(self) -> None:
        self._jobs.put(None)

    # --- models ------------------------------------------------------------------------------------

    def lora_config(self, lora: dict[str, Any]) -> Any:
        from peft import LoraConfig

        targets = [*(ATTN if lora["train_attn"] else ()), *(MLP if lora["train_mlp"] else ()),
                   *(UNEMBED if lora["train_unembed"] else ())]
        present = {n.rsplit(".", 1)[-1] for n, _m in self.model.base_model.model.named_modules()}
        targets = [t for t in targets if t in present]
        if not targets:
            raise BadRequest("the LoRA targets no layer: set at least one of train_attn, train_mlp, train_unembed")
        return LoraConfig(r=lora["rank"], lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")

    def create(self, model_id: str, lora: dict[str, Any], dp: dict[str, Any] | None = None) -> Model:
        import torch

        name = f"m{next(self._names)}"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.get("seed") or 0)
            self.model.add_adapter(name, self.lora_config(lora))
        params = self._params(name)
        m = Model(model_id, name, lora, fresh_optimizer(params), dp=dict(dp) if dp else None)
        if m.dp:
            m.dp_sums = [torch.zeros_like(p) for p in params]
        self.models[model_id] = m
        return m

    def _params(self, adapter: str) -> list[Any]:
        return [p for n, p in self.model.named_parameters() if f".{adapter}." in n]

    def get(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise NotFound(f"model {model_id} is not loaded on this server (a restart drops training state: create "
                           "a training client from its last saved state)")
        return m

    def _activate(self, adapter: str, train: bool) -> None:
        self.model.set_adapter(adapter)
        if self.backend == "unsloth":
            from app.api.backend import route

            route(self.model, adapter)
        for p in self._params(adapter):
            p.requires_grad_(train)
        self.model.train(train)

    # --- operations --------------------------------------------------------------------------------

    def forward_backward(self, op: wire.Op) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """One op, applied atomically: its gradient is added and the op linked into the chain, or (refused, or
        failed part-way) the model, its pending gradient and its DP sums are exactly as before."""
        m = self.get(op.model_id)
        losses.check_config(op.loss_fn, op.loss_fn_config)  # every input checked before any state is touched
        if op.forward_only:
            self._activate(m.adapter, False)
            return self._forward_backward(m, op)
        new_head = link(m.op_head, op.record())
        snapshot = self._grad_snapshot(m)
        try:
            self._activate(m.adapter, True)
            outputs, metrics = self._forward_backward(m, op)
            if not np.isfinite(metrics["loss:sum"]):
                raise BadRequest(f"the loss is not finite ({metrics['loss:sum']}); nothing was applied")
        except BaseException:
            self._grad_restore(m, snapshot)
            raise
        m.op_head, m.ops, m.pending = new_head, m.ops + 1, m.pending + 1
        if "custom" in op.extra:  # the loss's document goes with the model's history (manifest op_chain)
            m.custom_losses[op.extra["custom"].id] = op.extra["custom"].doc
        m.pending_loss += metrics["loss:sum"]
        m.tokens_seen += op.n_tokens
        return outputs, metrics

    def _grad_snapshot(self, m: Model) -> tuple[list[Any], list[Any] | None]:
        params = self._params(m.adapter)
        return ([None if p.grad is None else p.grad.detach().clone() for p in params],
                None if m.dp_sums is None else [s.detach().clone() for s in m.dp_sums])

    def _grad_restore(self, m: Model, snapshot: tuple[list[Any], list[Any] | None]) -> None:
        grads, sums = snapshot
        for p, g in zip(self._params(m.adapter), grads):
            p.grad = g
        if sums is not None:
            m.dp_sums = sums

    def _forward_backward(self, m: Model, op: wire.Op) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        import torch

        private = m.dp is not None and not op.forward_only
        params = self._params(m.adapter) if private else []
        outputs, total, weight, extra = [], 0.0, 0.0, {}
        for d in op.data:
            ids = torch.tensor([d.tokens], device=self.device)
            with torch.set_grad_enabled(not op.forward_only):
                logits = self.net(input_ids=ids).logits[0].float()
                target = torch.as_tensor(d.inputs["target_tokens"], device=self.device)
                logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
                loss = losses.loss(op.loss_fn, logp, d.inputs, op.loss_fn_config, op.extra.get("custom"), extra)
                if not op.forward_only:
                    loss.backward()
                    if private:
                        dpsgd.clip_into(params, m.dp_sums, m.dp["max_grad_norm"])  # type: ignore[index,arg-type]
            total += float(loss.detach())
            weight += float(d.inputs["weights"].sum()) if "weights" in d.inputs else len(d.tokens)
            outputs.append({"logprobs": logp.detach().cpu().numpy(),
                            "elementwise_loss": (-logp.detach().cpu().numpy()
                                                 * d.inputs.get("weights", np.ones(len(d.tokens), np.float32)))})
        return outputs, {"loss:sum": total, "loss:mean": total / max(weight, 1e-9),
                         **losses.reduce_metrics(extra, len(op.data))}

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """Apply the pending gradient (DP: noised) with ``adam``, atomically: every parameter is checked and the op
        linked before anything changes; a failure part-way restores the weights, the optimizer and the gradient."""
        import copy

        import torch

        m = self.get(model_id)
        check_adam(adam)
        dp = dict(m.dp) if m.dp is not None else None
        record: dict[str, Any] = {"op": "optim_step", "adam_params": dict(adam)}
        if dp is not None:
            record["dp_epsilon"] = dpsgd.account(dp)  # on a copy: m.dp changes only with the step
        new_head = link(m.op_head, record)
        params = self._params(m.adapter)
        weights = [p.detach().clone() for p in params]
        optimizer = copy.deepcopy(m.optimizer.state_dict())
        snapshot = self._grad_snapshot(m)
        try:
            if dp is not None:
                dpsgd.noisy_grads(params, m.dp_sums, dp)  # type: ignore[arg-type]
            grads = [p.grad for p in params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
            if adam["grad_clip_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
            for g in m.optimizer.param_groups:
                g.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
            m.optimizer.step()
            m.optimizer.zero_grad(set_to_none=True)
        except BaseException:
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            m.optimizer.load_state_dict(optimizer)
            self._grad_restore(m, snapshot)
            raise
        m.dp = dp
        m.steps += 1
        m.losses.append((m.steps, m.pending_loss))
        m.pending_loss, m.pending = 0.0, 0
        m.last_adam = dict(adam)
        m.op_head, m.ops = new_head, m.ops + 1
        metrics = {"grad_norm": norm, "step": float(m.steps)}
        if dp is not None:
            metrics["dp_epsilon"] = record["dp_epsilon"]
        return metrics

    # --- state -------------------------------------------------------------------------------------

    def adapter_bytes(self, m: Model) -> bytes:
        """The model's LoRA weights as the bytes of its ``adapter_model.safetensors`` (what a save writes)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        sd = get_peft_model_state_dict(self.model, adapter_name=m.adapter)
        return save({k: v.detach().cpu().contiguous() for k, v in sd.items()})

    def save(self, m: Model, dest: Path, *, optimizer: bool) -> None:
        """``dest``: a PEFT adapter repository (adapter_config.json, adapter_model.safetensors) + optimizer.pt."""
        import torch

        dest.mkdir(parents=True)
        (dest / "adapter_model.safetensors").write_bytes(self.adapter_bytes(m))
        cfg = self.model.peft_config[m.adapter]
        cfg.base_model_name_or_path = str(self.base_name)
        if isinstance(getattr(cfg, "auto_mapping", None), dict) and cfg.auto_mapping.get("unsloth_fixed"):
            cfg.auto_mapping = None  # Unsloth's marker, should it set one: the saved config is the hf backend's
        cfg.save_pretrained(str(dest))
        if optimizer:
            torch.save(m.optimizer.state_dict(), dest / "optimizer.pt")
        import json

        (dest / "progress.json").write_text(json.dumps({"steps": m.steps, "tokens_seen": m.tokens_seen,
                                                        "losses": m.losses, "custom_losses": m.custom_losses}))
        if m.dp is not None:  # the DP settings and spend: a model loaded from this state continues the accounting
            (dest / "dp.json").write_text(json.dumps(m.dp, sort_keys=True))

    def load(self, m: Model, src: Path, *, optimizer: bool, record: dict[str, Any]) -> None:
        """Replace the model's state with the saved state in ``src``, as the ``load`` op ``record``: everything is
        read and checked first (LoRA shapes, DP or not, optimizer state, progress), then applied; the model's chain
        continues from the saved state's (``record``'s checkpoint head and op count). Without ``optimizer`` the
        Adam state starts afresh. A pending gradient is refused: the load would drop it outside the chain.

        Raises:
            BadRequest: a pending gradient, a state of another LoRA shape, a DP mismatch, or a damaged state.
        """
        import json

        import torch
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        if m.pending:
            raise BadRequest(f"model {m.id} has the gradient of {m.pending} forward_backward op(s) not yet applied: "
                             "run optim_step first (a load would discard it)")
        saved = saved_dp(src)
        if (saved is None) != (m.dp is None):
            raise BadRequest("the saved state and the model differ in DP-SGD (one has it, the other not)")
        try:
            weights = load_file(str(src / "adapter_model.safetensors"), device=self.device)
            state = torch.load(src / "optimizer.pt", weights_only=True) if optimizer else None
            progress = json.loads((src / "progress.json").read_text()) if (src / "progress.json").is_file() else None
            steps, tokens = (int(progress["steps"]), int(progress["tokens_seen"])) if progress else (m.steps, m.tokens_seen)
            curve = [(int(a), float(b)) for a, b in progress["losses"]] if progress else list(m.losses)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise BadRequest(f"the saved state cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
        mine = get_peft_model_state_dict(self.model, adapter_name=m.adapter)
        shapes = {k: tuple(v.shape) for k, v in mine.items()}
        if {k: tuple(v.shape) for k, v in weights.items()} != shapes:
            raise BadRequest("the saved state's LoRA tensors do not fit this model (another rank or target layers)")
        params = self._params(m.adapter)
        fresh = fresh_optimizer(params)
        if state is not None:
            try:
                fresh.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise BadRequest(f"the saved optimizer state does not fit this model: {str(exc)[:200]}") from None
        new_head = link(record["checkpoint_head"], record)
        with torch.no_grad():
            set_peft_model_state_dict(self.model, weights, adapter_name=m.adapter)
        for p in params:
            p.grad = None
        m.optimizer = fresh
        m.steps, m.tokens_seen, m.losses, m.pending_loss = steps, tokens, curve, 0.0
        m.custom_losses = dict((progress or {}).get("custom_losses") or {})  # the loaded history's custom losses
        if saved is not None:
            m.dp = saved  # the accounting continues from the saved state's steps
            m.dp_sums = [torch.zeros_like(p) for p in params]
        m.op_head, m.ops = new_head, int(record["checkpoint_ops"]) + 1

    def discard(self, model_id: str) -> None:
        """Forget a model and its adapter (a model created for a load that was refused)."""
        m = self.models.pop(model_id, None)
        if m is not None:
            self.model.delete_adapter(m.adapter)

    base_name = "base"

    def sample(self, src: Path | None, prompt: list[int], **params: Any) -> bytes:
        """:func:`app.api.sampling.run` on the base, or on the sampler checkpoint at ``src`` (loaded once)."""
        adapter = None
        if src is not None:
            adapter = self.samplers.get(str(src))
            if adapter is None:
                if len(self.samplers) >= MAX_SAMPLERS:  # evict the oldest sampler adapter
                    self.model.delete_adapter(self.samplers.pop(next(iter(self.samplers))))
                adapter = f"s{next(self._names)}"
                from peft import LoraConfig
                from safetensors.torch import load_file
                from peft import set_peft_model_state_dict

                self.model.add_adapter(adapter, LoraConfig.from_pretrained(str(src)))
                set_peft_model_state_dict(self.model, load_file(str(src / "adapter_model.safetensors")),
                                          adapter_name=adapter)
                self.samplers[str(src)] = adapter
        self._activate(adapter or self.placeholder, False)
        decode = sampling.tokenizer_of(str(self.base_dir)).decode if params["stop"].strings else str  # checked
        return sampling.run(self.net, prompt, decode=decode, device=self.device, **params)


def saved_dp(src: Path) -> dict[str, Any] | None:
    """The DP settings and spend a saved state recorded (None: trained without DP)."""
    import json

    f = Path(src) / "dp.json"
    return json.loads(f.read_text()) if f.is_file() else None


def run_job(fn: Callable[[], tuple[bool, str, bytes]], finish: Callable[[bool, str, bytes], None]) -> Callable[[], None]:
    """A worker job: ``fn``'s result, or its refusal (category user) or failure (category server), is recorded."""
    import json

    def job() -> None:
        try:
            ok, ctype, body = fn()
        except ApiError as exc:
            ok, ctype, body = False, "application/json", json.dumps({"error": str(exc), "category": "user"}).encode()
        except Exception as exc:  # an engine failure fails this future only; the server keeps serving
            logger.exception("operation failed")
            ok, ctype, body = False, "application/json", json.dumps(
                {"error": f"{type(exc).__name__}: {exc}", "category": "server"}).encode()
        finish(ok, ctype, body)

    return job
