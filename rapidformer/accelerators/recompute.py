"""Activation recompute (the seed's --checkpoint-activations): keep only each transformer
layer's input during the forward pass and recompute the layer in the backward pass, trading
about a third more compute for activation memory that no longer grows with depth."""
from __future__ import annotations

import logging

import torch

from rapidformer.errors import ConfigError

log = logging.getLogger("rapidformer")


def enable_recompute(model: torch.nn.Module) -> None:
    """Hugging Face models: their own per-layer gradient checkpointing, non-reentrant (it works
    under DDP, FSDP2 and DeepSpeed ZeRO, and restores the RNG so dropout masks repeat)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError([f"trainer.checkpoint_activations=true: {type(model).__name__} does not "
                           f"support activation recompute (it is not a Hugging Face model with "
                           f"gradient_checkpointing_enable); set trainer.checkpoint_activations="
                           f"false"])
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    log.info("activation recompute: on (Hugging Face gradient checkpointing, per layer)")
