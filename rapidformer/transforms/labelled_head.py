"""task.lm_head=labelled (task=sft's default): the causal LM's output layer runs at the positions
whose next token carries a label, a chunk at a time (models/chunked_loss.py), instead of on
every position with the [tokens, vocabulary] logits kept for the backward. The same loss.

The model's forward is wrapped on the instance (what peft, DDP and FSDP call through): given
labels, and nothing the fast path does not know (a cache, input embeddings, logits to keep), it
runs the backbone and the chunked loss and returns the loss without logits; any other call
(generation, a caller that wants logits) is the model's own forward. Off, as the model's own
forward: kernels=liger with its fused linear cross-entropy (which then computes the loss),
Megatron models (their own loss), graph=ort, a head with a bias or scaled or capped logits, and
a head partitioned by DeepSpeed ZeRO-3 (memory=zero3: gathered only by its own forward).
"""
from __future__ import annotations

import functools
import logging
import types
from typing import TYPE_CHECKING

from torch import nn

from rapidformer.models.chunked_loss import next_token_loss
from rapidformer.transforms.base import ApplyContext, ModelTransform
from rapidformer.transforms.liger import adapted_output_layer, applied_fused_loss, fuses_the_loss

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

# what the chunked loss serves: the forward's own arguments, beside labels
KNOWN_ARGUMENTS = {"input_ids", "attention_mask", "position_ids", "use_cache", "return_dict"}
# config attributes of families whose logits are more than hidden @ weight.T
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling")


class LabelledHead(ModelTransform):
    """task.lm_head=labelled."""

    name = "labelled_head"
    before_move = True  # before peft wraps the model whose forward it wraps (TRANSFORMS' order)

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return (cfg.task.name == "sft" and cfg.task.lm_head == "labelled"
                and not cfg.model.is_megatron and cfg.graph.name != "ort"
                and not fuses_the_loss(cfg.kernels))

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        if cfg.task.lm_head != "labelled" and cfg.task.name != "sft":
            return [f"task.lm_head={cfg.task.lm_head} chooses where a causal LM's output layer "
                    f"runs for task=sft; task={cfg.task.name} has its own head (leave "
                    f"task.lm_head unset)"]
        return []

    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        if applied_fused_loss(model):
            reason = "liger-kernel's fused linear cross-entropy computes it"
        elif head := adapted_output_layer(self.cfg, model):
            reason = f"peft adapts the output layer ({head}), which its own forward runs"
        elif self.cfg.memory.name == "zero3":
            reason = "memory=zero3 partitions the output layer, which only its own forward gathers"
        else:
            reason = why_not(model)
        if reason:
            log.info("task.lm_head=labelled: the model's own forward computes the loss (%s)",
                     reason)
            return model
        wrap_forward(model)
        log.info("task.lm_head=labelled: the output layer runs at the labelled positions only, "
                 "in chunks (the logits are never kept)")
        return model


def why_not(model: nn.Module) -> str | None:
    """Why the chunked loss cannot stand in for `model`'s own loss; None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__} has no linear output layer"
    if head.bias is not None:
        return "its output layer has a bias"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    scaled = [name for name in SCALED_LOGITS if getattr(config, name, None) not in (None, 1.0)]
    if scaled:
        return f"its logits are scaled or capped ({', '.join(scaled)})"
    if not hasattr(model, getattr(model, "base_model_prefix", "") or "-"):
        return f"{type(model).__name__} has no backbone attribute"
    return None


def wrap_forward(model: nn.Module) -> None:
    """`model.forward` with the chunked loss when it is given labels (see the module's text)."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # an attribute, not a closure: a deep copy of the model rebinds it to the copy
    model._rapidformer_own_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, labels=None, **kwargs):
        head = self.get_output_embeddings()
        # peft passes inputs_embeds=None, output_attentions=None, ...: unset is not asked for
        asked = {k for k, v in kwargs.items() if v is not None and v is not False}
        # a head that peft adapts (peft.target_modules naming it) computes more than
        # hidden @ weight.T: its own forward runs it with the adapter
        if (args or labels is None or not asked <= KNOWN_ARGUMENTS
                or kwargs.get("return_dict") is False or kwargs.get("use_cache")
                or getattr(head.weight, "ds_id", None) is not None
                or getattr(head, "base_layer", None) is not None):
            return self._rapidformer_own_forward(*args, labels=labels, **kwargs)
        inputs = {k: kwargs[k] for k in ("input_ids", "attention_mask", "position_ids")
                  if kwargs.get(k) is not None}
        hidden = getattr(self, self.base_model_prefix)(**inputs, use_cache=False) \
            .last_hidden_state
        weight = head.weight
        if hasattr(weight, "full_tensor"):  # a tensor-parallel DTensor
            weight = weight.full_tensor()
        compact = not torch.compiler.is_compiling()
        loss = next_token_loss(hidden, weight, labels.to(hidden.device), compact=compact)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
