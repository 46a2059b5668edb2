"""peft.fused=true: each adapted linear layer's base and LoRA paths as one autograd function that
keeps less for the backward than peft's modules do.

peft's LoRA layer runs `base(x) + B(A(dropout(x))) * scaling` as separate modules: every adapter
casts its input, draws its own dropout mask and saves both the mask and the dropped input (a
copy of the input) for A's weight gradient. In a decoder layer q, k and v read the same input and
gate and up another, so one layer saves six input copies and seven masks; at 8,192 tokens on a
Llama 3.2 1B shape that is about 0.5 GB a layer, the largest share of a LoRA step's activations.
Here the function saves the input itself (one tensor that q, k and v share) and the rank-r
product x·Aᵀ, and draws the mask again in the backward from a seed (same device, shape and seed:
the same mask), so nothing of the input's size is saved per adapter. The frozen base needs no
saved input either: its input gradient is dy·W (bitsandbytes' 4-bit weights dequantized for it,
as its own backward does).

The mask keeps or zeroes an element (the 1/(1-p) of inverted dropout is folded into the adapter's
scale, in fp32), so the arithmetic is peft's; the masks come from another random stream than
peft's dropout modules, so runs with peft.dropout > 0 differ from peft.fused=false in which
elements drop, not in distribution. Evaluation, a compiled graph (which traces peft's own
modules: graph=compile is refused with it), merged or disabled adapters, several active
adapters, DoRA and other LoRA variants, base layers other than torch.nn.Linear and
bitsandbytes' Linear4bit, base layers that train (peft's bias="all") and torch.nn.Linear
bases with forward hooks take peft's path unchanged. The backward is once differentiable (a
second derivative raises). In training the function runs under torch.no_grad too, so
activation checkpointing's recompute (which torch.utils.checkpoint runs with the CPU random
state the seed is drawn from restored) draws the forward's masks, reentrant or not.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from peft.tuners.lora.layer import Linear as PeftLinear

# per device: the generator the masks are drawn with (reseeded for every draw)
_GENERATORS: dict[torch.device, torch.Generator] = {}
SEED_RANGE = 2**62


def _generator(device: torch.device) -> torch.Generator:
    generator = _GENERATORS.get(device)
    if generator is None:
        generator = _GENERATORS[device] = torch.Generator(device=device)
    return generator


def drop_mask(shape: torch.Size, device: torch.device, p: float, seed: int) -> torch.Tensor:
    """True where dropout drops an element (one byte an element, and masked_fill reads it as it
    is, where a multiply would first cast it to the input's dtype): the same tensor for the same
    device, number of elements, p and seed. Drawn contiguous, in the order of `shape`'s
    elements whatever the input's strides (bernoulli_ fills memory order: a permuted input's
    mask would be another)."""
    generator = _generator(device)
    generator.manual_seed(seed)
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(p, generator=generator)


def four_bit(base: nn.Module) -> bool:
    """A bitsandbytes 4-bit layer (its weight carries the quantization state)."""
    return getattr(base.weight, "quant_state", None) is not None


def base_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base's weight as [out, in] in `dtype` (bitsandbytes 4-bit: dequantized)."""
    weight = base.weight
    if four_bit(base):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    return weight.to(dtype)


def base_output(base: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if four_bit(base):
        return base(x).to(dtype)  # bitsandbytes' 4-bit matmul, computed in its compute dtype
    bias = None if base.bias is None else base.bias.to(dtype)
    return F.linear(x, base.weight.to(dtype), bias)


class LoRALinearFunction(torch.autograd.Function):
    """y = base(x) + ((x ⊙ keep) Aᵀ) Bᵀ · scale, scale = lora scaling / (1 - p), computed in
    `dtype`; saves x, A, B and the [..., r] product (x ⊙ keep) Aᵀ.

    The passes add into one output-sized tensor (addmm_ with beta=1) and free the mask before
    the next big product: on an 8,192-token down projection (14,336 inputs) the backward's
    tensors at their peak are three bytes an input element, not ten."""

    @staticmethod
    def forward(ctx, x, a, b, base, scale, p, seed, dtype):
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            dropped = xc.masked_fill(drop_mask(x.shape, x.device, p, seed), 0) if p else xc
            u = dropped @ a.to(dtype).t()
            del dropped
            y = base_output(base, xc, dtype)
            u2, bt = u.reshape(-1, u.shape[-1]), b.to(dtype).t()
            if four_bit(base):
                # out of place (one new tensor): bitsandbytes' layer ran its forward hooks, which
                # may hold its output (peft's 4-bit layer returns its input's dtype)
                y = torch.addmm(y.reshape(-1, y.shape[-1]), u2, bt, alpha=scale).view(
                    y.shape).to(x.dtype)
            else:  # F.linear's output, fresh: no one else holds it
                y = y.contiguous()
                y.view(-1, y.shape[-1]).addmm_(u2, bt, alpha=scale)
        ctx.save_for_backward(x, a, b, u)
        ctx.base, ctx.scale, ctx.p, ctx.seed, ctx.dtype = base, scale, p, seed, dtype
        return y

    @staticmethod
    @once_differentiable  # u is saved as a constant: a second derivative would be wrong
    def backward(ctx, dy):
        x, a, b, u = ctx.saved_tensors
        dtype, scale, p = ctx.dtype, ctx.scale, ctx.p
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        tokens, width = math.prod(x.shape[:-1]), x.shape[-1]
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.to(dtype).reshape(-1, dy.shape[-1])
            g = (dy2 @ b.to(dtype)) * scale  # [tokens, r]
            grad_b = None
            if need_b:
                grad_b = ((dy2.t() @ u.reshape(-1, u.shape[-1])) * scale).to(b.dtype)
            drop = (drop_mask((tokens, width), x.device, p, ctx.seed)
                    if p and (need_a or need_x) else None)
            grad_a = None
            if need_a:  # the input in `dtype` only here (x may be fp32 under bf16 autocast)
                dropped = x.to(dtype).reshape(tokens, width)
                if drop is not None:  # in place on a copy the cast or reshape made, never on x
                    if dropped.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                        dropped.masked_fill_(drop, 0)
                    else:
                        dropped = dropped.masked_fill(drop, 0)
                grad_a = (g.t() @ dropped).to(a.dtype)
                del dropped
            grad_x = None
            if need_x:
                grad_x = g @ a.to(dtype)
                if drop is not None:
                    grad_x.masked_fill_(drop, 0)
                del drop  # before the base's weight is made (dequantized, for 4-bit)
                grad_x.addmm_(dy2, base_weight(ctx.base, dtype))
                grad_x = grad_x.reshape(x.shape).to(x.dtype)
        return grad_x, grad_a, grad_b, None, None, None, None, None


class FusedMixin:
    """The forward of a peft LoRA layer that takes LoRALinearFunction where it applies."""

    fused_base_types: tuple[type, ...] = (nn.Linear,)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fused = None if args or kwargs else self._fused_forward(x)
        return super().forward(x, *args, **kwargs) if fused is None else fused

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        # in training the fused function runs under no_grad too: reentrant checkpointing's
        # forward runs without gradients and its recompute with them, and both must draw the
        # same mask (from the same seed)
        if (not self.training or self.disable_adapters
                or self.merged or torch.compiler.is_compiling()
                or type(self.base_layer) not in self.fused_base_types
                or getattr(self, "fan_in_fan_out", False)
                or _base_trains_or_is_hooked(self.base_layer)):
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        lora_a, lora_b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if (name in self.lora_variant or self.lora_bias.get(name, False)
                or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear
                or lora_a.bias is not None or lora_b.bias is not None):
            return None
        if isinstance(dropout, nn.Identity):
            p = 0.0
        elif type(dropout) is nn.Dropout:
            p = float(dropout.p)
        else:
            return None
        if p >= 1.0:
            return None
        dtype = _compute_dtype(x, lora_a.weight)
        if dtype is None:
            return None
        seed = int(torch.randint(SEED_RANGE, (), device="cpu")) if p else 0
        return LoRALinearFunction.apply(x, lora_a.weight, lora_b.weight, self.base_layer,
                                        float(self.scaling[name]) / (1.0 - p), p, seed, dtype)


def _base_trains_or_is_hooked(base: nn.Module) -> bool:
    """Whether the base layer needs peft's path: a parameter of it trains (peft's
    bias="all"/"lora_only", a weight unfrozen by hand: the function gives the base no gradient),
    or a torch.nn.Linear base has forward hooks (the function calls F.linear, not the module;
    a 4-bit base is called as a module, its hooks run)."""
    return (any(t.requires_grad for t in base.parameters())
            or (not four_bit(base) and bool(base._forward_hooks or base._forward_pre_hooks)))


def _compute_dtype(x: torch.Tensor, adapter_weight: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype where it is on (what peft's path computes the matmuls in); otherwise the
    input's, when the adapter's weights share it (None: mixed dtypes, peft's casts decide)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if x.dtype == adapter_weight.dtype else None


class FusedLinear(FusedMixin, PeftLinear):
    """peft's lora.Linear with the fused function (torch.nn.Linear bases)."""

    def __init__(self, base_layer, adapter_name, config, **kwargs):
        # what peft's own dispatch does for a torch.nn.Linear (the custom mapping runs before
        # it): its weight is [out, in], whatever a Conv1D target beside it set
        if kwargs.get("fan_in_fan_out") or config.fan_in_fan_out:
            kwargs["fan_in_fan_out"] = config.fan_in_fan_out = False
        super().__init__(base_layer, adapter_name, config=config, **kwargs)


MAPPING: dict[type, type] = {}
try:  # bitsandbytes' 4-bit layers (peft=qlora): peft defines its class where bitsandbytes imports
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit
    import bitsandbytes as bnb

    class FusedLinear4bit(FusedMixin, PeftLinear4bit):
        """peft's bitsandbytes Linear4bit LoRA layer with the fused function."""

        fused_base_types = (bnb.nn.Linear4bit,)

        def __init__(self, base_layer, adapter_name, config, **kwargs):
            # peft's 4-bit dispatcher passes the layer's quantization settings, which its class
            # reads from the layer itself
            for key in ("compute_dtype", "compress_statistics", "quant_type"):
                kwargs.pop(key, None)
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

    MAPPING[bnb.nn.Linear4bit] = FusedLinear4bit  # first: Linear4bit is a torch.nn.Linear too
except ImportError:  # no bitsandbytes, or a peft built without its 4-bit layers
    pass
MAPPING[nn.Linear] = FusedLinear


def register(config) -> None:
    """Make peft build the fused layers for `config`'s targets (peft's custom-module mapping,
    checked before its own dispatch)."""
    config._register_custom_module(dict(MAPPING))


def fused_layers(model: nn.Module) -> int:
    """The adapted layers that train through the fused function (base layers it covers)."""
    return sum(isinstance(m, FusedMixin) and type(m.base_layer) in m.fused_base_types
               and not getattr(m, "fan_in_fan_out", False) for m in model.modules())
