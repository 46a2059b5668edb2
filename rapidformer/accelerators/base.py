"""The protocol every backend strategy follows, and what its step returns.

The engine keeps the device, the process group, the RNG and the checkpoint directory protocol;
a strategy owns everything that depends on the backend: how the model and optimizer are
wrapped, the compute precision, gradient accumulation and synchronisation, the step, the files
a checkpoint holds and how they are read back (also offline, by `rapidformer export`), and how
the whole model is gathered for an export. One strategy per backend, chosen once by
`rapidformer.accelerators.table.select`.
"""
from __future__ import annotations

import abc
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from rapidformer.accelerators.precision import precision_problems
from rapidformer.accelerators.recompute import enable_recompute
from rapidformer.checkpoint.state import CheckpointState
from rapidformer.config.schema import RunConfig
from rapidformer.errors import Problem
from rapidformer.models.attention import use_training_sdpa
from rapidformer.transforms.base import WHOLE_MODEL, StateFilter

if TYPE_CHECKING:  # planning asks the strategies (planning/memory_plan.py): not the reverse
    from rapidformer.planning.run_plan import RunPlan

log = logging.getLogger("rapidformer")

# what a strategy shards over the data-parallel ranks (the memory plan's vocabulary)
OPTIMIZER_STATE, GRADIENTS, PARAMETERS = "optimizer state", "gradients", "parameters"
NOTHING: frozenset = frozenset()
EVERYTHING = frozenset({OPTIMIZER_STATE, GRADIENTS, PARAMETERS})


@dataclass(frozen=True)
class StateBytes:
    """What every rank of a strategy holds of the training state, for a config: the memory
    plan's facts (planning/memory_plan.py), known without a process group or a device.

    `weights`, `gradients`, `optimizer`: bytes per trained parameter, before sharding
    (`optimizer`: AdamW's two moments, and fp32 master weights where the strategy keeps them);
    `sharded`: what it splits over the data-parallel ranks; `offloaded`: what it keeps in host
    memory under the config's offload settings; `residual`: bytes per element of the residual
    stream its wrapper leaves (what a layer's saved inputs are made of)."""
    weights: int
    gradients: int
    optimizer: int
    sharded: frozenset = NOTHING
    offloaded: frozenset = NOTHING
    residual: int = 4

    def on_device(self, parameters: float, data_parallel: int) -> float:
        """Bytes of model state one rank keeps in device memory for `parameters` parameters
        over `data_parallel` ranks."""
        total = 0
        for kind, width in ((PARAMETERS, self.weights), (GRADIENTS, self.gradients),
                            (OPTIMIZER_STATE, self.optimizer)):
            if kind not in self.offloaded:
                total += width * parameters / (data_parallel if kind in self.sharded else 1)
        return total


@dataclass
class StepResult:
    """One optimizer step: whether it was taken (fp16 skips steps whose gradients overflowed),
    the gradient norm before clipping (a device tensor: read it only when logging), and the
    loss scale and skipped-step count of fp16 loss scaling (None / 0 without it)."""
    stepped: bool
    grad_norm: torch.Tensor | float
    loss_scale: float | None = None
    skipped_steps: int = 0


class Strategy(abc.ABC):
    """A backend. Subclasses set `name` (recorded in every checkpoint's state.json and
    manifest) and override what differs from the plain single-process defaults below."""

    name: ClassVar[str]
    # whether torch.compile's graph.scope=auto compiles each block (the wrapper shards them)
    compiles_blocks: ClassVar[bool] = False
    # Hugging Face models: the training attention path (rapidformer_sdpa), and their own
    # per-layer activation recompute for trainer.checkpoint_activations
    training_sdpa: ClassVar[bool] = True
    hf_recompute: ClassVar[bool] = True

    # --- before any work (the one refusal pass, rapidformer/preflight.py) --------------------
    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        """What this backend refuses in a config that selects it, each a sentence naming the
        keys and the fix."""
        return []

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        """What this machine lacks for the backend: by default, what the device lacks for the
        compute precision (strategies whose library owns the precision check it the same)."""
        return [Problem(text) for text in precision_problems(cfg.precision, device)]

    # --- what the memory plan counts (planning/memory_plan.py), for a config ----------------
    @classmethod
    @abc.abstractmethod
    def state_bytes(cls, cfg: RunConfig) -> StateBytes:
        """What each rank holds of the weights, gradients and optimizer state of a config this
        strategy runs: bytes per parameter, what it shards, what it offloads (keep a comment
        of where each number comes from)."""

    @classmethod
    def buffer_bytes(cls, cfg: RunConfig, parameters: int, block_parameters: int) -> int:
        """Bytes a rank keeps beside the model states for communication and gathered weights
        (buckets, unsharded blocks), for a model of `parameters` parameters whose transformer
        blocks hold `block_parameters` each: none by default."""
        return 0

    def __init__(self, cfg: RunConfig, plan: RunPlan, rank: int, world_size: int,
                 state_filter: StateFilter = WHOLE_MODEL):
        self.cfg, self.plan, self.rank, self.world_size = cfg, plan, rank, world_size
        self.device = plan.device
        # which tensors checkpoints hold: the whole model, or what a transform says (the
        # parameters that train, with LoRA)
        self.state_filter = state_filter
        self.model = self.optimizer = self.lr_scheduler = None
        self.precision = None  # the precision seam's object, where the strategy keeps one

    # --- who reads which data ---------------------------------------------------------------
    @property
    def shards(self) -> frozenset:
        """What this run splits over the data-parallel ranks: the memory plan's count."""
        return self.state_bytes(self.cfg).sharded

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size)."""
        return self.rank, self.world_size

    @property
    def counts_input(self) -> bool:
        """Whether this rank's batches count towards throughput (one rank per replica)."""
        return True

    @property
    def forward_is_collective(self) -> bool:
        """Whether every forward pass gathers weights from the other ranks, so that ranks must
        evaluate and generate in step (sharded parameters over several processes)."""
        return PARAMETERS in self.shards and self.world_size > 1

    # --- building ---------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on its device, transformed, before any wrapper: the training attention
        path and, when asked for, Hugging Face's per-layer activation recompute."""
        if self.training_sdpa:
            use_training_sdpa(model)
        if self.hf_recompute and self.cfg.trainer.checkpoint_activations:
            # before any wrapper: it hooks the model's own layers
            enable_recompute(model, offload=self.cfg.trainer.offload_activations)
        return model

    def count_parameters(self, model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    @abc.abstractmethod
    def wrap(self, model: torch.nn.Module, optimizer, build_scheduler: Callable):
        """(model, optimizer, lr_scheduler) ready to train; `build_scheduler(optimizer)` gives
        the schedule (the user's, or the configured one)."""

    def build_optimizer(self, model: torch.nn.Module):
        from rapidformer.optim import build_optimizer

        t = self.cfg.trainer
        return build_optimizer(model, self.cfg.optim, t.lr, t.weight_decay, self.device)

    # --- the step ---------------------------------------------------------------------------
    def autocast(self):
        return contextlib.nullcontext()

    def accumulate(self, last_micro_batch: bool):
        """Context for one micro-batch's forward and backward: gradients are synchronised
        between ranks on the last micro-batch of a step only."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, accumulation_steps: int) -> None:
        """Gradients of `loss`, averaged over `accumulation_steps` micro-batches."""

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Unscale, clip, step (or skip), advance the lr schedule, zero the gradients."""

    def forward_backward(self, forward_step: Callable, data_iterator, model, num_microbatches: int,
                         forward_only: bool = False, tick: Callable = lambda: None) -> list:
        """One step's micro-batches, `forward_step(data_iterator, model) -> loss` each, with
        backward unless `forward_only`; their detached losses. `tick` marks each training
        forward pass (the rank-progress counter)."""
        losses = []
        for micro in range(num_microbatches):
            sync = contextlib.nullcontext() if forward_only else \
                self.accumulate(last_micro_batch=micro == num_microbatches - 1)
            with sync:
                with self.autocast():
                    loss = forward_step(data_iterator, model)
                if not forward_only:
                    tick()
                    self.backward(loss, num_microbatches)
            losses.append(loss.detach())
        return losses

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None without loss scaling)."""
        return None if self.precision is None else self.precision.loss_scale

    @property
    def skipped_steps(self) -> int:
        return 0 if self.precision is None else self.precision.skipped_steps

    # --- checkpoints ------------------------------------------------------------------------
    @property
    def memory(self) -> str:
        """The memory mode a checkpoint records (a resume asks for the same one)."""
        return self.cfg.memory.name

    def layout(self) -> dict:
        """What a checkpoint records of the parallel layout (RNG streams restore only at the
        same one)."""
        return {}

    @abc.abstractmethod
    def save(self, directory: Path) -> dict:
        """Collective: every rank writes its shards into `directory`; returns the objects that
        rank 0 writes with torch.save (name -> object)."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Collective: the model, optimizer, schedule and precision states of `directory`."""

    def resume_problem(self, saved: CheckpointState) -> str | None:
        """Why a checkpoint that recorded `saved` cannot be resumed by this run (a phrase
        after "checkpoint PATH "), or None."""
        saved_memory = saved.memory
        if saved_memory != self.cfg.memory.name:
            return (f"was written with memory={saved_memory}, this run has "
                    f"memory={self.cfg.memory.name}; resume with the same memory mode (export it "
                    f"with its own mode first to change modes)")
        return None

    def rng_state(self) -> dict:
        """Random streams of the backend's own, beside torch's, numpy's and Python's."""
        return {}

    def set_rng_state(self, state: dict) -> None:
        """Restore what rng_state() saved (a strategy without streams of its own has none)."""

    # --- export -----------------------------------------------------------------------------
    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module under this strategy's wrappers."""
        from rapidformer.accelerators.graph import unwrap

        return unwrap(model)

    def export_model(self, model: torch.nn.Module, tokenizer, checkpoint_dir: Path | None):
        """Collective: (Hugging Face model, its full fp32 state dict or None for its own) on
        rank 0, for `save_pretrained`; None where there is nothing to export (on other ranks:
        anything). `checkpoint_dir` is the final checkpoint, for strategies that consolidate
        from files."""
        model = self.hf_model(model)
        return None if model is None else (model, None)

    def hf_model(self, model: torch.nn.Module):
        """The unwrapped model if it is a Hugging Face model (it has save_pretrained)."""
        model = self.unwrap(model)
        if not hasattr(model, "save_pretrained"):
            log.info("the model is not a Hugging Face model: no hf_model export")
            return None
        return model

    @classmethod
    @abc.abstractmethod
    def read_weights(cls, checkpoint_dir: Path) -> dict:
        """The full model weights of a checkpoint this strategy wrote, on one CPU process."""
