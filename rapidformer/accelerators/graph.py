"""Graph optimization: eager, or torch.compile on the model."""
from __future__ import annotations

import torch

from rapidformer.config.schema import GraphConfig
from rapidformer.errors import NotAvailableError


def apply_graph(model: torch.nn.Module, g: GraphConfig) -> torch.nn.Module:
    if g.name == "eager":
        return model
    if g.name == "compile":
        kwargs = {"fullgraph": g.fullgraph, "dynamic": g.dynamic}
        if g.mode:
            kwargs["mode"] = g.mode
        return torch.compile(model, **kwargs)
    raise NotAvailableError(
        "graph=ort (ONNX Runtime training) is not available in this version yet; use "
        "graph=compile or graph=eager")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under torch.compile's and DDP's wrappers (for state dicts, export)."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model
