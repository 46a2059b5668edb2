"""precision=fp8: torchao's float8 training for a model's linear layers.

Each converted `nn.Linear` casts its input, weight and output gradient to float8 (e4m3 forward,
e5m2 gradients) with dynamic scales and multiplies on the float8 tensor cores; the weights stay
fp32 parameters, so the optimizer, checkpoints and the Hugging Face export do not change (a
`Float8Linear` has `nn.Linear`'s state dict, so the transform records nothing in checkpoints).
Everything else runs under the precision group's bf16 autocast. The conversion happens on the
bare model before any wrapper: DDP, FSDP2 (`fully_shard` then shards the float8 modules; with
`precision.fp8_all_gather` it gathers the weights in float8, and the transform precomputes
their scales after each step) and torch.compile, which fuses the casts and scales into the
neighbouring kernels (without it float8 is slower than bf16).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidformer.errors import EXIT_NOT_AVAILABLE, InputError, Problem
from rapidformer.transforms.base import ApplyContext, ModelTransform
from rapidformer.runtime.packages import installed

if TYPE_CHECKING:
    from rapidformer.config.schema import PrecisionConfig, RunConfig

log = logging.getLogger("rapidformer")

# float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
MIN_CAPABILITY = (8, 9)
INSTALL = "pip install 'rapidformer[fp8]' (torchao)"
SMALL = "too small to gain (precision.fp8_skip_small)"


def gains_from_float8(scaling: str, out_features: int, in_features: int) -> bool:
    """Whether a linear layer of this size runs faster in float8 than in bf16: torchao's
    measured thresholds (H100, forward + backward of the layer, float8 casts included)."""
    n, k = out_features, in_features
    if scaling == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def float8_filter(model: nn.Module, p: PrecisionConfig):
    """torchao's module filter: which linear layers become float8, and the reasons for the rest
    (reason -> count) filled in as it runs."""
    head = _output_head(model)
    left_out: dict[str, int] = {}

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        n, k = module.weight.shape
        reason = None
        if module is head:
            reason = "the output head"  # its logits feed the loss: kept at bf16's precision
        elif n % 16 or k % 16:
            reason = "a size not a multiple of 16"  # the float8 matmul's requirement
        elif p.fp8_skip_small and not gains_from_float8(p.fp8_scaling, n, k):
            reason = SMALL
        if reason:
            left_out[reason] = left_out.get(reason, 0) + 1
        return reason is None

    return convert, left_out


def float8_config(p: PrecisionConfig):
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(p.fp8_scaling)
    return dataclasses.replace(config, emulate=p.fp8_emulate,
                               enable_fsdp_float8_all_gather=p.fp8_all_gather)


def convert_to_float8(model: nn.Module, p: PrecisionConfig) -> nn.Module:
    """The model with its eligible linear layers swapped for torchao's Float8Linear, in place;
    refused when none is eligible (precision=fp8 would then be bf16 under another name)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise InputError(f"precision=fp8 needs torchao, which is not installed: {INSTALL}") \
            from exc
    keep, left_out = float8_filter(model, p)
    convert_to_float8_training(model, config=float8_config(p), module_filter_fn=keep)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    kept = ", ".join(f"{n} as {why}" for why, n in left_out.items()) or "none"
    if not converted:
        raise InputError(f"precision=fp8 found no linear layer to convert in "
                         f"{type(model).__name__} (left in bf16: {kept}); "
                         f"{_way_out(model, p, left_out)}")
    log.info("precision=fp8 (%s scaling%s): %d linear layers in float8; left in bf16: %s",
             p.fp8_scaling, ", emulated" if p.fp8_emulate else "", converted, kept)
    return model


def _way_out(model: nn.Module, p: PrecisionConfig, left_out: dict) -> str:
    if any(type(m).__name__ == "Conv1D" for m in model.modules()):
        return ("float8 converts torch.nn.Linear layers and this model's blocks are transformers' "
                "Conv1D layers (as in GPT-2): use a model with linear layers (model=llama_tiny "
                "or llama_1b, BERT, Hugging Face Llama/Qwen/Mistral), or precision=bf16")
    if left_out.get(SMALL):
        return ("its layers are too small to gain from float8: set "
                "precision.fp8_skip_small=false to convert them anyway (the way to check a tiny "
                "model's float8 numerics, with precision.fp8_emulate=true on a CPU), or use "
                "precision=bf16")
    return "use precision=bf16"


class Float8(ModelTransform):
    """precision=fp8 (precision.fp8_scaling set)."""

    name = "float8"

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.precision.fp8_scaling is not None

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [f"precision={cfg.precision.name}"]

    @classmethod
    def rounds_lengths(cls, cfg: RunConfig) -> bool:
        return cls.wanted(cfg)  # the weight-gradient matmul needs a multiple of 16 tokens

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        """torchao's float8 linear layers, in the torch strategies only, on batches of a
        multiple of 16 tokens."""
        from rapidformer.config.schema import PRETRAINING_TASKS

        pr, p = cfg.precision, []
        if pr.fp8_scaling is None:
            for key in ("fp8_all_gather", "fp8_emulate"):
                if getattr(pr, key):
                    p.append(f"precision.{key}=true without precision=fp8 (precision="
                             f"{pr.name}): it applies to float8 training only; add "
                             f"precision=fp8 or drop it")
            return p
        if pr.dtype != "bf16":
            p.append(f"precision.fp8_scaling={pr.fp8_scaling} with precision.dtype={pr.dtype}: "
                     f"float8 linear layers run with bf16 autocast for the rest of the model; "
                     f"use precision=fp8 (dtype bf16)")
        if cfg.model.source == "config" and cfg.model.arch == "gpt2":
            p.append(f"precision=fp8 with model={cfg.model.name}: float8 converts "
                     f"torch.nn.Linear layers and GPT-2's blocks are transformers' Conv1D "
                     f"layers; use a Llama-shaped model (model=llama_tiny, llama_1b) or "
                     f"precision=bf16")
        if cfg.model.is_megatron:
            p.append(f"precision=fp8 with model={cfg.model.name}: megatron-core's float8 needs "
                     f"Transformer Engine, which is not part of this build; use precision=bf16 "
                     f"with Megatron models, or precision=fp8 with a Hugging Face model")
        elif cfg.memory.name in ("zero1", "zero2", "zero3"):
            p.append(f"precision=fp8 with memory={cfg.memory.name}: DeepSpeed keeps its own "
                     f"bf16 weight copies and casts, which torchao's float8 layers do not go "
                     f"through; use memory=fsdp (FSDP2 shards float8 layers, optionally "
                     f"gathering them in float8) or memory=none")
        if cfg.graph.name == "ort":
            p.append("precision=fp8 with graph=ort: ONNX Runtime training runs fp32 on the CPU "
                     "here; use graph=compile")
        pad_to = cfg.data.pad_to
        if cfg.task.name not in PRETRAINING_TASKS and (
                pad_to == "longest" or (isinstance(pad_to, int) and pad_to % 16)
                or (pad_to == "max" and cfg.data.max_seq_length % 16)
                or (isinstance(pad_to, list) and any(int(b) % 16 for b in pad_to))):
            p.append(f"data.pad_to={pad_to} with precision=fp8: float8 matmuls need the batch's "
                     f"token count to be a multiple of 16; use multiples of 16 (or "
                     f"data.pad_to=auto)")
        if cfg.task.name in PRETRAINING_TASKS and \
                (cfg.trainer.micro_batch_size * cfg.data.max_seq_length) % 16:
            p.append(f"precision=fp8 with trainer.micro_batch_size="
                     f"{cfg.trainer.micro_batch_size} x data.max_seq_length="
                     f"{cfg.data.max_seq_length} tokens: float8 matmuls need a multiple of 16 "
                     f"tokens a micro-batch; change either")
        if pr.fp8_all_gather and (cfg.memory.name != "fsdp" or pr.fp8_scaling != "tensorwise"):
            p.append(f"precision.fp8_all_gather=true needs memory=fsdp and "
                     f"precision.fp8_scaling=tensorwise (this run: memory={cfg.memory.name}, "
                     f"{pr.fp8_scaling}): it gathers FSDP2's weight shards with one scale a "
                     f"tensor")
        return p

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        """torchao, and float8 tensor cores (unless it is emulated)."""
        p = cfg.precision
        if not installed("torchao"):
            return [Problem(f"precision=fp8 needs torchao, which is not installed: {INSTALL}",
                            EXIT_NOT_AVAILABLE)]
        if p.fp8_emulate:
            return []
        if device.type != "cuda":
            return [Problem(f"precision=fp8 needs a GPU with float8 tensor cores (compute "
                            f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer); "
                            f"this run is on '{device.type}'. Use precision=bf16, or "
                            f"precision.fp8_emulate=true to check the numerics (slow)")]
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return [Problem(f"precision=fp8: {torch.cuda.get_device_name(device)} has compute "
                            f"capability {capability[0]}.{capability[1]}, without float8 tensor "
                            f"cores (they start at {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                            f"Ada, Hopper); use precision=bf16")]
        return []

    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        return convert_to_float8(model, self.cfg.precision)

    def after_step(self, model: nn.Module) -> None:
        """FSDP2 with float8 all-gather (tensorwise scaling, as the config check requires):
        every float8 weight's scale in one all-reduce, instead of one per weight in the next
        forward pass."""
        if self.cfg.precision.fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
