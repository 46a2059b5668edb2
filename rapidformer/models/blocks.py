"""A model's repeated transformer blocks, which FSDP2 shards and regional compile compiles."""
from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: every child of every ModuleList (BertLayer, GPT2Block, ...)."""
    return [block for module in model.modules() if isinstance(module, nn.ModuleList)
            for block in module if any(p.requires_grad for p in block.parameters())]
