"""Activation recompute (the seed's --checkpoint-activations): keep only each transformer
layer's input during the forward pass and recompute the layer in the backward pass, trading
about a third more compute for activation memory that no longer grows with depth."""
from __future__ import annotations

import inspect
import logging

import torch

from rapidformer.errors import ConfigError

log = logging.getLogger("rapidformer")

CPU_OFFLOAD = ("trainer.offload_activations=true moves activations from a GPU to host memory; "
               "this run is on the CPU, where they are in host memory already; set "
               "trainer.offload_activations=false")


def enable_recompute(model: torch.nn.Module, offload: bool = False) -> None:
    """Hugging Face models: their own per-layer gradient checkpointing, non-reentrant (it works
    under DDP, FSDP2 and DeepSpeed ZeRO, and restores the RNG so dropout masks repeat).
    `offload`: the layer inputs it keeps go to pinned host memory (transformers' offload=True:
    torch's save_on_cpu around each layer's checkpoint, so only those inputs move)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError([f"trainer.checkpoint_activations=true: {type(model).__name__} does not "
                           f"support activation recompute (it is not a Hugging Face model with "
                           f"gradient_checkpointing_enable); set trainer.checkpoint_activations="
                           f"false"])
    if offload and on_the_cpu(model):
        raise ConfigError([CPU_OFFLOAD])  # trainer.device=auto found no GPU
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.x
        enable, key = model.activation_checkpointing_enable, "activation_checkpointing_kwargs"
    else:
        enable, key = model.gradient_checkpointing_enable, "gradient_checkpointing_kwargs"
    if offload and "offload" not in inspect.signature(enable).parameters:
        import transformers

        raise ConfigError([f"trainer.offload_activations=true needs a transformers whose "
                           f"activation checkpointing offloads (offload=True: 5.17 has it); "
                           f"this is transformers {transformers.__version__}: pip install -U "
                           f"'transformers>=5.17,<6', or set trainer.offload_activations=false"])
    enable(**{key: kwargs}, **({"offload": True} if offload else {}))
    log.info("activation recompute: on (Hugging Face gradient checkpointing, per layer%s)",
             "; the layer inputs it keeps in pinned host memory" if offload else "")


def on_the_cpu(model: torch.nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())
