"""megatron-core's training wrappers for a Megatron model: half-precision weights with fp32
main weights, its data-parallel gradient buffers, and its optimizer.

    model = wrap_model(model, cfg)             # Float16Module (bf16/fp16) + megatron-core's DDP
    optimizer = build_optimizer(model, cfg)    # get_megatron_optimizer: fp32 main params,
                                               # fp16 dynamic loss scaling, clipping over shards
    precision = MegatronPrecision(optimizer)   # the engine's precision for this path

How the memory group maps (docs/parallelism.md):
- memory=none: every data-parallel replica keeps the whole optimizer state of its shard.
- memory=zero1 and memory=zero2: megatron-core's distributed optimizer. Gradients are
  reduce-scattered and each replica keeps only its share of the fp32 main weights and Adam
  state, then all-gathers the updated weights. Its gradient buffer stays whole, so zero2 saves no
  more than zero1 here; both names are accepted so a DeepSpeed config moves over unchanged.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")
DISTRIBUTED_OPTIMIZER_MODES = ("zero1", "zero2")


def uses_distributed_optimizer(cfg: RunConfig) -> bool:
    return cfg.memory.name in DISTRIBUTED_OPTIMIZER_MODES


def wrap_model(model: torch.nn.Module, cfg: RunConfig):
    """bf16/fp16 weights (Float16Module casts the inputs of the first stage and returns fp32
    from the last), inside megatron-core's DistributedDataParallel: contiguous fp32 gradient
    buffers, reduced over the data-parallel group once per step."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.transformer.module import Float16Module

    config = model.config
    config.bf16 = cfg.precision.dtype == "bf16"
    config.fp16 = cfg.precision.dtype == "fp16"
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=uses_distributed_optimizer(cfg))
    model = DistributedDataParallel(config, ddp_config, model)
    # megatron-core's schedule calls these: skip the reduction on all but the last micro-batch,
    # then reduce over replicas and sum the tied embedding over the first and last stage
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model


def build_optimizer(model, cfg: RunConfig):
    """get_megatron_optimizer with the run's AdamW, clipping and precision settings (fp16 uses
    Megatron's dynamic loss scaling, from precision.initial_scale and growth_interval)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t, o, p = cfg.trainer, cfg.optim, cfg.precision
    config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=cfg.scheduler.min_lr, weight_decay=t.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps,
        bf16=p.dtype == "bf16", fp16=p.dtype == "fp16", params_dtype=torch.float32,
        initial_loss_scale=p.initial_scale, loss_scale_window=p.growth_interval,
        clip_grad=t.clip_grad, use_distributed_optimizer=uses_distributed_optimizer(cfg))
    with _quiet_megatron():
        optimizer = get_megatron_optimizer(config, [model])
    # the schedule multiplies each micro-batch's loss by the loss scale before backward
    model.config.grad_scale_func = optimizer.scale_loss
    device = next(model.parameters()).device
    fused = _use_fused_adamw(optimizer, cfg.optim.fused, device)
    _foreach_fallbacks()
    log.info("megatron-core optimizer: AdamW%s, %s weights with fp32 main weights%s",
             " (torch's fused kernel)" if fused else "", p.dtype,
             ", distributed over data-parallel replicas" if config.use_distributed_optimizer
             else "")
    return optimizer


def _use_fused_adamw(optimizer, fused: str, device: torch.device) -> bool:
    """optim.fused for megatron-core's optimizer: without apex or Transformer Engine it steps a
    torch AdamW, built with torch's default (for-each kernels); auto and on switch it to the
    fused kernel on a GPU (GPT 1.3B on an H200: optimizer step 48.6 -> 29.9 ms). CPU runs keep
    the for-each AdamW unless optim.fused=on."""
    if fused == "off" or (fused == "auto" and device.type != "cuda"):
        return False
    inners = [getattr(o, "optimizer", None)
              for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    if not all(type(inner) is torch.optim.AdamW for inner in inners):
        return False  # apex's or Transformer Engine's FusedAdam: fused already
    for inner in inners:
        inner.defaults.update(fused=True, foreach=None)
        for group in inner.param_groups:
            group.update(fused=True, foreach=None)
    return True


def _foreach_fallbacks() -> None:
    """megatron-core's own stand-ins for apex's multi-tensor kernels, where neither apex nor
    Transformer Engine is installed, replaced by torch's for-each ops: its gradient norm takes
    each parameter's norm with its own kernel and then reads them all back to the host (one
    device synchronization per parameter, every step), and its scaling and copying of
    parameter lists run a kernel or two per tensor. The same arithmetic, in a few kernels and
    no synchronization."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
    for module in (clip_grads, megatron_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _scale


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """multi_tensor_l2norm's result for one list: ([the norm of all the tensors], None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """multi_tensor_scale: dst = src * scale, for each pair of the two lists."""
    sources, destinations = tensor_lists
    if all(s is d for s, d in zip(sources, destinations)):
        torch._foreach_mul_(destinations, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


class MegatronPrecision:
    """The engine's precision object for Megatron models: no autocast (the weights themselves
    are bf16/fp16) and no torch GradScaler — the loss scale, the unscaling, the inf check and
    the clipping are the megatron-core optimizer's."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.optimizer = None
        self.skipped_steps = 0

    def autocast(self):
        return contextlib.nullcontext()

    def step(self, optimizer) -> tuple[bool, float]:
        """(whether the step was taken, the gradient norm before clipping)."""
        stepped, grad_norm, _ = optimizer.step()
        self.skipped_steps += int(not stepped)
        return stepped, float("nan") if grad_norm is None else float(grad_norm)

    @property
    def loss_scale(self) -> float | None:
        if self.dtype != "fp16" or self.optimizer is None:
            return None
        return float(self.optimizer.get_loss_scale())

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}  # the scale is in the optimizer's state

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)


def zero_grad(model, optimizer) -> None:
    model.zero_grad_buffer()
    optimizer.zero_grad()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The megatron-core model under DDP and Float16Module."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def _quiet_megatron():
    """megatron-core logs every parameter group at INFO; keep the run's log readable."""
    logger = logging.getLogger("megatron.core")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
