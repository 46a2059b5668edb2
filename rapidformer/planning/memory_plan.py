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

from rapidformer.accelerators.precision import compute_bytes
from rapidformer.accelerators.table import select
from rapidformer.errors import ConfigError
from rapidformer.planning.model_shape import ModelShape, assumed_vocabulary, model_shape
from rapidformer.config.sizes import data_parallel_size, launched_world_size
from rapidformer.refusals import config_problems

if TYPE_CHECKING:
    from rapidformer.accelerators.base import StateBytes
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

GB = 2**30
# CUDA context, cuBLAS/cuDNN handles and allocator fragmentation: memory a process uses that
# torch's allocator statistics (and so these estimates) do not count
RESERVE_BYTES = int(1.5 * GB)
RESERVE_FRACTION = 0.05
# The order modes are tried in, fastest first: sharding costs communication (FSDP2's per-block
# gathers less than ZeRO-3's), activation checkpointing a third more compute, offload PCIe
# traffic and an optimizer step on the host (DeepSpeed's CPU Adam before FSDP2's torch
# optimizer; ZeRO-1 is not offloaded: ZeRO-2 with offload moves the same and holds less).
# Which of them a config may run is not decided here: candidate_modes asks the refusal pass.
SHARDING = ("none", "zero1", "zero2", "fsdp", "zero3")
OFFLOADING = ("zero2", "zero3", "fsdp")
OFFLOADS = ((True, False), (True, True))  # (offload_optimizer, offload_params)


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
    """Every mode this config may run, fastest first: the memory modes, then the same with
    activation checkpointing, then offload with it, less those the refusal pass's config checks
    refuse beyond what they refuse in `cfg` itself (nothing refused is tried)."""
    plain = [Mode(memory) for memory in SHARDING]
    ladder = [*plain, *(replace(m, checkpoint_activations=True) for m in plain),
              *(Mode(memory, optimizer, params, checkpoint_activations=True)
                for memory in OFFLOADING for optimizer, params in OFFLOADS)]
    if cfg.trainer.checkpoint_activations:  # the user asked for it: keep it
        ladder = [m for m in ladder if m.checkpoint_activations]
    # what cfg itself is refused for (memory=auto is decided before the refusal pass reports
    # it) is no mode's doing: a mode is left out for what it adds
    own = set(config_problems(cfg))
    return [m for m in ladder if set(config_problems(with_mode(cfg, m))) <= own]


def with_mode(cfg: RunConfig, mode: Mode) -> RunConfig:
    """`cfg` run in `mode`."""
    memory = replace(cfg.memory, name=mode.memory, offload_optimizer=mode.offload_optimizer,
                     offload_params=mode.offload_params)
    trainer = replace(cfg.trainer, checkpoint_activations=mode.checkpoint_activations)
    return replace(cfg, memory=memory, trainer=trainer)


def estimate(shape: ModelShape, cfg: RunConfig, mode: Mode, on_gpu: bool = True) -> Estimate:
    """What one rank needs in `mode`: the model states and buffers the strategy that runs it
    reports (accelerators/: state_bytes, buffer_bytes), the activations of the model's shape."""
    cfg = with_mode(cfg, mode)
    strategy = select(cfg)
    facts = strategy.state_bytes(cfg)
    if cfg.model.is_megatron:
        return _megatron_estimate(shape, cfg, mode, facts)
    p, d = shape.parameters, data_parallel_size(cfg)
    states = _peft_states(shape, cfg, facts, d) if cfg.peft.name != "none" else \
        facts.on_device(p, d)
    # what a layer's saved tensors are made of: the residual stream (the strategy's: fp32
    # under autocast and in fp32 runs, 16-bit when DeepSpeed or FSDP2 cast the weights) and
    # the matmul outputs (the compute dtype)
    compute = compute_bytes(cfg.precision)
    eager_attention = cfg.model.attn_implementation == "eager" or not on_gpu
    activations = _hf_activations(shape, cfg, mode, facts.residual, compute, eager_attention)
    buffers = strategy.buffer_bytes(cfg, p, shape.block_parameters)
    return Estimate(mode, int(states), int(activations), int(buffers))


# bytes a 4-bit (NF4/FP4) weight takes with its scales: 4 bits, and an absmax per block of 64
# (8-bit with a second quantization of the scales, bitsandbytes' double_quant; fp32 without)
QLORA_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}


def _peft_states(shape: ModelShape, cfg: RunConfig, facts: StateBytes, data_parallel: int
                 ) -> float:
    """Model states under peft=lora/qlora: the frozen base's weights alone (no gradients, no
    optimizer state), the adapters trained in full as the strategy holds a trained parameter.
    The base is in bf16 under precision=bf16 where peft.base_dtype makes it so (bf16, or
    qlora's, or a config-built model.init_dtype=bf16 base) and fp32 otherwise (auto is bf16
    only for a bf16 checkpoint's values, unknown before loading it: counted fp32); qlora's
    block weights in 4 bits. Adapters: rank r on every attention and MLP projection (4 of
    hidden x hidden, 3 of hidden x ffn: an upper bound for fewer targets), and the modules
    peft.modules_to_save trains in full. Activations are counted as without peft (its dropout
    keeps a little more, peft.fused less)."""
    from rapidformer.accelerators.base import PARAMETERS

    p = cfg.peft
    # as transforms/lora_layers.py's frozen_base_dtype decides it; a strategy that holds its
    # weights in 16 bits (DeepSpeed under bf16) holds the frozen base so too
    bf16 = cfg.precision.dtype == "bf16" and p.base_dtype != "fp32" and \
        (p.base_dtype == "bf16" or p.name == "qlora" or
         (cfg.model.source == "config" and cfg.model.init_dtype == "bf16"))
    held = min(2 if bf16 else 4, facts.weights)
    blocks = shape.layers * shape.block_parameters
    rest = max(shape.parameters - blocks, 0)  # embeddings, head, final norm
    base = blocks * (QLORA_BYTES[p.double_quant] if p.name == "qlora" else held) + rest * held
    if PARAMETERS in facts.offloaded:
        base = 0
    elif PARAMETERS in facts.sharded:
        base /= data_parallel
    h, f = shape.hidden, shape.ffn
    adapters = p.r * shape.layers * (4 * 2 * h + 3 * (h + f))
    return base + facts.on_device(adapters + _saved_in_full(shape, p), data_parallel)


# peft.modules_to_save that hold the vocabulary's rows (a new token's embedding, an adapted
# output head): the others (a task head) are a few rows of hidden
VOCABULARY_MODULES = ("embed", "wte", "word_embeddings", "lm_head", "output", "shared")


def _saved_in_full(shape: ModelShape, p) -> int:
    """Parameters of peft.modules_to_save: peft trains a copy of each in full (the frozen
    original is in the base already). A vocabulary-sized module is vocabulary x hidden; any
    other is counted hidden x hidden (a task head is smaller)."""
    names = p.modules_to_save or []
    return sum(shape.vocab * shape.hidden if any(word in name for word in VOCABULARY_MODULES)
               else shape.hidden * shape.hidden for name in names)


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
        # each layer's input (in host memory with trainer.offload_activations), one layer
        # recomputed at a time
        kept = 0 if cfg.trainer.offload_activations else shape.layers * sbh * residual
        layers = kept + layer
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


def _megatron_estimate(shape: ModelShape, cfg: RunConfig, mode: Mode,
                       facts: StateBytes) -> Estimate:
    """Per rank of the first pipeline stage (the one holding the most activations): Korthikanti
    et al.'s per-layer activations; the model states of its tensor/pipeline shard as the
    Megatron strategy holds them (`facts`: fp32 gradient buffer, its optimizer)."""
    par, t = cfg.parallelism, cfg.parallelism.tensor_model_parallel_size
    pp, d = par.pipeline_model_parallel_size, data_parallel_size(cfg)
    h, a, s, b = shape.hidden, shape.heads, cfg.data.max_seq_length, cfg.trainer.micro_batch_size
    params = (shape.layers // pp) * shape.block_parameters / t \
        + (shape.vocab + cfg.model.max_position_embeddings) * h / t
    states = facts.on_device(params, d)
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


def gb(value: float) -> str:
    """Bytes as GB with the digits that tell two estimates apart (a tiny model's too)."""
    value /= GB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3f}"


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
    if assumed := assumed_vocabulary(cfg):
        lines.append(assumed)
    if capacity is None:
        lines.append("device: no GPU here and memory.device_memory_gb not set: no fit column "
                     "(set memory.device_memory_gb=80 to plan for an 80 GB GPU)")
    else:
        lines.append(f"device: {capacity / GB:.1f} GB ({source}); a mode fits when its estimate "
                     f"is below {usable_bytes(capacity) / GB:.1f} GB (minus 5 % and 1.5 GB for "
                     f"the CUDA context and fragmentation)")
    lines += ["", "| mode | model states GB | activations GB | buffers GB | total GB | fits |",
              "|---|---|---|---|---|---|"]
    if not estimates:
        lines.append("| (every memory mode is refused with this config) | | | | | |")
    for e in estimates:
        fits = "-" if capacity is None else ("yes" if e.total <= usable_bytes(capacity) else "no")
        lines.append(f"| {e.mode.label()} | {e.model_states / GB:.2f} | {e.activations / GB:.2f} "
                     f"| {e.buffers / GB:.2f} | {e.total / GB:.2f} | {fits} |")
    if capacity is not None and estimates:
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
    if not estimates:
        raise ConfigError([f"memory=auto: every memory mode is refused with this config "
                           f"(memory={SHARDING[0]}: "
                           f"{'; '.join(config_problems(with_mode(cfg, Mode(SHARDING[0]))))})"])
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


def over_device(cfg: RunConfig) -> str:
    """A warning for a run whose own memory mode, given by hand, the plan says does not fit its
    device, or "" (the caller skips memory=auto's and accelerate=auto's: the plan admitted
    theirs). The run still starts: the plan sizes a micro batch at data.max_seq_length, and
    data shorter than that may fit. Not for a user_script (its model and data are its own),
    and never an error: a plan that cannot be made says nothing."""
    capacity, source = device_capacity(cfg)
    if capacity is None or cfg.user_script:
        return ""
    mode = Mode(cfg.memory.name, cfg.memory.offload_optimizer, cfg.memory.offload_params,
                cfg.trainer.checkpoint_activations)
    try:
        shape = model_shape(cfg)
        needed = estimate(shape, cfg, mode).total
    except Exception as exc:  # noqa: BLE001 - a warning's plan must not stop a run
        log.debug("no memory plan for the start's warning: %s", exc)
        return ""
    if needed <= usable_bytes(capacity):
        return ""
    return (f"the memory plan estimates {gb(needed)} GB per device for memory mode "
            f"{mode.label()} with trainer.micro_batch_size={cfg.trainer.micro_batch_size} at "
            f"data.max_seq_length={cfg.data.max_seq_length}, over the "
            f"{gb(usable_bytes(capacity))} GB usable of {gb(capacity)} GB ({source}): the run's "
            f"longest batches may not fit; {fitting_advice(cfg, shape)}")


def fitting_advice(cfg: RunConfig, shape: ModelShape | None = None) -> str:
    """What makes a config fit: memory=auto where some mode fits the device, else what is
    left (the plan's own words where none does); `shape`: the model's, when known."""
    try:
        estimates, capacity, _ = plan(cfg, shape or model_shape(cfg))
    except Exception:  # noqa: BLE001 - advice without the plan's answer
        estimates, capacity = [], None
    if capacity is not None and estimates and choose(estimates, capacity) is None:
        return ("no memory mode fits this device by the plan: lower "
                "trainer.micro_batch_size (trainer.global_batch_size kept) or "
                "data.max_seq_length, or use more GPUs (`rapidformer plan` with the same "
                "settings shows each mode's estimate)")
    return ("memory=auto picks a mode that fits (or trainer.checkpoint_activations=true, or "
            "a smaller trainer.micro_batch_size with trainer.global_batch_size kept; "
            "`rapidformer plan` with the same settings shows each mode's estimate)")
