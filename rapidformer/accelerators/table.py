"""Which strategy runs a config, and which one reads a checkpoint: the one table.

    model kind  memory            graph            strategy
    megatron_*  none/zero1/zero2  eager/compile*   MegatronStrategy (TP/PP/DP, its optimizer)
    HF / own    zero1/zero2/zero3 eager/compile    ZeroStrategy (DeepSpeed)
    HF / own    fsdp              eager/compile    FSDP2Strategy
    HF / own    none              ort              OrtStrategy (ORTModule inside DDP)
    HF / own    none              eager/compile    DDPStrategy (one process or DDP)

(* compile on GPUs: each layer compiled). The combinations outside it are refused, with the
reason, before any work starts: `selection_problems` here, and each requested strategy's
`config_problems`, gathered by the one refusal pass (rapidformer/preflight.py).
"""
from __future__ import annotations

from rapidformer.accelerators.base import Strategy
from rapidformer.accelerators.recompute import CPU_OFFLOAD
from rapidformer.accelerators.ddp import DDPStrategy
from rapidformer.accelerators.fsdp import FSDP2Strategy
from rapidformer.accelerators.megatron import MegatronStrategy
from rapidformer.accelerators.ort import OrtStrategy
from rapidformer.accelerators.zero import ZERO_STAGES, ZeroStrategy
from rapidformer.checkpoint.state import CheckpointState
from rapidformer.config.schema import RunConfig
from rapidformer.errors import InputError
from rapidformer.models.wrapped_names import bare_name
from rapidformer.transforms import offline_weights

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DDPStrategy, OrtStrategy, ZeroStrategy, FSDP2Strategy,
                              MegatronStrategy)}


def selection_problems(cfg: RunConfig) -> list[str]:
    """What asks for a combination outside the table: megatron-core's parallelism or recompute
    with a Hugging Face model, ONNX Runtime with a sharding memory mode."""
    m, par, p = cfg.model, cfg.parallelism, []
    t = cfg.trainer
    if t.offload_activations and not t.checkpoint_activations:
        p.append("trainer.offload_activations=true moves the layer inputs that activation "
                 "recompute keeps to host memory, and this run recomputes nothing; add "
                 "trainer.checkpoint_activations=true, or drop trainer.offload_activations")
    if t.offload_activations and t.device == "cpu":
        p.append(CPU_OFFLOAD)
    if m.is_megatron:
        if t.offload_activations:
            p.append(f"trainer.offload_activations=true with model={m.name}: megatron-core's "
                     f"recompute keeps its inputs on the GPU here (not built for its models); "
                     f"use trainer.checkpoint_activations=true alone")
        return p
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if tp > 1 or pp > 1:
        p.append(f"parallelism (tensor {tp} x pipeline {pp}) needs a Megatron model, but "
                 f"model={m.name} is a Hugging Face model; use parallelism=dp or a Megatron "
                 f"model")
    if par.sequence_parallel:
        p.append(f"parallelism.sequence_parallel=true splits the sequence over tensor-parallel "
                 f"ranks: it needs a Megatron model with parallelism.tensor_model_parallel_size "
                 f">= 2 (this run: model={m.name}, {tp})")
    if cfg.trainer.checkpoint_activations and cfg.trainer.recompute_granularity == "selective":
        p.append(f"trainer.recompute_granularity=selective is megatron-core's; model={m.name} is "
                 f"a Hugging Face model, which recomputes whole layers: use "
                 f"trainer.recompute_granularity=full")
    if cfg.graph.name == "ort" and cfg.memory.name != "none":
        p.append(f"graph=ort with memory={cfg.memory.name}: not combined here. ORTModule exports "
                 f"the model once to one ONNX graph holding every full weight, while "
                 f"{'FSDP2' if cfg.memory.name == 'fsdp' else 'DeepSpeed ZeRO'} replaces the "
                 f"weights with shards gathered at each layer, which that graph never sees; "
                 f"onnxruntime-training 1.19.2 (its last release) trains on the CPU with torch "
                 f"2.4-2.6 only, where DDP (memory=none, several processes) is what runs. Use "
                 f"graph=ort with memory=none, or graph=compile with memory={cfg.memory.name} "
                 f"(docs/seed_flags.md)")
    return p


def requested(cfg: RunConfig) -> list[type[Strategy]]:
    """The strategies whose options the config names, each of whose refusals apply: the
    Megatron strategy for a Megatron model (its memory modes are its own optimizer's), else
    DeepSpeed or FSDP2 for the memory mode and ORT for graph=ort, or plain DDP."""
    if cfg.model.is_megatron:
        return [MegatronStrategy]
    named = [cls for cls, asked in ((ZeroStrategy, cfg.memory.name in ZERO_STAGES),
                                    (FSDP2Strategy, cfg.memory.name == "fsdp"),
                                    (OrtStrategy, cfg.graph.name == "ort")) if asked]
    return named or [DDPStrategy]


def backend_problems(cfg: RunConfig) -> list[str]:
    """What the table and the strategies a config asks for refuse in it."""
    return [*selection_problems(cfg),
            *(problem for cls in requested(cfg) for problem in cls.config_problems(cfg))]


def select(cfg: RunConfig) -> type[Strategy]:
    if cfg.model.is_megatron:
        return MegatronStrategy
    if cfg.memory.name in ZERO_STAGES:
        return ZeroStrategy
    if cfg.memory.name == "fsdp":
        return FSDP2Strategy
    if cfg.graph.name == "ort":
        return OrtStrategy
    return DDPStrategy


def strategy_of_checkpoint(state: CheckpointState, where) -> type[Strategy]:
    """The strategy that wrote a checkpoint, from its state (checkpoints written before
    strategies were recorded: from their memory mode and layout)."""
    name = state.strategy
    if name is None:
        name = ("megatron" if "tensor_parallel" in state.layout else "deepspeed"
                if state.memory in ZERO_STAGES else "fsdp2" if state.memory == "fsdp" else "ddp")
    if name not in STRATEGIES:
        raise InputError(f"{where} was written by strategy '{name}', which this version does not "
                         f"know (known: {', '.join(STRATEGIES)}); use the rapidformer that wrote it")
    return STRATEGIES[name]


def checkpoint_weights(ckpt, saved: CheckpointState) -> dict:
    """The fp32 model weights of a checkpoint, read by the strategy that wrote it, under the
    bare model's parameter names, made whole by the transforms it recorded (LoRA: its base
    read again with the adapters merged in)."""
    return offline_weights(ckpt, saved.transforms, stored_weights(ckpt, saved))


def stored_weights(ckpt, saved: CheckpointState) -> dict:
    """The fp32 tensors a checkpoint's model state holds (with a state filter: the ones it
    kept, under the wrapped model's names)."""
    state = strategy_of_checkpoint(saved, ckpt).read_weights(ckpt)
    return {bare_name(k): v.float() if v.is_floating_point() else v for k, v in state.items()}
