"""Memory modes: DeepSpeed ZeRO stages 1-3, configured from the resolved config.

DeepSpeed owns precision (bf16/fp16 weights with fp32 masters), gradient accumulation,
clipping and the optimizer step when it is on; the engine then only forwards to it.
"""
from __future__ import annotations

import math
import os

import torch

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError, NotAvailableError

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
CHECKPOINT_TAG = "deepspeed"


def import_deepspeed(device: torch.device):
    if device.type == "cpu":
        # DeepSpeed picks its accelerator at import time; on a CPU machine it must be told
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise NotAvailableError("memory=zero1/zero2/zero3 needs DeepSpeed: pip install "
                                "'deepspeed>=0.19,<0.20'") from exc
    if device.type == "cpu":
        _skip_inference_shm_op()
    return deepspeed


def _skip_inference_shm_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce on first init (25 s on 2
    cores, again in every new environment) that only its inference engine calls; training's
    collectives go through torch.distributed either way, so it is not built."""
    import importlib

    # by module path: the package attribute `deepspeed.comm.torch` is the torch module itself
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm, "build_shm_op"):
        ds_comm.build_shm_op = lambda: None


def check_zero_precision(cfg: RunConfig, device_type: str) -> None:
    if cfg.memory.name in ZERO_STAGES and cfg.precision.dtype == "fp16" and device_type == "cpu" \
            and not cfg.model.arch.startswith("megatron"):  # megatron-core's optimizer, not DeepSpeed
        raise ConfigError([f"precision=fp16 with memory={cfg.memory.name}: DeepSpeed has no fp16 "
                           f"on a CPU; use precision=bf16 or fp32, or run on a GPU"])


def deepspeed_config(cfg: RunConfig, accumulation: int, device: torch.device) -> dict:
    """DeepSpeed's JSON config, every value taken from the resolved config."""
    t, p, m = cfg.trainer, cfg.precision, cfg.memory
    check_zero_precision(cfg, device.type)
    zero: dict = {"stage": ZERO_STAGES[m.name]}
    if m.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if m.offload_params:
        if zero["stage"] != 3:
            raise ConfigError([f"memory.offload_params=true needs memory=zero3 (ZeRO stage "
                               f"{zero['stage']} does not partition parameters)"])
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": t.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": p.dtype == "bf16"},
        "fp16": {"enabled": p.dtype == "fp16", "loss_scale": 0,
                 "initial_scale_power": int(math.log2(p.initial_scale)),
                 "loss_scale_window": p.growth_interval},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if zero["stage"] > 1 and m.offload_optimizer:
        # DeepSpeed refuses a client torch optimizer with optimizer offload
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def consolidated_state_dict(checkpoint_dir: str) -> dict:
    """fp32 weights gathered from a ZeRO checkpoint's shards (any stage), on one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=CHECKPOINT_TAG)
