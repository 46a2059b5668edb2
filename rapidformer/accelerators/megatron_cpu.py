"""megatron-core on CPU, for tests and laptops: the one place that bends it.

megatron-core's models, schedules and gradient buffers assume a GPU: they allocate on
`torch.cuda.current_device()` or `device="cuda"`, call `.cuda()` and `torch.cuda.synchronize()`,
and keep the tensor-parallel RNG streams (dropout inside and outside tensor-parallel regions) as
CUDA generator states. On a CPU-only run `enable()` maps these onto the CPU: the current device
is "cpu", tensors asked for on "cuda" are made on the CPU (a torch function mode for `.cuda()`
and `.to("cuda")`, a dispatch mode for factories like `torch.ones(device="cuda")`), synchronize does
nothing (CPU ops are synchronous), and the RNG tracker keeps and forks torch's CPU generator
state. It is called only when the run's device is the CPU, and refuses to act when a GPU is
visible, so it never touches a GPU run.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ENABLED = False
_UNDO: list = []  # what enable() replaced, and the modes it entered, for disable()


def enable() -> None:
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.enable() is for CPU-only runs; a GPU is visible")
    from megatron.core.tensor_parallel import random as mrandom

    from rapidformer.observability import quiet

    quiet.megatron_on_cpu()  # its advice about CUDA's device connections
    for owner, names in ((torch.cuda, ("current_device", "synchronize", "manual_seed",
                                       "get_rng_state", "_lazy_init")),
                         (mrandom, ("_get_cuda_rng_state", "_set_cuda_rng_state")),
                         (mrandom.CudaRNGStatesTracker, ("fork",))):
        _UNDO.extend((owner, name, getattr(owner, name)) for name in names)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.fork = _fork
    # factories asked for "cuda" (also inside autograd Functions and recomputed layers, where
    # torch function modes are off) are rewritten at the dispatcher; torch's lazy CUDA start,
    # which would refuse them first, has nothing to start
    torch.cuda._lazy_init = lambda: None
    # both stay on for the process (a CPU-only run has no CUDA tensors), until disable()
    modes = [_FactoriesToCpu(), _CudaToCpu()]
    for mode in modes:
        mode.__enter__()
    _UNDO.append(modes)
    _ENABLED = True


def disable() -> None:
    """Undo enable(): for a process that runs more after a CPU megatron-core run (a test
    session, a notebook), where its modes would stay under torch.compile and every factory."""
    global _ENABLED
    if not _ENABLED:
        return
    for mode in reversed(_UNDO.pop()):
        mode.__exit__(None, None, None)
    for owner, name, original in _UNDO:
        setattr(owner, name, original)
    _UNDO.clear()
    _ENABLED = False


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or \
        (isinstance(device, torch.device) and device.type == "cuda")


class _FactoriesToCpu(TorchDispatchMode):
    """aten factory calls with a CUDA device run on the CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


class _CudaToCpu(TorchFunctionMode):
    """`device="cuda"`, `.cuda()` and `.to("cuda")` give CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron-core's optimizer checks parameters by type name ("torch.cuda.FloatTensor")
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


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
