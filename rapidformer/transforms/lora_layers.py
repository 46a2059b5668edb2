"""peft=lora/qlora: which layers of a Hugging Face model get LoRA adapters (the family's
attention and MLP projections unless peft.target_modules names them), which train in full (a
task's head, peft.modules_to_save), the fingerprint of the frozen base a checkpoint's adapters
belong to, and qlora's 4-bit linear layers (bitsandbytes)."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidformer.errors import ConfigError, NotAvailableError
from rapidformer.models.blocks import transformer_blocks

if TYPE_CHECKING:
    from rapidformer.config.schema import PeftConfig

INSTALL = "pip install 'rapidformer[peft]' (peft>=0.21,<0.22)"
BNB_INSTALL = "pip install bitsandbytes"
LLAMA_FAMILY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the layers LoRA adapts when peft.target_modules is null, by Hugging Face model type
DEFAULT_TARGETS = {"llama": LLAMA_FAMILY, "mistral": LLAMA_FAMILY, "qwen2": LLAMA_FAMILY,
                   "qwen3": LLAMA_FAMILY, "gpt2": ("c_attn", "c_proj", "c_fc"),
                   "bert": ("query", "key", "value", "dense")}
# the heads peft's task types train in full beside the adapters (peft adds them itself)
TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
              "QUESTION_ANS": ("qa_outputs",)}
# values of each frozen tensor that the fingerprint reads, evenly spread: any retraining or
# another checkpoint of the base changes them, and hashing stays cheap at any model size
FINGERPRINT_SAMPLES = 1024
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def import_peft():
    try:
        import peft
    except ImportError as exc:
        raise NotAvailableError(f"peft=lora/qlora needs peft, which is not installed: "
                                f"{INSTALL}") from exc
    return peft


# --- what gets adapters ----------------------------------------------------------------------

def matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of names: the module's full name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def linear_layer_names(model: nn.Module) -> list[str]:
    """The last name part of every linear layer (nn.Linear, GPT-2's Conv1D): what
    peft.target_modules can name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if name and (isinstance(m, nn.Linear) or is_conv1d(m))})


def module_names(model: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name})


def target_modules(model: nn.Module, p: PeftConfig) -> list[str]:
    if p.target_modules is not None:
        return list(p.target_modules)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGETS:
        names = linear_layer_names(model)
        raise ConfigError([f"peft.target_modules=null: {type(model).__name__} (model type "
                           f"{model_type}) has no default LoRA targets (the defaults cover "
                           f"{', '.join(DEFAULT_TARGETS)}); name its linear layers to adapt, "
                           f"e.g. peft.target_modules=[{','.join(names[:2])}] (it has: "
                           f"{', '.join(names)})"])
    return list(DEFAULT_TARGETS[model_type])


def check_names(model: nn.Module, names: list[str], key: str, known: list[str]) -> None:
    """A name that matches no module of the model is refused with the names it has."""
    modules = [name for name, _ in model.named_modules() if name]
    unmatched = [n for n in names if not any(matches(m, n) for m in modules)]
    if unmatched:
        raise ConfigError([f"{key}: {', '.join(unmatched)} match{'es' * (len(unmatched) == 1)} "
                           f"no module of {type(model).__name__}; its "
                           f"{'linear layers' if key == 'peft.target_modules' else 'modules'} "
                           f"are named {', '.join(known)}: choose among them"])


def task_type(model: nn.Module) -> str | None:
    """peft's task type of a transformers model class (None: a plain peft model)."""
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    for mapping, task in ((auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "SEQ_CLS"),
                          (auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "TOKEN_CLS"),
                          (auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, "QUESTION_ANS"),
                          (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "CAUSAL_LM"),
                          (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "SEQ_2_SEQ_LM")):
        classes = {c for v in mapping.values() for c in (v if isinstance(v, tuple) else (v,))}
        if name in classes:
            return task
    return None


def trained_in_full(model: nn.Module, p: PeftConfig, task: str | None) -> list[str]:
    """peft.modules_to_save and the task's head where the model has one."""
    heads = [h for h in TASK_HEADS.get(task, ()) if any(matches(n, h) for n, _ in
                                                        model.named_modules())]
    return list(dict.fromkeys([*(p.modules_to_save or []), *heads]))


def lora_config(model: nn.Module, p: PeftConfig, targets: list[str], task: str | None):
    peft = import_peft()
    # GPT-2's Conv1D stores its weight as (in, out): LoRA's update is transposed for it
    conv1d = any(is_conv1d(m) and any(matches(n, t) for t in targets)
                 for n, m in model.named_modules())
    config = peft.LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                             target_modules=targets, modules_to_save=p.modules_to_save or None,
                             task_type=task, fan_in_fan_out=conv1d, bias="none")
    if p.fused:
        from rapidformer.transforms.lora_fused import register

        register(config)
    return config


# --- the frozen base -------------------------------------------------------------------------

def in_modules(param_name: str, modules: list[str]) -> bool:
    parts = param_name.split(".")[:-1]
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(matches(prefix, m) for prefix in prefixes for m in modules)


def base_fingerprint(model: nn.Module, full: list[str]) -> str:
    """sha256 over the base's tensors that stay frozen (every parameter outside `full`): each
    one's name, shape, dtype and FINGERPRINT_SAMPLES of its values."""
    digest = hashlib.sha256()
    for name, tensor in model.named_parameters():
        if in_modules(name, full):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() and not flat.is_meta:
            index = sample_positions(flat.numel(), flat.device)
            digest.update(flat[index].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def sample_positions(numel: int, device=None) -> torch.Tensor:
    """FINGERPRINT_SAMPLES positions spread evenly over a tensor of `numel` values (all of a
    smaller one), computed in float64: float32 rounds the last position of a Llama 3 embedding
    (262,668,288 values) past its end."""
    return torch.linspace(0, numel - 1, min(numel, FINGERPRINT_SAMPLES), device=device,
                          dtype=torch.float64).long()


def quantize_blocks(model: nn.Module, p: PeftConfig, precision_dtype: str) -> None:
    """qlora: every nn.Linear of the transformer blocks becomes a bitsandbytes Linear4bit that
    holds the same weight and quantizes it (quant_type, double quantization of the scales) when
    the engine moves the model to the GPU; it computes in the precision group's dtype."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=p.quant_type,
                           bnb_4bit_use_double_quant=p.double_quant,
                           bnb_4bit_compute_dtype=COMPUTE_DTYPES[precision_dtype])
    layers = [(block, name, layer) for block in transformer_blocks(model)
              for name, layer in block.named_modules()]
    conv1d = sorted({name.rsplit(".", 1)[-1] for _, name, layer in layers if is_conv1d(layer)})
    if conv1d:
        raise ConfigError([f"peft=qlora with {type(model).__name__}: bitsandbytes quantizes "
                           f"torch.nn.Linear layers, and its {', '.join(conv1d)} are "
                           f"transformers' Conv1D layers; use peft=lora, or a Llama-family "
                           f"model"])
    for block, name, layer in layers:
        if type(layer) is nn.Linear:
            block.set_submodule(name, _four_bit(bnb, layer, q))
    # the flag transformers' 4-bit loader sets: peft reads it to give Linear4bit layers its
    # 4-bit LoRA layers, and prepare_model_for_kbit_training to treat the model as quantized
    model.is_loaded_in_4bit = True


def _four_bit(bnb, layer: nn.Linear, q) -> nn.Module:
    four = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                             compute_dtype=q.bnb_4bit_compute_dtype,
                             compress_statistics=q.bnb_4bit_use_double_quant,
                             quant_type=q.bnb_4bit_quant_type,
                             quant_storage=q.bnb_4bit_quant_storage, device="meta")
    four.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False,
                                    compress_statistics=q.bnb_4bit_use_double_quant,
                                    quant_type=q.bnb_4bit_quant_type,
                                    quant_storage=q.bnb_4bit_quant_storage, module=four)
    if layer.bias is not None:
        four.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    return four


def frozen_base_dtype(model: nn.Module, p: PeftConfig, precision_dtype: str) -> torch.dtype:
    """The dtype the frozen base is held in (peft.base_dtype). Under bf16 autocast a frozen
    fp32 weight is cast to bf16 by every forward anyway, so holding it in bf16 computes the same
    and halves its memory; it also keeps the residual stream and what is saved for the backward
    in bf16 (fp32 embeddings or norms make every activation after them fp32). `auto` holds it in
    bf16 where no value changes: a base whose frozen weights are all bf16 values (a bf16
    checkpoint, as most LLMs are published), and qlora's base, whose block weights are 4-bit
    already. fp16 keeps fp32: a half-precision residual stream can overflow."""
    if p.base_dtype == "fp32" or precision_dtype != "bf16":
        return torch.float32
    if p.base_dtype == "bf16" or p.name == "qlora":
        return torch.bfloat16
    frozen = [t for t in model.parameters() if not t.requires_grad and t.is_floating_point()]
    exact = all(t.dtype == torch.bfloat16 or torch.equal(t.detach().to(torch.bfloat16).to(t.dtype),
                                                         t.detach()) for t in frozen)
    return torch.bfloat16 if exact else torch.float32


def hold_frozen_base(model: nn.Module, dtype: torch.dtype) -> str:
    """Every frozen floating-point parameter in `dtype` (4-bit weights and the parameters that
    train, which the optimizer keeps in fp32, stay as they are); the dtype's name, for the
    log."""
    for t in model.parameters():
        if not t.requires_grad and t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)
    for t in model.parameters():
        if t.requires_grad and t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()  # a bf16 checkpoint's trained-in-full modules: fp32 masters
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
