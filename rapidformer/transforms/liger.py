"""kernels=liger: liger-kernel's Triton kernels swapped into a Hugging Face model.

liger-kernel patches a model instance of a family it knows (Llama, Mistral, Qwen, Gemma, ...):
RMSNorm, the SwiGLU MLP and the rotary embedding become its kernels, and the causal LM's forward
becomes one that, when it is given labels in training, runs the output head and the
cross-entropy chunk by chunk in one kernel (the [tokens, vocab] logits never exist: on a 50k
vocabulary at 8 x 2048 tokens that is 3.3 GB of bf16 logits and as much for their gradient).
The rotary patch replaces the family module's function, process-wide, as liger-kernel does.

kernels=auto (the default) applies them where they measured faster: task=sft on a CUDA GPU, a
family liger-kernel covers, liger-kernel installed (LoRA SFT of a Llama 3.2 1B shape on one
H200: +23 % real tokens/s and 4 GB less than the labelled head alone, docs/benchmarks.md);
anywhere else the model's own layers, and the log line says which and why. Not for causal LM
pretraining: a 1B Llama held 6 GB less but ran at 0.75x the tokens/s (docs/benchmarks.md), so
auto leaves it to kernels=liger.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from rapidformer.errors import EXIT_NOT_AVAILABLE, InputError, Problem
from rapidformer.transforms.base import ApplyContext, ModelTransform
from rapidformer.models.pretrained_shape import known_model_type
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
    if problem := family_problem(model_type or "unknown"):
        raise InputError(f"kernels=liger on {type(model).__name__}: {problem}. Use kernels=none")
    # liger-kernel passes on only the switches a family's patch takes (Gemma's MLP is GeGLU:
    # no swiglu): one it does not take is not applied, which the log says, and one turned off
    # that it would not apply anyway changes nothing
    takes = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    switches = {name: getattr(k, name) for name in SWITCHES if name in takes}
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, **switches)
    setattr(model, FUSED_LOSS_MARK, bool(switches.get("fused_linear_cross_entropy")))
    log.info("kernels=liger on %s: %s%s", model_type,
             " ".join(f"{name}={on}" for name, on in switches.items()),
             "".join(f"; {name}: not a {model_type} kernel" for name in SWITCHES
                     if name not in takes))


def family_problem(model_type: str | None) -> str | None:
    """Why liger-kernel cannot patch a model of `model_type`, or None (also when the type is
    not known yet, or liger-kernel is not installed: that is an environment problem)."""
    if model_type is None or not installed("liger_kernel"):
        return None
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - installed but broken (triton, transformers): applying
        return None  # it says so, with liger-kernel's own error

    if model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return None
    return (f"liger-kernel has no kernels for model type '{model_type}'; it covers "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}")


def fuses_the_loss(k: KernelsConfig) -> bool:
    """Whether a causal LM's training forward computes its loss itself, from shifted labels,
    without logits (liger-kernel's fused linear cross-entropy). kernels=auto decides on the
    model (`auto_choice`): a task asks the model (`applied_fused_loss`), not the config."""
    return k.name == "liger" and k.fused_linear_cross_entropy


# kernels=auto: the tasks where liger-kernel measured faster than the model's own layers
AUTO_TASKS = ("sft",)


def auto_choice(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> str | None:
    """Why kernels=auto leaves `model` its own layers here, or None when liger applies."""
    if cfg.task.name not in AUTO_TASKS:
        return f"task={cfg.task.name}: liger-kernel is measured faster for task=sft only"
    if device.type != "cuda":
        return f"the run is on '{device.type}' (liger-kernel's kernels run on CUDA GPUs)"
    if not installed("liger_kernel"):
        return f"liger-kernel is not installed ({INSTALL})"
    return family_problem(getattr(getattr(model, "config", None), "model_type", None)
                          or "unknown")


def applied_fused_loss(model: torch.nn.Module) -> bool:
    """Whether liger-kernel's fused linear cross-entropy computes `model`'s training loss."""
    return getattr(model, FUSED_LOSS_MARK, False)


FUSED_LOSS_MARK = "_rapidformer_liger_fused_loss"


def whole_model_compile_problem(model: torch.nn.Module) -> str | None:
    """Why torch.compile cannot take `model` whole, or None. liger-kernel's fused loss adds
    each chunk's bf16 weight gradient into an fp32 one (`torch.addmm(out_dtype=float32)`, the
    output layer's fp32 weight under autocast), which dynamo fails to trace ("RuntimeError when
    making fake tensor call": torch 2.11 on one H200, the 1B Llama pretraining row), so the
    first step failed. The blocks compile; the head and loss are liger's kernels either way."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not applied_fused_loss(model) or head is None or not head.weight.requires_grad:
        return None  # a frozen head (LoRA) gets no weight gradient: compiled whole, measured
    return ("liger-kernel's fused loss trains the output layer, whose fp32 gradient "
            "accumulation torch.compile cannot trace")


class LigerKernels(ModelTransform):
    """kernels=liger."""

    name = "liger"
    before_move = True  # before peft wraps the modules it patches (TRANSFORMS' order)

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.kernels.name != "none"

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [f"kernels={cfg.kernels.name}"] if cfg.kernels.name == "liger" else []

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        m = cfg.model
        if cfg.kernels.name != "liger" or not (m.is_megatron or cfg.graph.name == "ort"):
            return []
        return [f"kernels={cfg.kernels.name} with "
                f"{'model=' + m.name if m.is_megatron else 'graph=ort'}: its kernels patch "
                f"Hugging Face models trained by torch; use kernels=none"]

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        if cfg.kernels.name == "auto":
            return []  # it decides on the model, never refuses (auto_choice)
        if device.type != "cuda":
            return [Problem(f"kernels=liger runs Triton kernels on CUDA GPUs; this run is on "
                            f"'{device.type}'. Use kernels=none")]
        if not installed("liger_kernel"):
            return [Problem(f"kernels=liger needs liger-kernel, which is not installed: "
                            f"{INSTALL}", EXIT_NOT_AVAILABLE)]
        # the family, where this machine knows it before the model is built (the installed
        # liger-kernel's coverage, a pretrained model's config.json): a BERT is refused here,
        # not after its weights are read, and accelerate=auto never measures it
        m = cfg.model
        problem = family_problem(known_model_type(m))
        if problem is None:
            return []
        where = f"model.name_or_path={m.name_or_path} (its config.json)" \
            if m.source == "pretrained" else f"model={m.name} (model.arch={m.arch})"
        return [Problem(f"kernels=liger with {where}: {problem}. Use kernels=none")]

    def apply(self, model: torch.nn.Module, context: ApplyContext) -> torch.nn.Module:
        k = self.cfg.kernels
        if k.name == "auto":
            m = self.cfg.model
            why_not = ("the model is not a Hugging Face model trained by torch"
                       if m.is_megatron or self.cfg.graph.name == "ort"
                       else auto_choice(self.cfg, model, context.device))
            if why_not:
                log.info("kernels=auto: the model's own layers (%s)", why_not)
                return model
            log.info("kernels=auto: liger-kernel (task=%s on a CUDA GPU; kernels=none turns "
                     "it off)", self.cfg.task.name)
            k = replace(k, name="liger")
        head = adapted_output_layer(self.cfg, model)
        if head and k.fused_linear_cross_entropy:
            # its loss reads the output layer's weight itself: peft's adapters on that layer
            # would never train
            log.info("kernels=liger: fused_linear_cross_entropy=False, as peft adapts the output "
                     "layer (%s), whose adapters the fused loss does not read", head)
            k = replace(k, fused_linear_cross_entropy=False)
        apply_kernels(model, k)
        return model


def adapted_output_layer(cfg: RunConfig, model: torch.nn.Module) -> str | None:
    """The output layer's name where peft.target_modules names it (LoRA adapters on it)."""
    from rapidformer.transforms.lora_layers import matches

    targets = cfg.peft.target_modules if cfg.peft.name != "none" else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not targets or head is None:
        return None
    return next((name for name, module in model.named_modules() if module is head
                 and any(matches(name, t) for t in targets)), None)
