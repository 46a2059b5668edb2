"""memory=zero1/zero2/zero3: DeepSpeed ZeRO stages 1-3, configured from the resolved config.

DeepSpeed owns precision (bf16/fp16 weights with fp32 masters), gradient accumulation,
clipping and the optimizer step when it is on; the strategy only forwards to it. Its checkpoints
leave the frozen parameters out when the state filter does (`exclude_frozen_parameters`).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from rapidformer.accelerators.base import (GRADIENTS, OPTIMIZER_STATE, PARAMETERS, StateBytes,
                                           StepResult, Strategy)
from rapidformer.accelerators.graph import blocks_only_problems, compile_blocks
from rapidformer.accelerators.precision import check_device_supports, compute_bytes
from rapidformer.config.schema import RunConfig
from rapidformer.errors import EXIT_NOT_AVAILABLE, ConfigError, NotAvailableError, Problem
from rapidformer.runtime.distributed import join_group_of_one
from rapidformer.transforms.base import WHOLE_MODEL
from rapidformer.runtime.packages import installed

log = logging.getLogger("rapidformer")

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
INSTALL = "memory=zero1/zero2/zero3 needs DeepSpeed: pip install 'deepspeed>=0.19,<0.20'"
CHECKPOINT_TAG = "deepspeed"
# DeepSpeed's defaults (elements) for what deepspeed_config leaves unset: reduce_bucket_size,
# stage3_max_live_parameters
DS_REDUCE_BUCKET = 500_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000


def import_deepspeed(device: torch.device):
    if device.type == "cpu":
        # DeepSpeed picks its accelerator at import time; on a CPU machine it must be told
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise NotAvailableError(INSTALL) from exc
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


def fp16_problems(cfg: RunConfig, device_type: str) -> list[str]:
    if cfg.precision.dtype == "fp16" and device_type == "cpu":
        return [f"precision=fp16 with memory={cfg.memory.name}: DeepSpeed has no fp16 on a CPU; "
                f"use precision=bf16 or fp32, or run on a GPU"]
    return []


def deepspeed_config(cfg: RunConfig, accumulation: int, device: torch.device) -> dict:
    """DeepSpeed's JSON config, every value taken from the resolved config."""
    t, p, m = cfg.trainer, cfg.precision, cfg.memory
    if problems := fp16_problems(cfg, device.type) + ZeroStrategy.config_problems(cfg):
        raise ConfigError(problems)
    zero: dict = {"stage": ZERO_STAGES[m.name]}
    if m.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if m.offload_params:
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


class ZeroStrategy(Strategy):
    """DeepSpeed's engine around the model and the client optimizer: it owns the compute
    precision, the accumulation boundary, clipping and the step; checkpoints are its own
    per-rank files under `deepspeed/`."""

    name = "deepspeed"
    compiles_blocks = True

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        m, t, p = cfg.memory, cfg.trainer, []
        if m.offload_params and m.name != "zero3":
            p.append(f"memory.offload_params=true needs memory=zero3 (ZeRO stage "
                     f"{ZERO_STAGES[m.name]} does not partition parameters)")
        if not t.save_last and t.export_hf:
            p.append(f"trainer.save_last=false with trainer.export_hf=true and memory={m.name}: "
                     f"the export reads DeepSpeed's final checkpoint; keep trainer.save_last=true "
                     f"or set trainer.export_hf=false")
        return p + blocks_only_problems(cfg, "DeepSpeed")

    @classmethod
    def state_bytes(cls, cfg: RunConfig) -> StateBytes:
        stage, m = ZERO_STAGES[cfg.memory.name], cfg.memory
        # bf16/fp16: DeepSpeed casts the module (16-bit weights and gradients, so a 16-bit
        # residual stream) and keeps fp32 master weights and AdamW's two fp32 moments (12
        # bytes); fp32: fp32 weights, gradients and the two moments
        width = compute_bytes(cfg.precision)
        weights, gradients, optimizer = (2, 2, 12) if width == 2 else (4, 4, 8)
        # stage 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
        sharded = frozenset([OPTIMIZER_STATE, GRADIENTS, PARAMETERS][:stage])
        offloaded = set()
        if m.offload_optimizer:  # offload_optimizer; ZeRO-3's gradient partitions go with it
            offloaded |= {OPTIMIZER_STATE, GRADIENTS} if stage == 3 else {OPTIMIZER_STATE}
        if m.offload_params:  # offload_param (ZeRO-3 only)
            offloaded.add(PARAMETERS)
        return StateBytes(weights, gradients, optimizer, sharded, frozenset(offloaded),
                          residual=width)

    @classmethod
    def buffer_bytes(cls, cfg: RunConfig, parameters: int, block_parameters: int) -> int:
        facts = cls.state_bytes(cfg)
        # its gradient reduce bucket
        buffers = min(DS_REDUCE_BUCKET, parameters) * facts.gradients
        if ZERO_STAGES[cfg.memory.name] == 3:
            # the gathered parameters it may keep live (stage3_max_live_parameters), and a
            # second gradient bucket (it reduces one while filling the next)
            buffers += min(DS_MAX_LIVE_PARAMETERS, parameters) * facts.weights \
                + min(DS_REDUCE_BUCKET, parameters) * facts.gradients
        return buffers

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        if not installed("deepspeed"):
            return [Problem(INSTALL, EXIT_NOT_AVAILABLE)]
        return [*super().environment_problems(cfg, device),
                *(Problem(text) for text in fp16_problems(cfg, device.type))]

    def __init__(self, cfg, plan, rank, world_size, state_filter=WHOLE_MODEL):
        super().__init__(cfg, plan, rank, world_size, state_filter)
        check_device_supports(cfg.precision, self.device)
        self.stage = ZERO_STAGES[cfg.memory.name]
        self.ds = None
        self._skipped = 0  # DeepSpeed's count of overflow-skipped steps at the last step

    def wrap(self, model, optimizer, build_scheduler):
        model = compile_blocks(model, self.cfg.graph, self.compiles_blocks)
        optimizer = optimizer if optimizer is not None else self.build_optimizer(model)
        lr_scheduler = build_scheduler(optimizer)
        deepspeed = import_deepspeed(self.device)
        join_group_of_one(self.device)
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts on it, even for one
        config = deepspeed_config(self.cfg, self.plan.accumulation, self.device)
        self.ds, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
        log.info("memory=%s: DeepSpeed ZeRO stage %d", self.cfg.memory.name, self.stage)
        self.model, self.optimizer, self.lr_scheduler = self.ds, optimizer, lr_scheduler
        return self.ds, optimizer, lr_scheduler

    def backward(self, loss, accumulation_steps: int) -> None:
        # DeepSpeed divides by its own accumulation steps and steps at the boundary
        self.ds.backward(loss)
        self.ds.step()

    def step(self) -> StepResult:
        norm = self.ds.get_global_grad_norm()
        skipped = self.ds.skipped_steps
        stepped = skipped == self._skipped
        self._skipped = skipped
        return StepResult(stepped, torch.tensor(float(norm) if norm is not None else float("nan")),
                          self.loss_scale, skipped)

    @property
    def loss_scale(self) -> float | None:
        if self.cfg.precision.dtype != "fp16" or self.ds is None:
            return None
        scale = getattr(self.ds.optimizer, "cur_scale", None)
        return float(scale) if scale is not None else None

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    def save(self, directory: Path) -> dict:
        self.ds.save_checkpoint(str(directory), tag=CHECKPOINT_TAG,
                                exclude_frozen_parameters=not self.state_filter.saves_frozen)
        return {}

    def resume_problem(self, saved) -> str | None:
        problem = super().resume_problem(saved)
        written_by = saved.world_size
        if problem or written_by == self.world_size:
            return problem
        # DeepSpeed's optimizer shards are split by the number of processes that wrote them
        return (f"was written by {written_by} processes with memory={self.cfg.memory.name}, "
                f"this run has {self.world_size}; ZeRO's shards load only into as many "
                f"processes: run with launcher.nproc_per_node={written_by}, or export its "
                f"weights (`rapidformer export` on that checkpoint) and start a new run from "
                f"them (model.source=pretrained model.name_or_path=EXPORT_DIR)")

    def load(self, directory: Path) -> None:
        # a filter that leaves the frozen weights out: the module keeps them as they are
        self.ds.load_checkpoint(str(directory), tag=CHECKPOINT_TAG,
                                load_module_strict=self.state_filter.saves_frozen)
        self._skipped = self.ds.skipped_steps

    def unwrap(self, model):
        return self.ds.module if self.ds is not None else super().unwrap(model)

    def export_model(self, model, tokenizer, checkpoint_dir):
        model = self.hf_model(model)
        if model is None:
            return None
        frozen = {} if self.state_filter.saves_frozen else self._frozen_base_state()  # collective
        if self.rank != 0:
            return None
        return model, {**frozen, **consolidated_state_dict(str(checkpoint_dir))}

    def _frozen_base_state(self) -> dict | None:
        """The whole module's state on rank 0, for the frozen base weights its checkpoints
        leave out (the trainable ones come from the checkpoint's fp32 masters). ZeRO-3 gathers
        them layer by layer (collective); below it every rank holds them whole. With bf16,
        DeepSpeed holds the frozen base in bf16: the export merges into those values, the
        ones the adapters were trained against."""
        if self.stage == 3:
            return self.ds._zero3_consolidated_16bit_state_dict()
        return self.state_filter.frozen_state(self.ds.module) if self.rank == 0 else None

    @classmethod
    def read_weights(cls, checkpoint_dir: Path) -> dict:
        import_deepspeed(torch.device("cpu"))
        return consolidated_state_dict(str(checkpoint_dir))
