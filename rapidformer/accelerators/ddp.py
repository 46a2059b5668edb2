"""memory=none: one process, or torch DistributedDataParallel over several; the torch optimizer
and torch.amp precision (bf16 autocast, fp16 with a GradScaler).

Every rank holds the whole model and optimizer state; a checkpoint is rank 0's copy of them
(`model.pt`, `optimizer.pt`, `scheduler.pt`, `precision.pt`; `model.pt` holds what the state
filter says: the whole model, or the parameters that train where a transform freezes a base).
graph=compile compiles the whole model around DDP (graph.scope=auto), or each transformer
block inside it.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from rapidformer.accelerators.base import StateBytes, StepResult, Strategy
from rapidformer.transforms.base import WHOLE_MODEL
from rapidformer.accelerators.graph import apply_graph, compile_blocks
from rapidformer.accelerators.precision import MixedPrecision
from rapidformer.checkpoint import store

log = logging.getLogger("rapidformer")


class DDPStrategy(Strategy):
    name = "ddp"

    @classmethod
    def state_bytes(cls, cfg) -> StateBytes:
        # torch autocast casts per op: fp32 weights and gradients, AdamW's two fp32 moments
        # and an fp32 residual stream, whole on every rank; nothing offloads
        return StateBytes(weights=4, gradients=4, optimizer=8, residual=4)

    # buffer_bytes: none; gradient_as_bucket_view=True makes the gradients DDP's buckets

    def __init__(self, cfg, plan, rank, world_size, state_filter=WHOLE_MODEL):
        super().__init__(cfg, plan, rank, world_size, state_filter)
        self.precision = MixedPrecision(cfg.precision, self.device)
        self.ddp = None

    # --- building ---------------------------------------------------------------------------
    def wrap(self, model, optimizer, build_scheduler):
        model = self.inner_graph(model)
        optimizer = optimizer if optimizer is not None else self.build_optimizer(model)
        lr_scheduler = build_scheduler(optimizer)
        if self.world_size > 1:
            model = self.ddp = self._distributed(model)
        model = apply_graph(model, self.cfg.graph, self.compiles_blocks)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        return model, optimizer, lr_scheduler

    def inner_graph(self, model):
        """The graph seam inside the data-parallel wrapper: compiled blocks (graph.scope=blocks)."""
        return compile_blocks(model, self.cfg.graph, self.compiles_blocks)

    def _distributed(self, model):
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        p = self.cfg.parallelism
        # gradients live in the reduction buckets: no copy in or out, one buffer less
        model = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=p.ddp_bucket_cap_mb,
                                        gradient_as_bucket_view=True)
        if p.ddp_comm_hook == "bf16_compress":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return model

    # --- the step ---------------------------------------------------------------------------
    def autocast(self):
        return self.precision.autocast()

    def accumulate(self, last_micro_batch: bool):
        """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
        if self.ddp is None or last_micro_batch:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def backward(self, loss, accumulation_steps: int) -> None:
        self.precision.scale(loss / accumulation_steps).backward()

    def step(self) -> StepResult:
        clip = self.cfg.trainer.clip_grad
        self.precision.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clips_in_optimizer():
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params
                                                       if p.grad is not None], foreach=True)
            if clip > 0:
                # the fused kernel divides each gradient by grad_scale as it reads it: clipping
                # without a pass of its own over the gradients (GradScaler's hook, unused here)
                self.optimizer.grad_scale = ((grad_norm + 1e-6) / clip).clamp(min=1.0)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor norm over all shards
                grad_norm = grad_norm.full_tensor()
        try:
            stepped = self.precision.step(self.optimizer)
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stepped, grad_norm, self.loss_scale, self.skipped_steps)

    def clips_in_optimizer(self) -> bool:
        """Whether clipping folds into the optimizer step: a fused torch optimizer (it takes a
        gradient divisor, the hook GradScaler uses) and no loss scaler of its own using that
        hook."""
        o = self.optimizer
        return (isinstance(o, torch.optim.Optimizer) and bool(o.defaults.get("fused"))
                and getattr(o, "_step_supports_amp_scaling", False)
                and self.precision.scaler is None)

    # --- checkpoints ------------------------------------------------------------------------
    def _schedule_and_precision(self) -> dict:
        return {"scheduler.pt": self.lr_scheduler.state_dict() if self.lr_scheduler else {},
                "precision.pt": self.precision.state_dict()}

    def _load_schedule_and_precision(self, directory: Path) -> None:
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(store.load(directory, "scheduler.pt"))
        self.precision.load_state_dict(store.load(directory, "precision.pt"))

    def save(self, directory: Path) -> dict:
        model = self.unwrap(self.model)
        return {"model.pt": self.state_filter.state_dict(model),
                "optimizer.pt": self.optimizer.state_dict(), **self._schedule_and_precision()}

    def load(self, directory: Path) -> None:
        model, state = self.unwrap(self.model), store.load(directory, "model.pt")
        whole = self.state_filter.saves_frozen
        result = model.load_state_dict(state, strict=whole)
        if not whole:
            self.state_filter.loaded(model, result.missing_keys, result.unexpected_keys,
                                     directory)
        self.optimizer.load_state_dict(store.load(directory, "optimizer.pt"))
        self._load_schedule_and_precision(directory)

    @classmethod
    def read_weights(cls, checkpoint_dir: Path) -> dict:
        return store.load(checkpoint_dir, "model.pt")

