"""Which strategy runs a config, and which one reads a checkpoint: the one table.

    model kind  memory            graph            strategy
    megatron_*  none/zero1/zero2  eager/compile    MegatronStrategy (TP/PP/DP, its optimizer)
    HF / own    zero1/zero2/zero3 eager/compile    ZeroStrategy (DeepSpeed)
    HF / own    fsdp              eager/compile    FSDP2Strategy
    HF / own    none              ort              OrtStrategy (ORTModule inside DDP)
    HF / own    none              eager/compile    DDPStrategy (one process or DDP)

The combinations outside it are refused, with the reason, by rapidformer.config.validate
before any work starts.
"""
from __future__ import annotations

from rapidformer.accelerators.base import Strategy
from rapidformer.accelerators.ddp import DDPStrategy
from rapidformer.accelerators.fsdp import FSDP2Strategy
from rapidformer.accelerators.megatron import MegatronStrategy
from rapidformer.accelerators.ort import OrtStrategy
from rapidformer.accelerators.zero import ZERO_STAGES, ZeroStrategy
from rapidformer.config.schema import RunConfig
from rapidformer.errors import InputError
from rapidformer.models.wrapped_names import bare_name

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DDPStrategy, OrtStrategy, ZeroStrategy, FSDP2Strategy,
                              MegatronStrategy)}


def is_megatron(cfg: RunConfig) -> bool:
    return cfg.model.arch.startswith("megatron")


def select(cfg: RunConfig) -> type[Strategy]:
    if is_megatron(cfg):
        return MegatronStrategy
    if cfg.memory.name in ZERO_STAGES:
        return ZeroStrategy
    if cfg.memory.name == "fsdp":
        return FSDP2Strategy
    if cfg.graph.name == "ort":
        return OrtStrategy
    return DDPStrategy


def strategy_of_checkpoint(state: dict, where) -> type[Strategy]:
    """The strategy that wrote a checkpoint, from its state.json (checkpoints written before
    strategies were recorded: from their memory mode and layout)."""
    name = state.get("strategy")
    if name is None:
        memory = state.get("memory", "none")
        name = ("megatron" if "tensor_parallel" in state else "deepspeed"
                if memory in ZERO_STAGES else "fsdp2" if memory == "fsdp" else "ddp")
    if name not in STRATEGIES:
        raise InputError(f"{where} was written by strategy '{name}', which this version does not "
                         f"know (known: {', '.join(STRATEGIES)}); use the rapidformer that wrote it")
    return STRATEGIES[name]


def checkpoint_weights(ckpt, saved: dict) -> dict:
    """The fp32 model weights of a checkpoint, read by the strategy that wrote it (`saved`:
    its state.json), under the bare model's parameter names. A checkpoint of peft adapters:
    the base model read again with its adapters merged in."""
    state = stored_weights(ckpt, saved)
    if "peft" in saved:
        from rapidformer.models.adapters import merged_weights

        return merged_weights(ckpt, saved, state)
    return state


def stored_weights(ckpt, saved: dict) -> dict:
    """The fp32 tensors a checkpoint's model state holds (with peft: the trainable ones, under
    the peft model's names)."""
    state = strategy_of_checkpoint(saved, ckpt).read_weights(ckpt)
    return {bare_name(k): v.float() if v.is_floating_point() else v for k, v in state.items()}
