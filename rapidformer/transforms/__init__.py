"""The model transforms (transforms/base.py: the protocol), in the one order they apply:

    LigerKernels     kernels=liger           before the model moves, before peft wraps it
    LabelledHead     task.lm_head=labelled   (task=sft) the same: it wraps the model's forward
    FusedProjections kernels.fused_projections  q|k|v and gate|up as one linear layer each
    LoRA             peft=lora/qlora         before the model moves to its device
    Float8           precision=fp8           after liger (its SwiGLU module keeps linear layers)
    PackedSequences  trainer.unpad, data.packing

`Transforms` is what a run holds: the configured ones, asked together by the engine (apply,
after each step, the state filter, records, resume checks, export) and by the tasks (training
rows and collates). A new transform is one module with its class, one entry in TRANSFORMS, its
config option, tests and docs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidformer.errors import Problem
from rapidformer.transforms.base import WHOLE_MODEL, ApplyContext, ModelTransform, StateFilter
from rapidformer.transforms.float8 import Float8
from rapidformer.transforms.fused_projections import FusedProjections
from rapidformer.transforms.labelled_head import LabelledHead
from rapidformer.transforms.liger import LigerKernels
from rapidformer.transforms.lora import LoRA
from rapidformer.transforms.packed import PackedSequences

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

# adapters first (qlora quantizes as the model moves, and the other transforms are refused
# with them), liger's kernels before float8 (liger's SwiGLU module keeps linear layers that
# float8 then converts), the packed path last, on the final modules
# liger-kernel first: it patches the Hugging Face model's own modules and forward, which peft's
# adapters then wrap (patched after peft, it would patch the peft wrapper's forward instead)
# the labelled head wraps the Hugging Face model's forward, after liger's and before peft's
# fused projections before float8, which then converts the fused linear layers
TRANSFORMS: tuple[type[ModelTransform], ...] = (LigerKernels, LabelledHead, FusedProjections,
                                                LoRA, Float8, PackedSequences)
BY_NAME = {t.name: t for t in TRANSFORMS}


def config_problems(cfg: RunConfig) -> list[str]:
    """Every transform's config problems (each checks its own keys, on or off)."""
    return [problem for t in TRANSFORMS for problem in t.config_problems(cfg)]


def environment_problems(cfg: RunConfig, device: torch.device) -> list[Problem]:
    """What this machine lacks for the transforms the config turns on."""
    return [problem for t in TRANSFORMS if t.wanted(cfg)
            for problem in t.environment_problems(cfg, device)]


def settings(cfg: RunConfig) -> list[str]:
    """The overrides that turn on the configured transforms, in TRANSFORMS' order."""
    return [s for t in TRANSFORMS if t.wanted(cfg) for s in t.settings(cfg)]


def rounds_lengths(cfg: RunConfig) -> bool:
    """Whether batch lengths are rounded to multiples: a compiled model meets few shapes, and
    a transform may need them (float8's matmuls)."""
    return cfg.graph.name == "compile" or any(t.rounds_lengths(cfg) for t in TRANSFORMS)


def offline_weights(checkpoint_dir: Path, records: dict, weights: dict) -> dict:
    """The whole model's weights of a checkpoint, from what its strategy read, through the
    transforms it recorded (`rapidformer export`, eval, predict)."""
    for name, record in records.items():
        weights = _known(name, checkpoint_dir).offline_weights(checkpoint_dir, record, weights)
    return weights


def _known(name: str, where) -> type[ModelTransform]:
    from rapidformer.errors import InputError

    if name not in BY_NAME:
        raise InputError(f"{where} records a model transform '{name}' that this version does "
                         f"not know (known: {', '.join(BY_NAME)}); use the rapidformer that "
                         f"wrote it")
    return BY_NAME[name]


class Transforms:
    """The transforms a run's config turns on, in TRANSFORMS' order."""

    def __init__(self, cfg: RunConfig):
        self.active = [t(cfg) for t in TRANSFORMS if t.wanted(cfg)]

    # --- the model -----------------------------------------------------------------------------
    def apply(self, model: nn.Module, context: ApplyContext, before_move: bool) -> nn.Module:
        """The transforms of one stage (before the move to the device, or after it)."""
        for t in self.active:
            if t.before_move == before_move:
                model = t.apply(model, context)
        return model

    def after_step(self, model: nn.Module) -> None:
        for t in self.active:
            t.after_step(model)

    def flops_parameters(self, trainable: int, total: int) -> float:
        counts = [n for t in self.active if (n := t.flops_parameters(trainable, total))]
        return counts[0] if counts else trainable

    # --- the data --------------------------------------------------------------------------------
    def masked_lm_positions(self) -> bool:
        """Whether a transform's forward runs the masked-LM head on the masked positions."""
        return any(t.masked_lm_positions(t.cfg) for t in self.active)

    def training_rows(self, rows):
        for t in self.active:
            rows = t.training_rows(rows)
        return rows

    def training_collate(self, collate, pad_id: int, compiled: bool,
                         mlm_multiple: int | None = None):
        """The collate of training batches: a transform's, or `collate` itself."""
        for t in self.active:
            own = t.training_collate(collate, pad_id, compiled, mlm_multiple)
            if own is not None:
                return own
        return collate

    # --- checkpoints ----------------------------------------------------------------------------
    def state_filter(self) -> StateFilter:
        filters = [f for t in self.active if (f := t.state_filter()) is not None]
        return filters[0] if filters else WHOLE_MODEL

    def records(self) -> dict:
        return {t.name: r for t in self.active if (r := t.record()) is not None}

    def write_files(self, directory: Path) -> None:
        for t in self.active:
            t.write_files(directory)

    def checkpoint_written(self) -> None:
        for t in self.active:
            t.checkpoint_written()

    def resume_problems(self, records: dict, where) -> list[str]:
        """Why a checkpoint with these transform records cannot be resumed by this run."""
        mine = {t.name for t in self.active}
        problems = [p for t in self.active if (p := t.resume_problem(records.get(t.name)))]
        problems += [p for name, record in records.items() if name not in mine
                     if (p := _known(name, where).problem_without(record))]
        return problems

    # --- export ---------------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict | None):
        """(model, state dict or None) for save_pretrained, or None: nothing to export."""
        exported = (model, state_dict)
        for t in self.active:
            exported = t.export(*exported)
            if exported is None:
                return None
        return exported


__all__ = ["TRANSFORMS", "ApplyContext", "ModelTransform", "StateFilter", "Transforms",
           "config_problems", "environment_problems", "offline_weights", "rounds_lengths",
           "settings"]
