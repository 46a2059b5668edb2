"""Whole ("global") tensors of a megatron-core model and this rank's shards of them: the one
place that knows how a tensor is cut over tensor-parallel ranks and which layers a pipeline
stage holds. The random initialisation (`megatron.layout_independent_init`), the Hugging Face
importers (`megatron_import` for GPT-2, `megatron_llama` for the Llama family) and the export
(`megatron_export.gather_full_state`) all go through it, so a global tensor means the same in
each of them whatever the layout.

A global tensor is the TP=1 tensor under the TP=1, PP=1 name. Most tensors are cut into equal
contiguous chunks along their `partition_dim`. One is not: the first MLP matrix of a gated
(SwiGLU) MLP, whose global tensor is [gate; up] (2 x ffn rows) while each rank holds
[its gate rows; its up rows] (megatron-core's MLP splits its own output in two halves), so
rank r's shard is the r-th chunk of gate followed by the r-th chunk of up.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from rapidformer.errors import InputError

_LAYER = re.compile(r"layers\.(\d+)\.")


def stage_offset(num_layers: int) -> int:
    """The global index of this pipeline stage's first layer."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank() * (
        num_layers // ps.get_pipeline_model_parallel_world_size())


def global_name(local_name: str, offset: int, tied: bool = False) -> str:
    """A parameter's name in the whole model: layers renumbered from the stage's first, and the
    last stage's copy of a tied embedding named as the embedding."""
    name = _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", local_name)
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def partition_dim(param: torch.Tensor) -> int:
    """The dimension tensor parallelism cuts (-1: the tensor is whole on every rank)."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else -1


def _gated(name: str, glu: bool) -> bool:
    return glu and name.endswith("mlp.linear_fc1.weight")


def cut(full: torch.Tensor, name: str, dim: int, tp: int, rank: int,
        glu: bool = False) -> torch.Tensor:
    """Rank `rank`'s shard of the global tensor `full` (`glu`: the model's MLP is gated)."""
    if dim < 0:
        return full
    if _gated(name, glu):
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(tp, dim)[rank], up.chunk(tp, dim)[rank]], dim)
    return full.chunk(tp, dim)[rank]


def join(shards: list[torch.Tensor], name: str, dim: int, glu: bool = False) -> torch.Tensor:
    """The global tensor from every tensor-parallel rank's shard, in rank order: `cut` undone."""
    if dim < 0:
        return shards[0]
    if _gated(name, glu):
        halves = [shard.chunk(2, dim) for shard in shards]
        return torch.cat([torch.cat([gate for gate, _ in halves], dim),
                          torch.cat([up for _, up in halves], dim)], dim)
    return torch.cat(shards, dim)


def full_shape(name: str, param: torch.Tensor, tp: int) -> list[int]:
    """The global tensor's shape of one of this rank's parameters."""
    shape = list(param.shape)
    dim = partition_dim(param)
    if dim >= 0:
        shape[dim] *= tp
    return shape


def copy_shards(model: torch.nn.Module, state, num_layers: int) -> tuple[set, list, int]:
    """Each of this rank's parameters set from its global tensor in `state` (a mapping of
    global names; it may make each tensor when asked), cut to this rank's shard: (the global
    names used, the problems, the values copied)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = stage_offset(num_layers)
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    glu = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    used, problems, copied = set(), [], 0
    for local_name, param in model.named_parameters():
        name = global_name(local_name, offset, tied)
        if name in used:
            problems.append(f"{name} would be set twice on this rank")
            continue
        if name not in state:
            problems.append(f"megatron parameter {local_name} ({name}) has no tensor in the "
                            f"checkpoint")
            continue
        shard = cut(state[name], name, partition_dim(param), tp, tp_rank, glu)
        if shard.shape != param.shape:
            problems.append(f"{name}: the checkpoint's shard is {tuple(shard.shape)}, the "
                            f"parameter {tuple(param.shape)}")
            continue
        with torch.no_grad():
            param.copy_(shard)
        used.add(name)
        copied += param.numel()
    return used, problems, copied


def load_global_state(model: torch.nn.Module, state, num_layers: int, what: str) -> int:
    """`state`'s tensors in this rank's parameters, collective over every rank so that a
    problem on one rank stops them all (each problem named, with its rank); the number of values
    copied here. `what` begins the error: whose weights do not fit which model."""
    from rapidformer.errors import InputError

    used, problems, copied = copy_shards(model, state, num_layers)
    everyone = [(used, problems)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (used, problems))
    problems = [f"rank {rank}: {problem}" if len(everyone) > 1 else problem
                for rank, (_, theirs) in enumerate(everyone) for problem in theirs]
    left_over = set(state).difference(*(names for names, _ in everyone))
    if left_over:
        problems.append(f"checkpoint tensors no rank's parameter took: {sorted(left_over)}")
    if problems:
        raise InputError(f"{what}: {'; '.join(problems)}")
    return copied


def checkpoint_model_type(directory: str, accepted: str) -> tuple[Path, str | None]:
    """A Hugging Face checkpoint directory's path and config.json's model_type, read from the
    file alone (never the network); a missing directory, a missing config.json or one that is
    no JSON object is refused (`accepted`: the checkpoints the model starts from, for the
    message)."""
    path = Path(directory).expanduser()
    if not path.exists():
        raise InputError(f"model.init_from_hf={directory} does not exist; give a Hugging Face "
                         f"{accepted} checkpoint directory (config.json and its weights, as "
                         f"save_pretrained writes them)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(f"model.init_from_hf={directory} has no config.json, so it is not a "
                         f"Hugging Face checkpoint directory; give the directory that "
                         f"save_pretrained wrote")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise InputError(f"model.init_from_hf={directory}: config.json is not a JSON object "
                         f"({error}); give the directory that save_pretrained wrote") from error
    return path, model_type
