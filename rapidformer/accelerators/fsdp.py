"""memory=fsdp: torch FSDP2 (`fully_shard`) on every transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across the data-parallel ranks; the
precision group becomes FSDP's MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction and
fp32 sharded master weights). Checkpoints are torch.distributed.checkpoint (DCP) shards, one
set per rank; the export gathers one full fp32 state dict on rank 0.
"""
from __future__ import annotations

import torch
from torch import nn

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError

DCP_DIR = "dcp"


def check_fsdp_precision(cfg: RunConfig) -> None:
    if cfg.memory.name == "fsdp" and cfg.precision.dtype == "fp16":
        raise ConfigError(["precision=fp16 with memory=fsdp is not supported yet (loss scaling of "
                           "sharded gradients); use precision=bf16 with FSDP, or fp16 with "
                           "memory=zero2/zero3"])


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: every child of every ModuleList (BertLayer, GPT2Block, ...)."""
    return [block for module in model.modules() if isinstance(module, nn.ModuleList)
            for block in module if any(p.requires_grad for p in block.parameters())]


def shard_model(model: nn.Module, cfg: RunConfig, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard

    check_fsdp_precision(cfg)
    param_dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else None
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                                reduce_dtype=torch.float32),
              # pinned host memory needs an accelerator to pin for
              "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
              if cfg.memory.offload_params
              else OffloadPolicy()}
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def save_shards(model: nn.Module, optimizer, directory) -> None:
    """Every rank writes its shards of the model and optimizer state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_shards(model: nn.Module, optimizer, directory) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def full_state_dict(model: nn.Module) -> dict:
    """The whole fp32 state dict on rank 0 (collective; other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
