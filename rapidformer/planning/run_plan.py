"""The run plan: what every part of a process derives from the config and its launch, decided
once and handed down (device, world size, data-parallel size, gradient accumulation)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rapidformer.config.sizes import data_parallel_size
from rapidformer.errors import ConfigError

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(["trainer.device=cuda but no CUDA GPU is visible; use "
                               "trainer.device=cpu or auto"])
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    # transformers imports DeepSpeed where it is installed, whatever the run's memory option,
    # and DeepSpeed warns on its first use that it found no GPU: on a CPU run it is told
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return torch.device("cpu")


@dataclass(frozen=True)
class RunPlan:
    device: torch.device
    world_size: int
    data_parallel_size: int  # replicas: the world over tensor x pipeline parallel groups
    accumulation: int        # micro-batches per optimizer step on each replica

    @classmethod
    def for_process(cls, cfg: RunConfig) -> "RunPlan":
        """This process's plan: the device trainer.device names, and the world its launcher
        (or torchrun) started."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        replicas = data_parallel_size(cfg, world)
        t = cfg.trainer
        return cls(device=pick_device(t.device), world_size=world, data_parallel_size=replicas,
                   accumulation=max(t.global_batch_size // (t.micro_batch_size * replicas), 1))
