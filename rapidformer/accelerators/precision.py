"""Mixed precision with torch.amp: bf16 autocast, or fp16 autocast with dynamic loss scaling.

Weights and optimizer state stay fp32 (autocast casts per op), so checkpoints and the
Hugging Face export are fp32 whatever the precision.
"""
from __future__ import annotations

import contextlib

import torch

from rapidformer.config.schema import PrecisionConfig
from rapidformer.errors import ConfigError
from rapidformer.models.dtypes import DTYPES


def compute_bytes(p: PrecisionConfig) -> int:
    """Bytes per element of the compute dtype: 2 for bf16 and fp16 (precision=fp8's layers
    outside float8 run bf16), 4 for fp32."""
    return DTYPES[p.dtype].itemsize


def precision_problems(p: PrecisionConfig, device: torch.device) -> list[str]:
    """What `device` lacks for the compute precision (autocast, bf16)."""
    if p.dtype == "fp32":
        return []
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return [f"precision={p.name}: autocast is not available on device '{device.type}'; use "
                f"precision=fp32"]
    if device.type == "cuda" and p.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        return [f"precision=bf16: this GPU ({torch.cuda.get_device_name(device)}) has no bf16 "
                f"support; use precision=fp16"]
    return []


def check_device_supports(p: PrecisionConfig, device: torch.device) -> None:
    if problems := precision_problems(p, device):
        raise ConfigError(problems)


class MixedPrecision:
    """Autocast context plus, for fp16, a GradScaler whose skipped steps are counted."""

    def __init__(self, p: PrecisionConfig, device: torch.device):
        check_device_supports(p, device)
        self.dtype = DTYPES[p.dtype]
        self.device = device
        self.enabled = p.dtype != "fp32"
        self.scaler = (torch.amp.GradScaler(device.type, init_scale=p.initial_scale,
                                            growth_interval=p.growth_interval)
                       if p.dtype == "fp16" else None)
        self.skipped_steps = 0

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_(self, optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        """Optimizer step; False when fp16 found inf/nan gradients and skipped it."""
        if not self.scaler:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # the scale only shrinks when the step was skipped for overflowing gradients
        skipped = self.scaler.get_scale() < before
        self.skipped_steps += int(skipped)
        return not skipped

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler else None

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
