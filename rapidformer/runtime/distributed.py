"""The run's process group: joined once per process, from what the launcher (or torchrun) set."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int]:
    """(rank, world size); joins the process group that the launcher (or torchrun) set up."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if not dist.is_initialized():
        from datetime import timedelta

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # the elastic agent's store outlives a restart, and with it the first attempt's
            # addresses: the restarted workers would connect to dead peers. Each attempt gets
            # its own key space in it.
            store = dist.PrefixStore(f"rapidformer/attempt_{attempt}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                is_master=False, timeout=timeout))
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def join_group_of_one(device: torch.device) -> None:
    """A one-process run still gives DeepSpeed, FSDP2 and megatron-core the process group they
    ask for (DeepSpeed would otherwise look for MPI to find its peers)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                                store=dist.HashStore(), rank=0, world_size=1)


def gather_rows(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate `tensor` from every rank along dim 0 (sizes may differ between ranks: each
    is padded to the longest for the all-gather, then cut back)."""
    if not (dist.is_available() and dist.is_initialized()) or world_size == 1:
        return tensor
    size = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(s.item())] for part, s in zip(parts, sizes)])
