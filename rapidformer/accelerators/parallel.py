"""Tensor and pipeline parallelism with megatron-core: its parallel state, its pipeline
schedules and its tensor-parallel layers, with weights drawn the same way at every layout.

    state = initialize(cfg, device)       # TP x PP groups; data parallelism takes the rest
    model = build_megatron_gpt(...)       # rapidformer.models.megatron
    losses = forward_backward(...)        # megatron-core's schedule for this layout

Precision, gradient buffers and the optimizer are megatron-core's too
(rapidformer.accelerators.megatron_optimizer), and so are checkpoints
(rapidformer.accelerators.megatron_checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rapidformer.config.schema import RunConfig
from rapidformer.runtime.distributed import join_group_of_one


@dataclass
class ParallelState:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def counts_input(self) -> bool:
        """One rank per data-parallel replica counts samples for throughput."""
        return self.tp_rank == 0 and self.pp_rank == 0


def initialize(cfg: RunConfig, device: torch.device) -> ParallelState:
    """megatron-core's groups for parallelism.tensor/pipeline_model_parallel_size, and its
    per-group RNG streams (the same dropout outside tensor-parallel regions within a group,
    different inside)."""
    if device.type == "cpu":
        from rapidformer.accelerators import megatron_cpu

        megatron_cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    p = cfg.parallelism
    join_group_of_one(device)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.trainer.seed)
    return ParallelState(tp=ps.get_tensor_model_parallel_world_size(),
                         pp=ps.get_pipeline_model_parallel_world_size(),
                         dp=ps.get_data_parallel_world_size(),
                         tp_rank=ps.get_tensor_model_parallel_rank(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(),
                         dp_rank=ps.get_data_parallel_rank())


def forward_backward(forward_step, data_iterator, model, num_microbatches: int,
                     seq_length: int, micro_batch_size: int, forward_only: bool = False) -> list:
    """megatron-core's schedule for this layout (1F1B across pipeline stages); the loss dicts
    of the last stage, [] elsewhere."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def count_parameters(model: torch.nn.Module) -> int:
    """The whole model's parameters from this rank's shard: summed over the tensor- and
    pipeline-parallel ranks, with parameters replicated across tensor-parallel ranks and the
    last stage's copy of a tied embedding counted once. Collective over the model-parallel
    group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    tied_copy = model.shared_embedding_or_output_weight() if (
        getattr(model, "share_embeddings_and_output_weights", False)
        and ps.get_pipeline_model_parallel_world_size() > 1
        and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()) else None
    tp_rank = ps.get_tensor_model_parallel_rank()
    local = sum(p.numel() for p in model.parameters() if p is not tied_copy and
                (param_is_not_tensor_parallel_duplicate(p) or tp_rank == 0))
    total = torch.tensor([local], dtype=torch.int64)
    if ps.get_model_parallel_group().size() > 1:
        if dist.get_backend(ps.get_model_parallel_group()) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=ps.get_model_parallel_group())
    return int(total.item())
