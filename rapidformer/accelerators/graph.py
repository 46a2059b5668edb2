"""Graph optimization: eager, or torch.compile.

graph.scope=auto (the default) compiles the whole model where nothing shards it (one process or
DDP) and each transformer block where FSDP2 or DeepSpeed does. The whole-model compile also
fuses the embeddings, the head and the loss (on one H200, BERT-base MLM: 1.25x the tokens/s of
the per-block compile, docs/benchmarks.md); the per-block (regional) compile keeps compile time
independent of depth (the identical blocks share one compiled graph) and leaves the blocks for
FSDP2 to shard and DeepSpeed to partition. graph.scope=blocks / model choose one. auto compiles the
blocks too where the model cannot be compiled whole (liger-kernel's fused loss training the
output layer: transforms/liger.py says why).
"""
from __future__ import annotations

import logging

import torch

from rapidformer.config.schema import GraphConfig
from rapidformer.errors import ConfigError
from rapidformer.models.blocks import transformer_blocks
from rapidformer.transforms.liger import whole_model_compile_problem

log = logging.getLogger("rapidformer")


def _compile_kwargs(g: GraphConfig) -> dict:
    kwargs = {"fullgraph": g.fullgraph, "dynamic": g.dynamic}
    if g.mode:
        kwargs["mode"] = g.mode
    if g.options:
        check_inductor_options(g.options)
        kwargs["options"] = dict(g.options)
    return kwargs


def check_inductor_options(options: dict) -> None:
    """Unknown names fail here, before the model is built, not at the first compiled step."""
    from torch._inductor import config as inductor_config

    from rapidformer.config.typed import closest

    valid = set(inductor_config.get_config_copy())
    problems = []
    for name in options:
        if name not in valid:
            hint = closest(name, valid)
            problems.append(f"graph.options.{name}: not an inductor option"
                            + (f"; did you mean '{hint}'?" if hint
                               else " (see torch._inductor.config)"))
    if problems:
        raise ConfigError(problems)


def compile_scope(g: GraphConfig, sharded: bool, model: torch.nn.Module) -> str:
    """graph.scope, with auto decided: the whole model unless the strategy shards its blocks
    (FSDP2, DeepSpeed) or the model cannot be compiled whole (`whole_model_compile_problem`);
    graph.scope=model for such a model is refused."""
    problem = whole_model_compile_problem(unwrap(model))
    if g.scope == "model" and problem:
        raise ConfigError([f"graph.scope=model: {problem} (the first step would fail); use "
                           f"graph.scope=auto or blocks, which compile each transformer block, "
                           f"or kernels.fused_linear_cross_entropy=false"])
    if g.scope != "auto":
        return g.scope
    return "blocks" if sharded or problem else "model"


def compile_blocks(model: torch.nn.Module, g: GraphConfig, sharded: bool) -> torch.nn.Module:
    """graph=compile, scope=blocks: before any wrapper (DDP, FSDP2, DeepSpeed)."""
    if g.name != "compile" or compile_scope(g, sharded, model) != "blocks":
        return model
    blocks = transformer_blocks(model)
    problem = whole_model_compile_problem(model)
    if not blocks and problem and g.scope == "auto":
        raise ConfigError([f"graph=compile: {problem}, and {type(model).__name__} has no "
                           f"repeated transformer blocks (children of a ModuleList) to compile "
                           f"instead; use graph=eager or kernels.fused_linear_cross_entropy=false"])
    if not blocks:
        raise ConfigError([f"graph.scope=blocks: {type(model).__name__} has no repeated "
                           f"transformer blocks (children of a ModuleList) to compile; use "
                           f"graph.scope=model"])
    if problem and g.scope == "auto" and not sharded:
        log.info("graph=compile: each transformer block, not the whole model: %s", problem)
    for block in blocks:
        block.compile(**_compile_kwargs(g))
    log.info("graph=compile: %d transformer blocks compiled (regional)", len(blocks))
    return model


def apply_graph(model: torch.nn.Module, g: GraphConfig, sharded: bool) -> torch.nn.Module:
    """graph=compile, scope=model: around the (DDP-wrapped) model."""
    if g.name != "compile" or compile_scope(g, sharded, model) != "model":
        return model
    log.info("graph=compile: the whole model compiled")
    return torch.compile(model, **_compile_kwargs(g))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under torch.compile's and DDP's wrappers (for state dicts, export)."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def blocks_only_problems(cfg, sharder: str) -> list[str]:
    """A strategy that shards each transformer block compiles block by block: the whole-model
    scope would wrap what it shards."""
    if cfg.graph.name == "compile" and cfg.graph.scope == "model":
        return [f"graph.scope=model with memory={cfg.memory.name}: the whole-model compile wraps "
                f"what {sharder} shards; use graph.scope=blocks (or auto, the default), which "
                f"compiles each transformer block"]
    return []
