"""The seed's `mpu` helpers: `from rapidformer import mpu` (the seeds write `from megatron import
mpu`; replace that line, the calls stay the same).

`broadcast_data(keys, data, datatype)` gives every rank of a tensor-parallel group the batch
that its first rank read. With data parallelism only (tensor-parallel size 1, what this version
runs) every rank reads its own batch, so the call checks and converts it in place.
"""
from __future__ import annotations

import torch

from rapidformer.errors import InputError, NotAvailableError


def _tensor_parallel_size() -> int:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 1
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def broadcast_data(keys: list[str], data: dict, datatype: torch.dtype) -> dict:
    """{key: tensor of `datatype`} for `keys` of `data`, on the current device."""
    if _tensor_parallel_size() > 1:
        raise NotAvailableError("mpu.broadcast_data across a tensor-parallel group needs "
                                "Megatron tensor parallelism, which is not available in this "
                                "version yet")
    if data is None:
        raise InputError("mpu.broadcast_data got no data on a rank that must read its own "
                         "batch (data parallelism only): pass next(data_iterator)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    out = {}
    for key in keys:
        if key not in data:
            raise InputError(f"mpu.broadcast_data: the batch has no key '{key}' (it has: "
                             f"{', '.join(map(str, data))})")
        value = torch.as_tensor(data[key])
        if value.dtype != datatype:
            raise InputError(f"mpu.broadcast_data: '{key}' is {value.dtype}, expected {datatype}")
        # from pinned memory the copy is asynchronous: no wait for the queued GPU work
        out[key] = value.to(device, non_blocking=True)
    return out
