"""kernels.fused_projections: one matmul for an attention's q, k and v, one for an MLP's gate
and up, in Hugging Face Llama, Mistral and Qwen2 decoders.

Each attention's q_proj, k_proj and v_proj become one `nn.Linear` (`qkv_proj`) whose weight is
theirs stacked along the output dimension (their biases too, Qwen2's), and each SwiGLU MLP's
gate_proj and up_proj one (`gate_up_proj`); the forwards split the output where the model's
own forwards called the three (two) layers: the same math, fewer and larger matmuls (at a Llama
3.2 1B shape the 512-wide k and v projections join the 2048-wide q, which also puts them above
float8's size threshold: precision=fp8 converts the fused layers, TRANSFORMS' order).

What the rest of rapidformer sees stays the Hugging Face layout: the fused modules' state dict
hooks give `state_dict()` the model's own keys, shapes and values (q_proj.weight, ...: views of
the fused weight, no copy) and take an unfused state dict in `load_state_dict`, so the model
weights of checkpoints, the export (a plain model) and the memory plan do not change. The
optimizer's state follows the parameters it updates (one qkv_proj moment, not three), so a
checkpoint records the transform and a resume across the setting is refused (its weights start
a fresh run either way). The parameters are the same numbers, so the FLOP count is too.

Where the hooks are not the whole story it refuses: peft's adapters target the projections it
replaces; DeepSpeed ZeRO and FSDP2 save and consolidate through their own views of the
parameters (ZeRO's parameter names, DCP's fully-qualified names), which would be the fused ones;
Megatron models have their own fused layers (linear_qkv, linear_fc1); graph=ort exports the
model to ONNX. A module whose forward was replaced on the instance (liger-kernel's SwiGLU
patch) keeps its layers. The fused classes are made at run time: pickling the whole module
(`torch.save(model)`) is not supported; its state dict is. Not yet measured on a GPU: off by
default (benchmarks/decoder_speed.py's rf-bf16-fused and rf-fp8-fused rows).
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidformer.errors import InputError
from rapidformer.transforms.base import ApplyContext, ModelTransform

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

# the Hugging Face families whose attention and MLP have this layout (transformers 5.x); how
# each passes its sliding window to the attention function: an attribute of the attention
# module, the config's key, or not at all
FAMILIES = {"Llama": None, "Mistral": "config", "Qwen2": "attribute"}
KEY = "kernels.fused_projections"
# config-built architectures (model.arch) whose decoders it fuses
CONFIG_ARCHS = ("llama", "mistral", "qwen2")


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the parts' outputs side by side."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts),
                      bias=first.bias is not None, device="meta")
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]),
                                    requires_grad=first.weight.requires_grad)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]),
                                      requires_grad=first.bias.requires_grad)
    return fused


def _replace(module: nn.Module, names: tuple[str, ...], fused_name: str) -> list[int]:
    """Swap `names` (nn.Linear children of `module`) for one fused child at the first one's
    place in the module order; the parts' output sizes."""
    parts = [getattr(module, n) for n in names]
    fused = _fused_linear(parts)
    children = list(module._modules.items())
    module._modules.clear()
    for name, child in children:
        if name == names[0]:
            module._modules[fused_name] = fused
        elif name not in names:
            module._modules[name] = child
    return [p.out_features for p in parts]


def _hf_layout_hooks(module: nn.Module, fused_name: str, names: tuple[str, ...],
                     sizes: list[int]) -> None:
    """State dict hooks on `module`: out, the parts' keys (views of the fused tensors), in the
    model's own order; in, an unfused state dict's parts stacked into the fused key."""

    def out(mod, state_dict, prefix, local_metadata):
        fused_prefix = f"{prefix}{fused_name}."
        moved = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        fused = {k[len(fused_prefix):]: v for k, v in moved.items() if k.startswith(fused_prefix)}
        for key, value in moved.items():
            if not key.startswith(fused_prefix):
                state_dict[key] = value
            elif key == fused_prefix + "weight":  # each part's weight then bias, as the model's
                split = {kind: v.split(sizes) for kind, v in fused.items()}
                for i, name in enumerate(names):
                    for kind in split:
                        state_dict[f"{prefix}{name}.{kind}"] = split[kind][i]

    def into(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused_name}.{kind}"] = torch.cat(
                    [state_dict.pop(k) for k in keys])

    module.register_state_dict_post_hook(out)
    module.register_load_state_dict_pre_hook(into)


class FusedQKVAttention(nn.Module):
    """The forward of transformers 5.x's Llama/Mistral/Qwen2 attention with q, k and v from
    one matmul (mixed into the family's class: `fuse_projections`)."""

    _family_module = None  # the family's modeling module (set on each fused class)
    _sliding = None        # FAMILIES' value
    _qkv_sizes: list[int]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        hf = self._family_module
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self._qkv_sizes, dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        # looked up at call time: liger-kernel's rope patch replaces the module's function
        query_states, key_states = hf.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                    kwargs=kwargs)
        attention = hf.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                             hf.eager_attention_forward)
        if self._sliding == "attribute":
            kwargs["sliding_window"] = self.sliding_window
        elif self._sliding == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        attn_output, attn_weights = attention(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class FusedGateUpMLP(nn.Module):
    """The SwiGLU MLP's forward with gate and up from one matmul."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


_CLASSES: dict[tuple[type, type], type] = {}


def _fused_class(mixin: type, cls: type, **attributes) -> type:
    if (mixin, cls) not in _CLASSES:
        _CLASSES[(mixin, cls)] = type(f"Fused{cls.__name__}", (mixin, cls), attributes)
    return _CLASSES[(mixin, cls)]


def _is_linear(*modules) -> bool:
    return all(type(m) is nn.Linear for m in modules)  # not peft's, not float8's


def fuse_projections(model: nn.Module) -> tuple[int, int]:
    """Fuse, in place, the projections of every attention and MLP of a family in FAMILIES;
    (attentions, MLPs) fused. A module whose forward was replaced on the instance keeps its
    layers: liger-kernel 0.8 patches the family's MLP that way (its SwiGLU kernel reads
    gate_proj and up_proj by name) and keeps its class, so the class alone does not tell."""
    attentions = mlps = 0
    for module in list(model.modules()):
        cls = type(module)
        family = cls.__name__.removesuffix("Attention").removesuffix("MLP")
        if family not in FAMILIES or cls.__name__ == family or "forward" in vars(module):
            continue
        hf = sys.modules[cls.__module__]
        if cls.__name__.endswith("Attention") and _is_linear(module.q_proj, module.k_proj,
                                                             module.v_proj):
            names = ("q_proj", "k_proj", "v_proj")
            sizes = _replace(module, names, "qkv_proj")
            _hf_layout_hooks(module, "qkv_proj", names, sizes)
            module._qkv_sizes = sizes
            module.__class__ = _fused_class(FusedQKVAttention, cls, _family_module=hf,
                                            _sliding=FAMILIES[family])
            attentions += 1
        elif cls.__name__.endswith("MLP") and _is_linear(module.gate_proj, module.up_proj):
            names = ("gate_proj", "up_proj")
            sizes = _replace(module, names, "gate_up_proj")
            _hf_layout_hooks(module, "gate_up_proj", names, sizes)
            module.__class__ = _fused_class(FusedGateUpMLP, cls)
            mlps += 1
    return attentions, mlps


class FusedProjections(ModelTransform):
    """kernels.fused_projections=true."""

    name = "fused_projections"
    # before the move: the stacking copies the weights once, on the host; before peft and
    # float8 (TRANSFORMS' order), after liger-kernel's patches
    before_move = True

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.kernels.fused_projections

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [f"{KEY}=true"]

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        if not cfg.kernels.fused_projections:
            return []
        p, m, mem = [], cfg.model, cfg.memory.name
        if cfg.peft.name != "none":
            p.append(f"{KEY}=true with peft={cfg.peft.name}: the adapters target the "
                     f"q_proj/k_proj/v_proj/gate_proj/up_proj layers that it replaces by fused "
                     f"ones; set {KEY}=false with peft")
        if m.is_megatron:
            p.append(f"{KEY}=true with model={m.name}: it fuses Hugging Face Llama, Mistral and "
                     f"Qwen2 projections, and megatron-core's layers are fused already "
                     f"(linear_qkv, linear_fc1); set {KEY}=false")
        elif m.source == "config" and m.arch not in CONFIG_ARCHS:
            p.append(f"{KEY}=true with model={m.name} (arch={m.arch}): it fuses the projections "
                     f"of Hugging Face Llama, Mistral and Qwen2 decoders only; set {KEY}=false")
        elif cfg.graph.name == "ort":
            p.append(f"{KEY}=true with graph=ort: ONNX Runtime trains the model it exports to "
                     f"ONNX, not the fused torch modules; set {KEY}=false or use graph=compile")
        if mem in ("zero1", "zero2", "zero3", "fsdp"):
            how = ("DeepSpeed ZeRO saves and consolidates" if mem != "fsdp" else
                   "FSDP2's distributed checkpoints save")
            p.append(f"{KEY}=true with memory={mem}: {how} the fused parameters under their "
                     f"own names (qkv_proj, gate_up_proj), not the Hugging Face layout its "
                     f"checkpoints keep; use memory=none (DDP) or set {KEY}=false")
        return p

    # --- checkpoints: the model weights are the Hugging Face layout, the optimizer's are not ----
    def record(self) -> dict:
        return {"optimizer_layout": ["qkv_proj", "gate_up_proj"]}

    def resume_problem(self, record: dict | None) -> str | None:
        if record is not None:
            return None
        return (f"was trained without {KEY}=true and its optimizer state is laid out for "
                f"q_proj/k_proj/v_proj and gate_proj/up_proj, which this run fuses; resume with "
                f"{KEY}=false, or start a fresh run from its export (model.source=pretrained "
                f"model.name_or_path=EXPORT_DIR)")

    @classmethod
    def problem_without(cls, record: dict) -> str | None:
        return (f"was trained with {KEY}=true and its optimizer state is laid out for the fused "
                f"qkv_proj and gate_up_proj layers (its model weights are not); resume with "
                f"{KEY}=true, or start a fresh run from its export (model.source=pretrained "
                f"model.name_or_path=EXPORT_DIR)")

    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        attentions, mlps = fuse_projections(model)
        if not attentions and not mlps:
            raise InputError(f"{KEY}=true found no Llama, Mistral or Qwen2 attention or MLP to "
                             f"fuse in {type(model).__name__}; set {KEY}=false")
        log.info("%s: q/k/v fused in %d attention layers, gate/up in %d MLPs (the state dict "
                 "keeps the Hugging Face layout)", KEY, attentions, mlps)
        return model
