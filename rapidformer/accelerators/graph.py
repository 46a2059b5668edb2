"""Graph optimization: eager, or torch.compile.

graph.scope=blocks (the default) compiles each transformer block in place (regional
compilation): the blocks are identical, so the first one's compiled code serves the rest and
compile time does not grow with depth, and the blocks are what FSDP2 shards and DeepSpeed
partitions, so both keep working around them. graph.scope=model compiles the whole module
(embeddings, head and loss too: more fusion, longer compile), with DDP only.
"""
from __future__ import annotations

import logging

import torch

from rapidformer.config.schema import GraphConfig
from rapidformer.errors import ConfigError, NotAvailableError

log = logging.getLogger("rapidformer")


def _compile_kwargs(g: GraphConfig) -> dict:
    kwargs = {"fullgraph": g.fullgraph, "dynamic": g.dynamic}
    if g.mode:
        kwargs["mode"] = g.mode
    return kwargs


def refuse_ort(g: GraphConfig) -> None:
    if g.name == "ort":
        raise NotAvailableError(
            f"graph=ort (ONNX Runtime training) is not available in this version yet; its last "
            f"release (onnxruntime-training 1.19.2) trains only with torch 2.4-2.6 (this "
            f"environment: torch {torch.__version__}); use graph=compile or graph=eager")


def compile_blocks(model: torch.nn.Module, g: GraphConfig) -> torch.nn.Module:
    """graph=compile, scope=blocks: before any wrapper (DDP, FSDP2, DeepSpeed)."""
    refuse_ort(g)
    if g.name != "compile" or g.scope != "blocks":
        return model
    from rapidformer.accelerators.fsdp import transformer_blocks

    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError([f"graph.scope=blocks: {type(model).__name__} has no repeated "
                           f"transformer blocks (children of a ModuleList) to compile; use "
                           f"graph.scope=model"])
    for block in blocks:
        block.compile(**_compile_kwargs(g))
    log.info("graph=compile: %d transformer blocks compiled (regional)", len(blocks))
    return model


def apply_graph(model: torch.nn.Module, g: GraphConfig) -> torch.nn.Module:
    """graph=compile, scope=model: around the (DDP-wrapped) model (after compile_blocks, which
    has refused graph=ort)."""
    if g.name != "compile" or g.scope != "model":
        return model
    log.info("graph=compile: the whole model compiled")
    return torch.compile(model, **_compile_kwargs(g))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under torch.compile's and DDP's wrappers (for state dicts, export)."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model
