"""The seed's `mpu` helpers: `from rapidformer import mpu` (the seeds write `from megatron import
mpu`; replace that line, the calls stay the same).

`broadcast_data(keys, data, datatype)` gives every rank of a tensor-parallel group the batch
that the group's first rank read (the others may pass None). With data parallelism only every
rank reads its own batch, so the call checks it and moves it to the device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rapidformer.compat.args import current
from rapidformer.errors import InputError
from rapidformer.planning.run_plan import pick_device


def _tensor_parallel_group():
    """(group, source rank) when tensor parallelism is on, else None."""
    import sys

    if "megatron.core" not in sys.modules:  # no megatron-core model in this process
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()


def _device() -> torch.device:
    """The run's device (trainer.device, as the engine picked it); outside a run, the current
    GPU if there is one."""
    run = current()
    if run is not None:
        return pick_device(run.cfg.trainer.device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _checked(keys: list[str], data, datatype: torch.dtype) -> dict:
    if data is None:
        raise InputError("mpu.broadcast_data got no data on a rank that must read its own "
                         "batch: pass next(data_iterator)")
    out = {}
    for key in keys:
        if key not in data:
            raise InputError(f"mpu.broadcast_data: the batch has no key '{key}' (it has: "
                             f"{', '.join(map(str, data))})")
        value = torch.as_tensor(data[key])
        if value.dtype != datatype:
            raise InputError(f"mpu.broadcast_data: '{key}' is {value.dtype}, expected {datatype}")
        out[key] = value
    return out


def broadcast_data(keys: list[str], data: dict, datatype: torch.dtype) -> dict:
    """{key: tensor of `datatype`} for `keys`, on the current device, the same on every rank
    of a tensor-parallel group."""
    device = _device()
    tp = _tensor_parallel_group()
    if tp is None:
        # from pinned memory the copy is asynchronous: no wait for the queued GPU work
        return {k: v.to(device, non_blocking=True)
                for k, v in _checked(keys, data, datatype).items()}
    group, source = tp
    shapes = [None]
    if dist.get_rank() == source:
        batch = _checked(keys, data, datatype)
        shapes = [{k: tuple(v.shape) for k, v in batch.items()}]
    dist.broadcast_object_list(shapes, src=source, group=group)
    out = {}
    for key in keys:
        tensor = batch[key].to(device) if dist.get_rank() == source else \
            torch.empty(shapes[0][key], dtype=datatype, device=device)
        dist.broadcast(tensor, src=source, group=group)
        out[key] = tensor
    return out
