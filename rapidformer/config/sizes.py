"""The two sizes a config may leave to the machine: `launcher.nproc_per_node: auto` and
`trainer.global_batch_size: null`. They are made concrete once, when the config is resolved,
so that config.yaml records what ran and every process of a job reads the same numbers.

- nproc_per_node=auto: the processes torchrun already started on this node (LOCAL_WORLD_SIZE),
  else one per visible GPU (CUDA_VISIBLE_DEVICES honoured, as the seed's scripts expect), else
  one. trainer.device=cpu means one process: CPU processes are a choice, never a default.
- global_batch_size=null: micro batch x data-parallel size (no gradient accumulation).
"""
from __future__ import annotations

import os

AUTO = "auto"


def visible_gpus() -> int:
    """GPUs this process may use. torch counts through NVML where it can, so asking does not
    initialise CUDA in the launcher (its workers would otherwise inherit a CUDA context)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def processes_per_node(launcher, device: str) -> int:
    """launcher.nproc_per_node as a number: `auto` decided on this node."""
    if launcher.nproc_per_node != AUTO:
        return launcher.nproc_per_node
    if launcher.name == "slurm":
        # the submitting host need not have the nodes' GPUs: counting here would be wrong
        from rapidformer.errors import ConfigError

        raise ConfigError(["launcher=slurm needs launcher.nproc_per_node set to the GPUs of "
                           "each node (auto counts the GPUs of the host that submits the job), "
                           "e.g. launcher.nproc_per_node=8"])
    started = os.environ.get("LOCAL_WORLD_SIZE")
    if started and started.isdigit():
        return int(started)
    if device == "cpu":
        return 1
    return max(visible_gpus(), 1)


def fill(cfg) -> None:
    """Make both sizes of a RunConfig concrete, in place."""
    cfg.launcher.nproc_per_node = processes_per_node(cfg.launcher, cfg.trainer.device)
    t = cfg.trainer
    if t.global_batch_size is None and isinstance(t.micro_batch_size, int) \
            and t.micro_batch_size >= 1:
        t.global_batch_size = t.micro_batch_size * data_parallel_size(cfg)


def launched_world_size(cfg) -> int:
    """The processes the config's launcher starts (nproc_per_node x nnodes)."""
    return cfg.launcher.nproc_per_node * cfg.launcher.nnodes


def data_parallel_size(cfg, world_size: int | None = None) -> int:
    """Model replicas among `world_size` processes (default: the launcher's): the world over
    the tensor x pipeline parallel groups of a Megatron model. The one formula: the run plan
    holds its value for a process (planning/run_plan.py); sizes below 1 are the config
    check's to report."""
    world = launched_world_size(cfg) if world_size is None else world_size
    p = cfg.parallelism
    model_parallel = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                      if cfg.model.is_megatron else 1)
    return max(world // max(model_parallel, 1), 1)
