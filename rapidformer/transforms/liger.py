"""kernels=liger: liger-kernel's Triton kernels swapped into a Hugging Face model.

liger-kernel patches a model instance of a family it knows (Llama, Mistral, Qwen, Gemma, ...):
RMSNorm, the SwiGLU MLP and the rotary embedding become its kernels, and the causal LM's forward
becomes one that, when it is given labels in training, runs the output head and the
cross-entropy chunk by chunk in one kernel (the [tokens, vocab] logits never exist: on a 50k
vocabulary at 8 x 2048 tokens that is 3.3 GB of bf16 logits and as much for their gradient).
The rotary patch replaces the family module's function, process-wide, as liger-kernel does.
"""
from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch

from rapidformer.errors import EXIT_NOT_AVAILABLE, InputError, Problem
from rapidformer.transforms.base import ApplyContext, ModelTransform
from rapidformer.runtime.packages import installed

if TYPE_CHECKING:
    from rapidformer.config.schema import KernelsConfig, RunConfig

log = logging.getLogger("rapidformer")

INSTALL = "pip install 'rapidformer[liger]' (liger-kernel)"
SWITCHES = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")


def apply_kernels(model: torch.nn.Module, k: KernelsConfig) -> None:
    """Patch `model` in place with the configured kernels (kernels=none: nothing)."""
    if k.name == "none":
        return
    try:
        from liger_kernel.transformers.monkey_patch import (MODEL_TYPE_TO_APPLY_LIGER_FN,
                                                            _apply_liger_kernel_to_instance)
    except ImportError as exc:
        raise InputError(f"kernels=liger needs liger-kernel, which is not installed: {INSTALL}") \
            from exc
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise InputError(f"kernels=liger: liger-kernel has no kernels for model type "
                         f"'{model_type}' ({type(model).__name__}); it covers "
                         f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}. Use kernels=none")
    # liger-kernel passes on only the switches a family's patch takes (Gemma's MLP is GeGLU:
    # no swiglu): one it does not take is not applied, which the log says, and one turned off
    # that it would not apply anyway changes nothing
    takes = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    switches = {name: getattr(k, name) for name in SWITCHES if name in takes}
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, **switches)
    log.info("kernels=liger on %s: %s%s", model_type,
             " ".join(f"{name}={on}" for name, on in switches.items()),
             "".join(f"; {name}: not a {model_type} kernel" for name in SWITCHES
                     if name not in takes))


def fuses_the_loss(k: KernelsConfig) -> bool:
    """Whether a causal LM's training forward computes its loss itself, from shifted labels,
    without logits (liger-kernel's fused linear cross-entropy)."""
    return k.name == "liger" and k.fused_linear_cross_entropy


class LigerKernels(ModelTransform):
    """kernels=liger."""

    name = "liger"
    before_move = True  # before peft wraps the modules it patches (TRANSFORMS' order)

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.kernels.name != "none"

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [f"kernels={cfg.kernels.name}"]

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        m = cfg.model
        if cfg.kernels.name == "none" or not (m.is_megatron or cfg.graph.name == "ort"):
            return []
        return [f"kernels={cfg.kernels.name} with "
                f"{'model=' + m.name if m.is_megatron else 'graph=ort'}: its kernels patch "
                f"Hugging Face models trained by torch; use kernels=none"]

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        if device.type != "cuda":
            return [Problem(f"kernels=liger runs Triton kernels on CUDA GPUs; this run is on "
                            f"'{device.type}'. Use kernels=none")]
        if not installed("liger_kernel"):
            return [Problem(f"kernels=liger needs liger-kernel, which is not installed: "
                            f"{INSTALL}", EXIT_NOT_AVAILABLE)]
        return []

    def apply(self, model: torch.nn.Module, context: ApplyContext) -> torch.nn.Module:
        apply_kernels(model, self.cfg.kernels)
        return model
