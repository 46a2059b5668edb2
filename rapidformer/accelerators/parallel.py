"""Tensor and pipeline parallelism with megatron-core: its parallel state, its pipeline
schedules and its tensor-parallel layers; the gradient bookkeeping around them is here.

    state = initialize(cfg, device)       # TP x PP groups; data parallelism takes the rest
    model = build_megatron_gpt(...)       # rapidformer.models.megatron
    layout_independent_init(model, ...)   # the same weights whatever the layout
    losses = forward_backward(...)        # megatron-core's schedule for this layout
    norm = clip_grad_norm(model, max_norm)

The optimizer is torch's AdamW over each rank's own shards: megatron-core's optimizer allocates
on "cuda" by name, so it cannot run the CPU tests that keep this path honest. Gradients are
averaged over the data-parallel group and the tied word embedding of the first and last
pipeline stage is summed, as megatron-core's `finalize_model_grads` does for its own DDP.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rapidformer.config.schema import RunConfig


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


def is_megatron(cfg: RunConfig) -> bool:
    return cfg.model.arch.startswith("megatron")


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
    if not dist.is_initialized():  # one process: megatron-core still wants a group
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                                store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.trainer.seed)
    return ParallelState(tp=ps.get_tensor_model_parallel_world_size(),
                         pp=ps.get_pipeline_model_parallel_world_size(),
                         dp=ps.get_data_parallel_world_size(),
                         tp_rank=ps.get_tensor_model_parallel_rank(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(),
                         dp_rank=ps.get_data_parallel_rank())


def layout_independent_init(model: torch.nn.Module, std: float, num_layers: int) -> None:
    """Every weight drawn whole from a generator seeded by its global name, then cut to this
    rank's shard: the model is the same at TP=1 and TP=2, PP=1 and PP=2, so a layout can be
    checked against another (and a run reproduced on another one). Matrices ~ N(0, std),
    norm weights 1, biases 0; a tied output layer gets the word embedding's values."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = ps.get_pipeline_model_parallel_rank() * (num_layers //
                                                      ps.get_pipeline_model_parallel_world_size())
    for name, param in model.named_parameters():
        name = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)
        if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights",
                                                     False):
            name = "embedding.word_embeddings.weight"
        shape = list(param.shape)
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else -1
        if dim >= 0:
            shape[dim] *= tp
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if "norm" in name and name.endswith("weight"):
            full = torch.ones(shape)
        elif name.endswith("weight"):
            full = torch.randn(shape, generator=generator) * std
        else:
            full = torch.zeros(shape)
        if dim >= 0:
            full = full.chunk(tp, dim)[tp_rank]
        with torch.no_grad():
            param.copy_(full)


def finalize_grads(model_chunks, *args, **kwargs) -> None:
    """Called by megatron-core's schedule after the last backward: average over data-parallel
    replicas, and sum the tied word embedding's gradient over the first and last stage."""
    from megatron.core import parallel_state as ps

    model = model_chunks[0]
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        group = ps.get_data_parallel_group()
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(dp)
    if ps.get_pipeline_model_parallel_world_size() > 1 and \
            getattr(model, "share_embeddings_and_output_weights", False) and \
            (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        weight = model.shared_embedding_or_output_weight()
        if weight.grad is not None:
            dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The gradient norm of the whole model, summed over its tensor- and pipeline-parallel
    shards (parameters replicated across tensor-parallel ranks, and the last stage's copy of a
    tied embedding, counted once); clips every shard by the same factor."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads, counted = [], []
    tied_copy = model.shared_embedding_or_output_weight() if (
        getattr(model, "share_embeddings_and_output_weights", False)
        and ps.get_pipeline_model_parallel_world_size() > 1
        and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()) else None
    for param in model.parameters():
        if param.grad is None:
            continue
        grads.append(param.grad)
        if param_is_not_tensor_parallel_duplicate(param) and param is not tied_copy:
            counted.append(param.grad)
    square = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for grad in counted:
        square += grad.float().pow(2).sum()
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(square, group=ps.get_model_parallel_group())
    norm = square.sqrt()
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient)
    return norm


def forward_backward(forward_step, data_iterator, model, num_microbatches: int,
                     seq_length: int, micro_batch_size: int, forward_only: bool = False) -> list:
    """megatron-core's schedule for this layout (1F1B across pipeline stages); the loss dicts
    of the last stage, [] elsewhere."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def save_shards(model: torch.nn.Module, optimizer, directory, rank: int) -> None:
    """Every rank writes its own shard of the model and optimizer (resume needs the same
    layout: the shards are cut by tensor, pipeline and, under ZeRO-1, data-parallel rank) and
    its tensor-parallel RNG streams (dropout inside tensor-parallel regions)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    shard_dir = directory / "megatron"
    shard_dir.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": _optimizer_shard(optimizer),
                "rng_tracker": get_cuda_rng_tracker().get_states()},
               shard_dir / f"rank{rank:05d}.pt")


def load_shards(model: torch.nn.Module, optimizer, directory, rank: int) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = torch.load(directory / "megatron" / f"rank{rank:05d}.pt", map_location="cpu",
                       weights_only=False)
    model.load_state_dict(state["model"])
    get_cuda_rng_tracker().set_states(state["rng_tracker"])
    optimizer.load_state_dict(state["optimizer"])


def _optimizer_shard(optimizer) -> dict:
    """The optimizer's state dict; for ZeRO-1 only this replica's share, in the layout its
    `load_state_dict` reads (global indices, other replicas' entries absent): no gathering of
    the whole state through object collectives, which does not scale to large models."""
    if _local(optimizer) is optimizer:
        return optimizer.state_dict()
    shard = torch.optim.Optimizer.state_dict(optimizer)  # the groups, with global indices
    index = optimizer._param_to_index  # torch's own global indexing of the parameters
    shard["state"] = {index[param]: value for param, value in optimizer.optim.state.items()}
    return shard


def _local(optimizer):
    """The optimizer whose state this rank holds (a ZeRO-1 optimizer's own shard)."""
    return getattr(optimizer, "optim", optimizer)


def build_zero1_optimizer(model: torch.nn.Module, o, lr: float, weight_decay: float,
                          device: torch.device):
    """memory=zero1 for a Megatron model: AdamW whose state is sharded over the data-parallel
    replicas (torch's ZeroRedundancyOptimizer: each replica steps its share of the parameters
    and broadcasts them), on top of the tensor/pipeline sharding."""
    from megatron.core import parallel_state as ps
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from rapidformer.optim import fused_available, parameter_groups

    fused = o.fused == "on" or (o.fused == "auto" and fused_available(device))
    return ZeroRedundancyOptimizer(parameter_groups(model, weight_decay),
                                   optimizer_class=torch.optim.AdamW,
                                   process_group=ps.get_data_parallel_group(), lr=lr,
                                   betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
