"""memory=fsdp: torch FSDP2 (`fully_shard`) on every transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across the data-parallel ranks; the
precision group becomes FSDP's MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction and
fp32 sharded master weights). Checkpoints are torch.distributed.checkpoint (DCP) shards, one
set per rank (of what the state filter keeps); the export gathers one full fp32 state dict on
rank 0.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from rapidformer.accelerators.base import EVERYTHING, NOTHING, StateBytes
from rapidformer.accelerators.ddp import DDPStrategy
from rapidformer.accelerators.graph import blocks_only_problems
from rapidformer.accelerators.precision import compute_bytes
from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError
from rapidformer.models.blocks import transformer_blocks
from rapidformer.runtime.distributed import join_group_of_one
from rapidformer.transforms.base import WHOLE_MODEL, StateFilter

log = logging.getLogger("rapidformer")

DCP_DIR = "dcp"


FP16_REFUSED = ("precision=fp16 with memory=fsdp is not supported yet (loss scaling of sharded "
                "gradients); use precision=bf16 with FSDP, or fp16 with memory=zero2/zero3")


def shard_model(model: nn.Module, cfg: RunConfig, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard

    if cfg.precision.dtype == "fp16":
        raise ConfigError([FP16_REFUSED])
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


def _shard_options(state_filter: StateFilter):
    """A filter that leaves the frozen parameters out: they are neither saved nor loaded (the
    load then expects those keys missing, which the filter confirms are the frozen ones)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen_left_out = not state_filter.saves_frozen
    return StateDictOptions(ignore_frozen_params=frozen_left_out, strict=not frozen_left_out)


def save_shards(model: nn.Module, optimizer, directory,
                state_filter: StateFilter = WHOLE_MODEL) -> None:
    """Every rank writes its shards of the model and optimizer state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=_shard_options(state_filter))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_shards(model: nn.Module, optimizer, directory,
                state_filter: StateFilter = WHOLE_MODEL) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _shard_options(state_filter)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    result = set_state_dict(model, optimizer, model_state_dict=state["model"],
                            optim_state_dict=state["optim"], options=options)
    if not state_filter.saves_frozen:
        state_filter.loaded(model, result.missing_keys, result.unexpected_keys, directory)


def full_state_dict(model: nn.Module) -> dict:
    """The whole fp32 state dict on rank 0 (collective; other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def read_full_state_dict(directory) -> dict:
    """The model weights of DCP shards, on one CPU process (torch's DCP converter)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/full.pt")
        return torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)["model"]


class FSDP2Strategy(DDPStrategy):
    """The torch optimizer and step of the DDP strategy, over FSDP2-sharded parameters."""

    name = "fsdp2"
    compiles_blocks = True

    @classmethod
    def state_bytes(cls, cfg: RunConfig) -> StateBytes:
        # every block sharded: fp32 master weights, fp32 gradients (reduce_dtype) and AdamW's
        # two fp32 moments; the forward runs on the gathered bf16 weights (param_dtype), so a
        # 16-bit residual stream; CPUOffloadPolicy (memory.offload_params) keeps parameters,
        # gradients and optimizer state in host memory together
        return StateBytes(weights=4, gradients=4, optimizer=8, sharded=EVERYTHING,
                          offloaded=EVERYTHING if cfg.memory.offload_params else NOTHING,
                          residual=compute_bytes(cfg.precision))

    @classmethod
    def buffer_bytes(cls, cfg: RunConfig, parameters: int, block_parameters: int) -> int:
        # the unsharded current and prefetched block (in param_dtype), and a block's unsharded
        # fp32 gradients
        return 2 * block_parameters * compute_bytes(cfg.precision) + 2 * block_parameters * 4

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        m, p = cfg.memory, []
        if cfg.precision.dtype == "fp16":
            p.append(FP16_REFUSED)
        if m.offload_optimizer and not m.offload_params:
            p.append("memory.offload_optimizer=true with memory=fsdp needs "
                     "memory.offload_params=true (FSDP offloads parameters and optimizer state "
                     "together)")
        return p + blocks_only_problems(cfg, "FSDP2")

    def wrap(self, model, optimizer, build_scheduler):
        model = self.inner_graph(model)
        if optimizer is not None:
            raise ConfigError(["memory=fsdp shards the parameters, so the optimizer must be "
                               "built after sharding: return None for the optimizer from "
                               "model_optimizer_lr_scheduler_provider"])
        join_group_of_one(self.device)
        model = shard_model(model, self.cfg, self.device)
        log.info("memory=fsdp: FSDP2 over %d transformer blocks", len(transformer_blocks(model)))
        optimizer = self.build_optimizer(model)
        self.model, self.optimizer = model, optimizer
        self.lr_scheduler = build_scheduler(optimizer)
        return model, optimizer, self.lr_scheduler

    def autocast(self):
        return contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts

    def accumulate(self, last_micro_batch: bool):
        self.model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()

    def clips_in_optimizer(self) -> bool:
        return False  # the fused kernel's divisor would have to be a DTensor

    def save(self, directory: Path) -> dict:
        save_shards(self.model, self.optimizer, directory / DCP_DIR, self.state_filter)
        return self._schedule_and_precision()

    def load(self, directory: Path) -> None:
        load_shards(self.model, self.optimizer, directory / DCP_DIR, self.state_filter)
        self._load_schedule_and_precision(directory)

    def export_model(self, model, tokenizer, checkpoint_dir):
        if self.hf_model(model) is None:
            return None
        return model, full_state_dict(model)  # collective

    @classmethod
    def read_weights(cls, checkpoint_dir: Path) -> dict:
        return read_full_state_dict(checkpoint_dir / DCP_DIR)
