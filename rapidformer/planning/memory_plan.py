"""How much GPU memory each memory mode needs per rank, and the fastest one that fits.

    python -m rapidformer +recipe=X trainer.dry_run=true     # or: rapidformer plan +recipe=X
    python -m rapidformer +recipe=X memory=auto              # train with the mode picked here

An estimate is model states (weights, gradients, AdamW's two moments, fp32 master weights where
a mode keeps them) + activations of one micro-batch at data.max_seq_length + the buffers a mode
keeps for communication and gathered weights. The arithmetic is the ZeRO paper's for model
states, Korthikanti et al. (2022) for activations, adapted to what each mode here actually
runs (torch autocast keeps fp32 weights and an fp32 residual stream; DeepSpeed and FSDP2 run
16-bit weights). docs/memory_plan.md states it in full and how far it is from measured peaks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rapidformer.errors import ConfigError
from rapidformer.planning.model_shape import ModelShape, model_shape
from rapidformer.config.sizes import data_parallel_size, launched_world_size

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

GB = 2**30
# CUDA context, cuBLAS/cuDNN handles and allocator fragmentation: memory a process uses that
# torch's allocator statistics (and so these estimates) do not count
RESERVE_BYTES = int(1.5 * GB)
RESERVE_FRACTION = 0.05
# DeepSpeed's defaults for the buckets it allocates (elements)
DS_REDUCE_BUCKET = 500_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class Mode:
    memory: str
    offload_optimizer: bool = False
    offload_params: bool = False
    checkpoint_activations: bool = False

    def overrides(self) -> list[str]:
        return [f"memory={self.memory}",
                f"memory.offload_optimizer={str(self.offload_optimizer).lower()}",
                f"memory.offload_params={str(self.offload_params).lower()}",
                f"trainer.checkpoint_activations={str(self.checkpoint_activations).lower()}"]

    def label(self) -> str:
        extra = [name for name, on in (("offload optimizer", self.offload_optimizer),
                                       ("offload params", self.offload_params),
                                       ("act. ckpt", self.checkpoint_activations)) if on]
        return self.memory + (f" + {', '.join(extra)}" if extra else "")


@dataclass(frozen=True)
class Estimate:
    mode: Mode
    model_states: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers


def candidate_modes(cfg: RunConfig) -> list[Mode]:
    """Every mode this config may run, fastest first: sharding costs communication, activation
    checkpointing a third more compute, offload PCIe traffic and a CPU optimizer step."""
    megatron = cfg.model.arch.startswith("megatron")
    shardings = ["none", "zero1", "zero2"] if megatron else \
        ["none", "zero1", "zero2", "fsdp", "zero3"]
    if cfg.precision.dtype == "fp16":
        shardings = [s for s in shardings if s != "fsdp"]  # refused by validation
    offloads = [] if megatron else [
        Mode("zero2", offload_optimizer=True), Mode("zero3", offload_optimizer=True),
        Mode("zero3", offload_optimizer=True, offload_params=True)]
    if not megatron and cfg.precision.dtype != "fp16":
        offloads.append(Mode("fsdp", offload_optimizer=True, offload_params=True))
    plain = [Mode(s) for s in shardings]
    modes = [*plain, *(replace(m, checkpoint_activations=True) for m in plain),
             *(replace(m, checkpoint_activations=True) for m in offloads)]
    if cfg.trainer.checkpoint_activations:  # the user asked for it: keep it
        modes = [m for m in modes if m.checkpoint_activations]
    return modes


def estimate(shape: ModelShape, cfg: RunConfig, mode: Mode, on_gpu: bool = True) -> Estimate:
    if cfg.model.arch.startswith("megatron"):
        return _megatron_estimate(shape, cfg, mode)
    p, d = shape.parameters, data_parallel_size(cfg)
    mixed = cfg.precision.dtype in ("bf16", "fp16")
    deepspeed = mode.memory.startswith("zero")
    # bytes per weight / gradient / optimizer state held by the GPU
    if mode.memory in ("none",) or not mixed or mode.memory == "fsdp":
        weight, grad, optim = 4, 4, 8  # fp32 weights (autocast), fp32 grads, two fp32 moments
    else:
        weight, grad, optim = 2, 2, 12  # DeepSpeed: 16-bit weights/grads, fp32 master + moments
    sharded_weight = mode.memory in ("zero3", "fsdp")
    sharded_grad = mode.memory in ("zero2", "zero3", "fsdp")
    states = (weight * p / (d if sharded_weight else 1)
              + grad * p / (d if sharded_grad else 1)
              + optim * p / (d if mode.memory != "none" else 1))
    if mode.offload_optimizer:
        states -= optim * p / d
        if mode.memory == "zero3":  # its gradient partitions go to host memory too
            states -= grad * p / d
        if mode.memory == "fsdp":
            states -= grad * p / d
    if mode.offload_params:
        states -= weight * p / d
    # what a layer's saved tensors are made of: the residual stream (fp32 under autocast and in
    # fp32 runs, 16-bit when DeepSpeed or FSDP2 cast the weights) and the matmul outputs
    residual = 2 if mixed and mode.memory != "none" else 4
    compute = 2 if mixed else 4
    eager_attention = cfg.model.attn_implementation == "eager" or not on_gpu
    activations = _hf_activations(shape, cfg, mode, residual, compute, eager_attention)
    block = shape.block_parameters
    buffers = 0
    if deepspeed:
        buffers += min(DS_REDUCE_BUCKET, p) * grad
    if mode.memory == "zero3":
        # gathered parameters DeepSpeed may keep live (stage3_max_live_parameters), and a
        # second gradient bucket (it reduces one while filling the next)
        buffers += min(DS_MAX_LIVE_PARAMETERS, p) * weight + min(DS_REDUCE_BUCKET, p) * grad
    if mode.memory == "fsdp":
        # the unsharded current and prefetched block, and a block's unsharded fp32 gradients
        buffers += 2 * block * (2 if mixed else 4) + 2 * block * 4
    return Estimate(mode, int(states), int(activations), int(buffers))


def _hf_activations(shape: ModelShape, cfg: RunConfig, mode: Mode, residual: int, compute: int,
                    eager_attention: bool) -> int:
    s, b = cfg.data.max_seq_length, cfg.trainer.micro_batch_size
    h, f, a = shape.hidden, shape.ffn, shape.heads
    sbh = s * b * h
    # per layer: two LayerNorm inputs (residual), the matmul inputs and Q, K, V, attention's
    # output (compute dtype), two dropout masks (1 byte); the MLP's wide tensors: the
    # activation's saved input and the second matmul's input
    layer = sbh * (2 * residual + 7 * compute + 2) + s * b * f * (
        _activation_bytes(shape.activation, compute, residual) + compute)
    if eager_attention:  # scores, softmax-dropout output and its mask are kept
        layer += a * s * s * b * (2 * compute + 1)
    if mode.checkpoint_activations:
        layers = shape.layers * sbh * residual + layer  # each layer's input, one layer recomputed
    else:
        layers = shape.layers * layer
    embeddings = sbh * (residual + 1)
    # logits in the compute dtype, their fp32 copy and fp32 log-probabilities for the loss
    head = s * b * shape.vocab * (compute + 8) if shape.language_model_head else 0
    return layers + embeddings + head


def _activation_bytes(activation: str, compute: int, residual: int) -> int:
    """Bytes the MLP's activation keeps per element of its input."""
    from rapidformer.planning.model_shape import ELEMENTWISE_ACTIVATIONS

    if activation not in ELEMENTWISE_ACTIVATIONS:
        return compute
    if compute == residual:  # one dtype throughout: pow's input, tanh's output, both factors
        return 4 * compute
    # under autocast pow and tanh run in fp32: fp32 input copy, fp32 tanh output, the 16-bit
    # half-input and the fp32 (1 + tanh) factor
    return 4 + 4 + compute + 4


def _megatron_estimate(shape: ModelShape, cfg: RunConfig, mode: Mode) -> Estimate:
    """Per rank of the first pipeline stage (the one holding the most activations): Korthikanti
    et al.'s per-layer activations, megatron-core's fp32 gradient buffer and optimizer."""
    par, t = cfg.parallelism, cfg.parallelism.tensor_model_parallel_size
    pp, d = par.pipeline_model_parallel_size, data_parallel_size(cfg)
    mixed = cfg.precision.dtype in ("bf16", "fp16")
    h, a, s, b = shape.hidden, shape.heads, cfg.data.max_seq_length, cfg.trainer.micro_batch_size
    params = (shape.layers // pp) * shape.block_parameters / t \
        + (shape.vocab + cfg.model.max_position_embeddings) * h / t
    distributed = mode.memory in ("zero1", "zero2")
    optim = (12 if mixed else 8) * params / (d if distributed else 1)
    states = (2 if mixed else 4) * params + 4 * params + optim
    sbh = s * b * h
    sp = par.sequence_parallel
    layer = sbh * (34 / t if sp else 10 + 24 / t)
    # megatron-core's local DotProductAttention (attn_implementation=eager) keeps the scores,
    # their softmax-dropout output and its mask; SDPA's GPU kernels keep none of them
    scores = 5 * a * s * s * b / t if cfg.model.attn_implementation == "eager" else 0
    if mode.checkpoint_activations and cfg.trainer.recompute_granularity == "full":
        per_stage = (shape.layers // pp) * 2 * sbh / (t if sp else 1) + layer + scores
    elif mode.checkpoint_activations:
        per_stage = (shape.layers // pp) * layer
    else:
        per_stage = (shape.layers // pp) * (layer + scores)
    # 1F1B: the first stage holds `pp` micro-batches in flight
    activations = per_stage * pp + (s * b * shape.vocab / t * 8 if pp == 1 else 0)
    return Estimate(mode, int(states), int(activations), 0)


def usable_bytes(capacity: int) -> int:
    return int(capacity * (1 - RESERVE_FRACTION)) - RESERVE_BYTES


def choose(estimates: list[Estimate], capacity: int) -> Estimate | None:
    """The fastest mode (first in the list) whose estimate fits `capacity` bytes per device."""
    return next((e for e in estimates if e.total <= usable_bytes(capacity)), None)


def device_capacity(cfg: RunConfig) -> tuple[int | None, str]:
    """(bytes per device, where the number comes from): memory.device_memory_gb if given, else
    the first CUDA device's total memory; None on a machine without a GPU."""
    if cfg.memory.device_memory_gb is not None:
        return int(cfg.memory.device_memory_gb * GB), "memory.device_memory_gb"
    import torch

    if cfg.trainer.device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    return None, "no GPU"


def plan(cfg: RunConfig, shape: ModelShape) -> tuple[list[Estimate], int | None, str]:
    capacity, source = device_capacity(cfg)
    on_gpu = capacity is not None
    return [estimate(shape, cfg, m, on_gpu) for m in candidate_modes(cfg)], capacity, source


def plan_report(cfg: RunConfig, shape: ModelShape) -> str:
    estimates, capacity, source = plan(cfg, shape)
    ws, d = launched_world_size(cfg), data_parallel_size(cfg)
    lines = [f"model: {cfg.model.name} ({cfg.model.arch}), {shape.parameters:,} parameters "
             f"({shape.parameters / 1e9:.3f} B), {shape.layers} layers, hidden {shape.hidden}",
             f"per rank: {ws} process{'es' if ws > 1 else ''} (data parallel {d}), micro batch "
             f"{cfg.trainer.micro_batch_size} x sequence {cfg.data.max_seq_length}, "
             f"precision {cfg.precision.dtype}"]
    if capacity is None:
        lines.append("device: no GPU here and memory.device_memory_gb not set: no fit column "
                     "(set memory.device_memory_gb=80 to plan for an 80 GB GPU)")
    else:
        lines.append(f"device: {capacity / GB:.1f} GB ({source}); a mode fits when its estimate "
                     f"is below {usable_bytes(capacity) / GB:.1f} GB (minus 5 % and 1.5 GB for "
                     f"the CUDA context and fragmentation)")
    lines += ["", "| mode | model states GB | activations GB | buffers GB | total GB | fits |",
              "|---|---|---|---|---|---|"]
    for e in estimates:
        fits = "-" if capacity is None else ("yes" if e.total <= usable_bytes(capacity) else "no")
        lines.append(f"| {e.mode.label()} | {e.model_states / GB:.2f} | {e.activations / GB:.2f} "
                     f"| {e.buffers / GB:.2f} | {e.total / GB:.2f} | {fits} |")
    if capacity is not None:
        best = choose(estimates, capacity)
        lines.append("")
        lines.append(f"memory=auto picks: {best.mode.label()} ({' '.join(best.mode.overrides())})"
                     if best else "memory=auto: no mode fits; lower trainer.micro_batch_size or "
                     "data.max_seq_length, or add GPUs")
    return "\n".join(lines)


def choose_mode(cfg: RunConfig) -> Mode:
    """The memory mode (and recompute) memory=auto runs: the fastest whose estimate fits the
    device, the fastest of all without a GPU; ConfigError when none fits."""
    estimates, capacity, source = plan(cfg, model_shape(cfg))
    if capacity is None:
        chosen = estimates[0]
        log.info("memory=auto: no GPU here (and memory.device_memory_gb not set): using %s",
                 chosen.mode.label())
        return chosen.mode
    chosen = choose(estimates, capacity)
    if chosen is None:
        smallest = min(estimates, key=lambda e: e.total)
        raise ConfigError([
            f"memory=auto: no memory mode fits {capacity / GB:.1f} GB per GPU ({source}); the "
            f"smallest estimate is {smallest.total / GB:.1f} GB ({smallest.mode.label()}); "
            f"lower trainer.micro_batch_size or data.max_seq_length, or use more GPUs "
            f"(rapidformer plan ... prints every mode's estimate)"])
    log.info("memory=auto: %s (estimated %.1f GB per GPU of %.1f GB, %s)", chosen.mode.label(),
             chosen.total / GB, capacity / GB, source)
    return chosen.mode
