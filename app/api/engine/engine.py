"""The training engine behind the API: the base model loaded once, one LoRA adapter per model, every operation run
on one worker thread, each model's in the order they were accepted (:mod:`app.api.engine.worker`); forward_backward ops of
different models waiting together share one base-model pass (:mod:`app.api.engine.packed`).

Each model keeps its adapter (PEFT, named ``m<N>``), its Adam optimizer over that adapter's parameters and its op
chain head (:mod:`attestation.outputs.op_chain`): ``forward_backward`` accumulates gradients, ``optim_step`` applies them with
the request's Adam parameters and clears them. Sampler checkpoints are loaded as adapters of their own, once.

The base is loaded by transformers + PEFT (backend ``hf``) or by Unsloth (``unsloth``, :mod:`app.api.engine.backend`); the
adapters, their ``LoraConfig`` and what is saved are the same on both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attestation.outputs.op_chain import GENESIS

from app.api import wire
from app.api.engine import dp as dpsgd
from app.api.engine import losses, packed, sample_batch
from app.api.engine.admission import free_memory
from app.api.errors import ApiError, BadRequest, NotFound
from app.api.engine.history import applied, check_adam, fresh_optimizer, link, opt_restore, opt_snapshot
from app.api.engine.sample_batch import SampleItem
from app.api.engine.worker import Job, Worker


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
LORA_ALPHA = 32
LORA_DROPOUT = 0.0


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
    dp: dict[str, Any] | None = None  # app.api.engine.dp settings and spend; None: no DP
    dp_sums: list[Any] | None = None  # the clipped per-datum gradients summed since the last optim_step
    pending: int = 0  # forward_backward ops whose gradient the next optim_step applies
    custom_losses: dict[str, Any] = field(default_factory=dict)  # id -> document of each custom loss its ops used


class Engine:
    def __init__(self, base_dir: Path, backend: str = "hf", cfg: Any = None) -> None:
        """``backend`` ``unsloth`` needs ``cfg`` (the configuration: the nightly run's Unsloth arguments)."""
        self.base_dir = Path(base_dir)
        self.backend = backend
        if backend == "unsloth":
            from app.api.engine import backend as api_backend

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
        self._cache: dict[str, list[Any]] = {}  # adapter -> its parameters (dropped when adapters change)
        self._layers: list[Any] | None = None  # the LoRA layers (dropped when adapters change)
        self._state: tuple[str | None, bool | None] = (None, None)  # active adapter, train mode
        self.packed = backend == "hf" and packed.install(self.model)  # packed passes possible
        rows = packed.pad_rows(self.device) if self.packed else 1  # the fewest rows a pass computes (exact replays)
        self.packed, self.pad_rows = self.packed and rows is not None, rows or 1
        self.token_bytes = packed.token_bytes(self.model) if self.packed else 0  # what a token of a pass holds
        self._ready: dict[int, Any] = {}  # id(op or sample request) -> its result from a packed pass or a batch
        self._worker = Worker(self._batch, packed.budget(free_memory(self.device)),
                              cfg.api.pack_wait_ms / 1000 if cfg is not None else 0.0, decode=self._decode,
                              sample_wait_s=cfg.api.sample_wait_ms / 1000 if cfg is not None else 0.0)

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

    def submit(self, job: Callable[[], None], model: str | None = None, op: wire.Op | None = None,
               ahead: bool = False, sample: SampleItem | None = None) -> None:
        """Queue ``job`` (acting on ``model``); ``op``: the forward_backward it runs, which may join a packed pass;
        ``ahead``: an optimizer step, taken before waiting passes; ``sample``: the sample request it decodes, which
        may join a batch of waiting ones (app.api.engine.worker, app.api.engine.sample_batch)."""
        packable = op is not None and self.packed
        joins = sample is not None and sample.joins and self.backend == "hf"  # PEFT's mixed-adapter batches
        self._worker.submit(Job(job, model, op if packable else None, self._cost([op]) if packable else 0, ahead,
                                sample if joins else None))

    def _batch(self, ops: list[wire.Op]) -> None:
        """The worker's packed pass: each op's result kept for its job (the ops that cannot join, run alone)."""
        items = []
        for op in ops:
            m = self.models.get(op.model_id)
            if m is None or not self._packs(op, m):
                continue
            try:
                losses.check_config(op.loss_fn, op.loss_fn_config)
            except ApiError as exc:
                self._ready[id(op)] = exc
                continue
            items.append((op, m))
        if len(items) > 1:
            try:
                results = packed.forward_backward(self, items)
            except BaseException as exc:  # the pass's own failure (an op's, a loss's, fails that op inside it)
                if packed.out_of_memory(exc, self.device):  # its ops run alone; later passes hold half as much
                    self._worker.lower(self._cost([op for op, _m in items]), len(items), self.device)
                raise
            self._worker.recover()  # a pass that fit: the budget climbs back (after an out-of-memory pass)
            for (op, _m), result in zip(items, results):
                self._ready[id(op)] = result

    def _cost(self, ops: list[wire.Op]) -> int:
        """What ``ops`` hold in a packed pass, against its budget (:func:`app.api.engine.packed.token_bytes`)."""
        return sum(op.n_tokens for op in ops) * self.token_bytes

    def _packs(self, op: wire.Op, m: Model) -> bool:
        """Whether ``op`` runs as a packed pass: decided by the op and its model alone, so the op computes alike
        whether other models' ops share its pass or not (and a replay of it alone reaches the same weights)."""
        return self.packed and m.dp is None and packed.pack_bytes(op.n_tokens, self.vocab) <= packed.PASS_BYTES

    @property
    def batching(self) -> dict[str, int]:
        return dict(self._worker.stats)

    @property
    def pass_budget(self) -> int:
        """Bytes a packed pass may hold (:func:`app.api.engine.packed.budget`)."""
        return self._worker.budget

    def stop(self, wait_s: float = 0.0) -> None:
        self._worker.stop(wait_s)

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
        self._changed()
        params = self._params(name)
        m = Model(model_id, name, lora, fresh_optimizer(params), dp=dict(dp) if dp else None)
        if m.dp:
            m.dp_sums = [torch.zeros_like(p) for p in params]
        self.models[model_id] = m
        return m

    def _params(self, adapter: str) -> list[Any]:
        got = self._cache.get(adapter)
        if got is None:
            got = self._cache[adapter] = [p for n, p in self.model.named_parameters() if f".{adapter}." in n]
        return got

    def lora_layers(self) -> list[Any]:
        """The model's LoRA layers (a packed pass routes them), looked up afresh when adapters change."""
        if self._layers is None:
            self._layers = packed.lora_layers(self.model)
        return self._layers

    def _changed(self) -> None:
        """Adapters were added or removed: parameter lists and the active adapter are looked up afresh."""
        self._cache.clear()
        self._layers = None
        self._state = (None, None)

    def get(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise NotFound(f"model {model_id} is not loaded on this server (a restart drops training state: create "
                           "a training client from its last saved state)")
        return m

    def _activate(self, adapter: str, train: bool) -> None:
        if self._state[0] != adapter:
            self.model.set_adapter(adapter)
            if self.backend == "unsloth":
                from app.api.engine.backend import route

                route(self.model, adapter)
            self._state = (adapter, None)
        for p in self._params(adapter):
            p.requires_grad_(train)
        self._mode(train)

    def _mode(self, train: bool) -> None:
        if self._state[1] != train:
            self.model.train(train)
            self._state = (self._state[0], train)

    # --- operations --------------------------------------------------------------------------------

    def forward_backward(self, op: wire.Op) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """One op, applied atomically: its gradient is added and the op linked into the chain, or (refused, or
        failed part-way) the model, its pending gradient and its DP sums are exactly as before."""
        if id(op) in self._ready:  # computed by the packed pass it joined
            return _outcome(self._ready.pop(id(op)))
        m = self.get(op.model_id)
        losses.check_config(op.loss_fn, op.loss_fn_config)  # every input checked before any state is touched
        if self._packs(op, m):
            return _outcome(packed.forward_backward(self, [(op, m)])[0])
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
        applied(m, op, new_head, metrics["loss:sum"])
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
                logp, datum_weight, output = losses.score(self.net(input_ids=ids).logits[0], d)
                loss = losses.loss(op.loss_fn, logp, d.inputs, op.loss_fn_config, op.extra.get("custom"), extra)
                if not op.forward_only:
                    loss.backward()
                    if private:
                        dpsgd.clip_into(params, m.dp_sums, m.dp["max_grad_norm"])  # type: ignore[index,arg-type]
            total += float(loss.detach())
            weight += datum_weight
            outputs.append(output)
        return outputs, losses.op_metrics(total, weight, extra, len(op.data))

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """Apply the pending gradient (DP: noised) with ``adam``, atomically: every parameter is checked and the op
        linked before anything changes; a failure part-way restores the weights, the optimizer and the gradient."""
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
        optimizer = opt_snapshot(m.optimizer)
        clips = adam["grad_clip_norm"] > 0
        snapshot = self._grad_snapshot(m) if dp is not None or clips else None  # else the step leaves grads as is
        try:
            if dp is not None:
                dpsgd.noisy_grads(params, m.dp_sums, dp)  # type: ignore[arg-type]
            grads = [p.grad for p in params if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            if clips:
                torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
            for g in m.optimizer.param_groups:
                g.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
            m.optimizer.step()
            if not torch.isfinite(torch.nn.utils.get_total_norm(params, norm_type=float("inf"))):  # an inf or a NaN
                raise BadRequest("the step would make weights non-finite (learning_rate and weight_decay too large "
                                 "for them); nothing was applied")
            m.optimizer.zero_grad(set_to_none=True)
        except BaseException:
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            opt_restore(m.optimizer, optimizer)
            if snapshot is not None:
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
        """:func:`app.api.engine.loading.load`: the saved state in ``src`` replaces the model's, as the ``load`` op ``record``."""
        from app.api.engine.loading import load

        load(self, m, src, optimizer=optimizer, record=record)

    def discard(self, model_id: str) -> None:
        """Forget a model and its adapter (a model created for a load that was refused)."""
        m = self.models.pop(model_id, None)
        if m is not None:
            self.model.delete_adapter(m.adapter)
            self._changed()

    base_name = "base"

    def sample(self, src: Path | None, prompt: list[int], **params: Any) -> bytes:
        """One sample request decoded alone, on the base or through the sampler checkpoint at ``src`` (loaded
        once): :func:`app.api.engine.sample_batch.decode_alone`."""
        return sample_batch.decode_alone(self, src, prompt, params)

    def sample_request(self, item: SampleItem) -> bytes:
        """A sample request's response: decoded in the batch its job joined, else alone."""
        if id(item) in self._ready:
            return _outcome(self._ready.pop(id(item)))
        with item.checkpoint() as src:
            return self.sample(src, item.prompt, **item.params)

    def _decode(self, items: list[SampleItem]) -> None:
        sample_batch.decode_together(self, items)


def _outcome(done: Any) -> Any:
    """A forward_backward's result from a packed pass: returned, or its refusal raised."""
    if isinstance(done, BaseException):
        raise done
    return done
