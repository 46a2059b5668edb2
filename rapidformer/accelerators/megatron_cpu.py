"""megatron-core on CPU, for tests and laptops: the one place that bends it.

megatron-core's models, schedules and gradient buffers assume a GPU: they allocate on
`torch.cuda.current_device()`, call `torch.cuda.synchronize()`, and keep the tensor-parallel
RNG streams (dropout inside and outside tensor-parallel regions) as CUDA generator states. On a
CPU-only run `enable()` maps these onto the CPU: the current device is "cpu", synchronize does
nothing (CPU ops are synchronous), and the RNG tracker keeps and forks torch's CPU generator
state. It is called only when the run's device is the CPU, and refuses to act when a GPU is
visible, so it never touches a GPU run.
"""
from __future__ import annotations

import contextlib

import torch

_ENABLED = False


def enable() -> None:
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.enable() is for CPU-only runs; a GPU is visible")
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.fork = _fork
    _ENABLED = True


@contextlib.contextmanager
def _fork(self, name=None):
    """The tracker's fork on the CPU generator: run the block on stream `name`, keep its
    advanced state, and return to the default stream (megatron-core's fork, without its check
    that the CPU state did not move — here the CPU state is the stream)."""
    from megatron.core.tensor_parallel import random as mrandom

    name = name or mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    original = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)
