"""Checkpoints of Megatron models with megatron-core's distributed checkpointing.

Every rank writes its own shards of the model and the optimizer state (torch_dist format: each
tensor stored once, under its global shape and offsets), so a checkpoint written at one layout
loads at another: TP=2 -> TP=1, PP=2 -> PP=1, any number of data-parallel replicas. The one
exception is the distributed optimizer (memory=zero1/zero2): its state is kept in
megatron-core's `dp_reshardable` form, which changes only the number of replicas. (Its fully
reshardable form fails to load in megatron-core 0.16 with torch's AdamW, which keeps a "step"
per parameter that the loader does not expect.)
"""
from __future__ import annotations

import queue
from pathlib import Path

import torch

from rapidformer.accelerators.megatron_optimizer import unwrap

SHARD_DIR = "megatron"


def _sharded_state_dict(model, optimizer, loading: bool) -> dict:
    model_state = unwrap(model).sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                      metadata=metadata)}


def save(model, optimizer, directory: Path) -> None:
    """Collective: every rank writes its shards under directory/megatron."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # the writer's results queue defaults to a spawn-started multiprocessing Manager, and
    # spawning re-imports the main script (a user script without a __main__ guard would start
    # training again); the save below runs synchronously in this process, so an in-process
    # queue carries the same results
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    target = directory / SHARD_DIR
    target.mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(model, optimizer, loading=False), str(target))


def load(model, optimizer, directory: Path) -> None:
    """Collective: every rank reads what its layout needs from directory/megatron."""
    from megatron.core import dist_checkpointing

    _materialize_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded_state_dict(model, optimizer, loading=True),
                                    str(directory / SHARD_DIR))
    unwrap(model).load_state_dict(state["model"])
    with torch.no_grad():  # fp32 runs: the main weights are views of the model's parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer)


def _inner_optimizers(optimizer) -> list:
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def _materialize_adam_state(optimizer) -> None:
    """Zero Adam state for every parameter of a fresh optimizer, as torch creates it at the
    first step: megatron-core 0.16 reads the (absent) "step" of torch's AdamW while preparing
    the load, and the loaded values then replace these."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = _step_tensor(0.0, param, group)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _restore_adam_steps(optimizer) -> None:
    """torch AdamW counts steps per parameter (bias correction). megatron-core 0.16's distributed
    optimizer checkpoints one count in its parameter groups, but restores the parameters' own
    counts from the placeholder state (0) and, elsewhere, as one tensor shared by every
    parameter (which AdamW would then advance once per parameter). Each parameter gets its own
    copy of the group's count."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:  # not the distributed optimizer: per-parameter counts kept
                continue
            for param in group["params"]:
                if "step" in inner.state[param]:
                    inner.state[param]["step"] = _step_tensor(float(group["step"]), param, group)


def _step_tensor(step: float, param, group) -> torch.Tensor:
    """AdamW's step count as torch keeps it: on the host, or beside the parameter (float32)
    for the fused kernel (megatron_optimizer switches GPU runs to it)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(step, dtype=torch.float32, device=param.device)
    return torch.tensor(step)


def reshard_problem(saved: dict, current: dict, distributed_optimizer: bool) -> str | None:
    """Why a checkpoint of layout `saved` cannot load at `current` ({tensor_parallel,
    pipeline_parallel, precision}), or None when it can."""
    if saved.get("precision") != current["precision"]:
        return (f"it was written with precision={saved.get('precision')} and megatron-core's "
                f"optimizer state differs between precisions (fp32 main weights, loss scale); "
                f"resume with precision={saved.get('precision')}")
    same_model_layout = all(saved.get(k) == current[k]
                            for k in ("tensor_parallel", "pipeline_parallel"))
    if distributed_optimizer and not same_model_layout:
        return (f"its distributed-optimizer state (memory=zero1/zero2) was written at tensor "
                f"{saved.get('tensor_parallel')} x pipeline {saved.get('pipeline_parallel')} and "
                f"loads only at that layout (any number of data-parallel replicas); resume at "
                f"that layout, or train with memory=none, whose checkpoints load at any layout")
    return None
