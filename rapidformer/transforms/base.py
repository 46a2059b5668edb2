"""The model-transform seam: one class per model-level feature, behind the protocol below.

A transform changes the model a template, task or own-loop script built (adapters, float8
linear layers, fused kernels, the unpadded attention path) and everything that follows from it:
what trains and what a checkpoint holds, what a checkpoint records and whether a resume fits,
what the Hugging Face export is, and how many FLOPs a step does. The engine applies the
configured transforms in the one declared order of `rapidformer.transforms.TRANSFORMS` and
hands the strategies a `StateFilter`; nothing outside this package names a transform.
torchtitan's model converters (`protocols/model.py`) are the model of this seam.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from rapidformer.errors import Problem

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig


@dataclass(frozen=True)
class ApplyContext:
    """What a transform may need to know of the run when it applies: where the model goes,
    where rank 0 keeps files of its own (None on the other ranks), and whether batch lengths
    are rounded to multiples (a compiled model, float8's matmuls)."""
    device: torch.device
    run_dir: Path | None
    rounds_lengths: bool = False


class StateFilter:
    """Which of the model's tensors a checkpoint holds: the whole model (this default), or,
    for a transform that freezes a base (LoRA), the parameters that train. Strategies ask it;
    none reads the config to decide."""

    saves_frozen: ClassVar[bool] = True

    def state_dict(self, model: nn.Module) -> dict:
        """The model state a one-file checkpoint holds."""
        return model.state_dict()

    def loaded(self, model: nn.Module, missing: list[str], unexpected: list[str], where) -> None:
        """After a load that did not need every key (`saves_frozen` false): raise when the
        checkpoint does not fit."""

    def frozen_state(self, model: nn.Module) -> dict:
        """The full-precision state of what a checkpoint leaves out (the frozen base), for an
        export that gathers the rest from the checkpoint."""
        return {}


WHOLE_MODEL = StateFilter()


class ModelTransform:
    """One model-level feature. Subclasses set `name` (the key of its checkpoint record) and
    override what they change; the defaults change nothing."""

    name: ClassVar[str]
    # applied before the model moves to its device (qlora's 4-bit layers quantize as they move);
    # the others apply on the device, before the strategy prepares the model
    before_move: ClassVar[bool] = False

    # --- before any work (the one refusal pass, rapidformer/preflight.py) --------------------
    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        """Whether the config turns this transform on."""
        raise NotImplementedError

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        """The overrides that turn it on, as a command line writes them (a stopped run's advice
        names them)."""
        return []

    @classmethod
    def rounds_lengths(cls, cfg: RunConfig) -> bool:
        """Whether this transform needs batch lengths rounded to multiples of 16 in eager mode
        too (as a compiled model's are)."""
        return False

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        """What is wrong with the config for this transform, each a sentence naming the keys
        and the fix. Called for every config, on or off: keys of an option not picked are the
        transform's to refuse."""
        return []

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        """What this machine lacks for it (a library, a device kind); called when it is on."""
        return []

    # --- the run ------------------------------------------------------------------------------
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        """The transformed model (in place or a new module)."""
        return model

    def after_step(self, model: nn.Module) -> None:
        """After each optimizer step, on the wrapped model."""

    # --- the data a task feeds it ----------------------------------------------------------------
    @classmethod
    def masked_lm_positions(cls, cfg: RunConfig) -> bool:
        """Whether its forward runs BERT's masked-LM head on the positions that carry a loss
        only, evaluation included (a task then adds those positions to every batch)."""
        return False

    def training_rows(self, rows):
        """A task's encoded training rows as this transform trains on them."""
        return rows

    def training_collate(self, collate, pad_id: int, compiled: bool, mlm_multiple: int | None):
        """The training batches' collate around a task's padding `collate` (None: unchanged).
        `compiled`: lengths are rounded to multiples; `mlm_multiple`: masked-LM positions are
        wanted, padded to a multiple of it."""
        return None

    def flops_parameters(self, trainable: int, total: int) -> float | None:
        """The parameter count whose 6N per token is the step's FLOPs, when this transform
        changes it (None: the trainable parameters, the plain rule)."""
        return None

    # --- checkpoints ----------------------------------------------------------------------------
    def state_filter(self) -> StateFilter | None:
        """What checkpoints hold, when this transform decides it (None: it does not)."""
        return None

    def record(self) -> dict | None:
        """What a checkpoint records of this transform (None: nothing, it changes no state)."""
        return None

    def write_files(self, directory: Path) -> None:
        """Files of its own into a checkpoint directory, written by rank 0 before the seal."""

    def checkpoint_written(self) -> None:
        """After a checkpoint is sealed, on rank 0 (e.g. what it saved and left out)."""

    def resume_problem(self, record: dict | None) -> str | None:
        """Why a checkpoint with this transform's `record` (None: it has none) cannot be
        resumed by this run, as a phrase after "checkpoint PATH "; None when it can."""
        return None

    @classmethod
    def problem_without(cls, record: dict) -> str | None:
        """Why a checkpoint that recorded this transform cannot be resumed by a run without
        it, as a phrase after "checkpoint PATH "; None when it can."""
        return None

    # --- export ---------------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict | None):
        """(model, state dict or None) for `save_pretrained`, from what the strategy gathered;
        None when there is nothing to export."""
        return model, state_dict

    @classmethod
    def offline_weights(cls, checkpoint_dir: Path, saved: dict, weights: dict) -> dict:
        """The whole model's weights of a checkpoint that recorded this transform, from the
        tensors the strategy read (`rapidformer export`, eval, predict)."""
        return weights


def shapes_for_graphs(cfg: RunConfig) -> bool:
    """Whether batch shapes are bounded for CUDA graphs (one recording per input shape, where
    plain compile covers varying shapes with one dynamic graph): torch.compile's modes or
    options ask for them, the run is on a GPU (elsewhere torch skips them), and data.pad_to=auto
    leaves the rounding to rapidformer."""
    g = cfg.graph
    asked = g.name == "compile" and (g.mode in ("reduce-overhead", "max-autotune")
                                     or bool((g.options or {}).get("triton.cudagraphs")))
    device = cfg.trainer.device
    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return asked and gpu and cfg.data.pad_to == "auto"
