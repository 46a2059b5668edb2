"""AdamW with the usual no-decay groups, and the lr schedule (warm-up, then decay to min_lr)."""
from __future__ import annotations

import math

import torch

from rapidformer.config.schema import OptimConfig, SchedulerConfig

# biases and normalization weights are not decayed (BERT's recipe, and everyone's since)
NO_DECAY_MARKERS = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight", "ln_")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or any(marker in name for marker in NO_DECAY_MARKERS)
        (no_decay if skip else decay).append(param)
    # an empty group is left out (peft: every bias and norm is frozen), as DeepSpeed's
    # optimizer drops it, which would leave the lr schedule a group without an optimizer's
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def fused_available(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu", "xpu", "mps")


def build_optimizer(model: torch.nn.Module, o: OptimConfig, lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.Optimizer:
    fused = o.fused == "on" or (o.fused == "auto" and fused_available(device))
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr,
                             betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)


def warmup_iters(s: SchedulerConfig, total_iters: int) -> int:
    if s.warmup_fraction is not None:
        return int(round(s.warmup_fraction * total_iters))
    return s.warmup_iters


def lr_multiplier(step: int, s: SchedulerConfig, total_iters: int, lr: float) -> float:
    """lr(step) / lr: linear warm-up from 0, then constant, linear or cosine decay to min_lr.

    `step` counts optimizer steps already taken, so the first step (step=0) of a warm-up uses
    lr/warmup rather than 0 — as Megatron does (it warms up over iteration+1).
    """
    warmup = warmup_iters(s, total_iters)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if s.name == "constant":
        return 1.0
    decay_end = s.decay_iters or total_iters
    span = max(decay_end - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if s.name == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = s.min_lr / lr if lr > 0 else 0.0
    return floor + (1.0 - floor) * coeff


def build_scheduler(optimizer, s: SchedulerConfig, total_iters: int, lr: float):
    multiplier = lambda step: lr_multiplier(step, s, total_iters, lr)  # noqa: E731
    if isinstance(optimizer, torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    return ParamGroupSchedule(optimizer, multiplier, lr)


class ParamGroupSchedule:
    """The same schedule for an optimizer that is not a torch Optimizer (megatron-core's, which
    torch's schedulers refuse): it sets the lr of every parameter group, as LambdaLR does."""

    def __init__(self, optimizer, multiplier, lr: float):
        self.optimizer, self.multiplier, self.base_lr = optimizer, multiplier, lr
        self.last_epoch = 0
        self._apply()

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self.multiplier(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = state["last_epoch"]
        self._apply()
