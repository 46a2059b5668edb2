"""RapidformerEngine: the device, the process group, the random streams and the checkpoint
directory protocol, and the small user contract (`compose`, `backward`, `step`, `gather`) that
templates and own-loop scripts share. Everything that depends on the backend is the run's
strategy's (rapidformer.accelerators.table picks it once)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rapidformer.accelerators.base import StepResult
from rapidformer.accelerators.table import select
from rapidformer.compat.args import active
from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError
from rapidformer.observability.flops import ModelFlops, model_shape
from rapidformer.models.hf import kv_cache_as_configured, training_without_kv_cache
from rapidformer.optim import build_scheduler
from rapidformer.planning.run_plan import RunPlan
from rapidformer.checkpoint import store
from rapidformer.checkpoint.protocol import CheckpointProtocol
from rapidformer.checkpoint.resume import ThisRun, resume_plan
from rapidformer.checkpoint.state import CheckpointState, model_record, read_state
from rapidformer.runtime.rank_progress import RankProgress
from rapidformer.runtime.distributed import gather_rows, init_distributed
from rapidformer.runtime.gpu_math import apply_gpu_math_settings
from rapidformer.file_modes import honour_umask
from rapidformer.runtime.rng import rng_state, seed_everything, set_rng_state
from rapidformer.transforms import ApplyContext, Transforms, rounds_lengths

log = logging.getLogger("rapidformer")
# the user-script runner checks that a script built an engine and trained with it (its
# backward or step: an own loop may step the optimizer itself, as the seed's example does)
ENGINES_CREATED = 0
TRAINING_CALLS = 0


class RapidformerEngine:
    """Built once per process. `RapidformerEngine()` (the seed's call, in a user script) takes
    the run that the entrypoint activated; `plan` is the factory's RunPlan (built here when
    not given)."""

    def __init__(self, cfg: RunConfig | None = None, run_dir: str | os.PathLike | None = None,
                 plan: RunPlan | None = None):
        global ENGINES_CREATED
        if cfg is None:  # the seed's no-argument form, in a user script
            run = active()
            cfg, run_dir = run.cfg, run.run_dir
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.trainer.output_dir)
        self.plan = plan or RunPlan.for_process(cfg)
        self.device = self.plan.device
        self.rank, self.world_size = init_distributed(self.device, cfg.launcher.collective_timeout)
        # forward passes counted per rank: names the rank that hung when a collective times out
        self.rank_progress = RankProgress(self.run_dir, self.rank, enabled=self.world_size > 1)
        seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
        if self.device.type == "cuda":
            apply_gpu_math_settings(cfg)
        # the model transforms the config turns on (rapidformer/transforms/), applied in compose
        self.transforms = Transforms(cfg)
        self.strategy = select(cfg)(cfg, self.plan, self.rank, self.world_size,
                                    self.transforms.state_filter())
        self.checkpoints = CheckpointProtocol(self.checkpoint_root, self.rank, self.world_size,
                                              self.strategy, cfg.trainer.keep_last)
        # located and verified now, a point every rank passes together (a collective)
        self.resume_checkpoint = self.checkpoints.locate(cfg.trainer.resume)
        self.model = self.optimizer = self.lr_scheduler = self.num_parameters = None
        self._kv_cache_was_on = False  # set by compose
        self.padding_batch = False  # an evaluation loader's padding batch is being read
        ENGINES_CREATED += 1
        from rapidformer.observability.quiet import library_bars

        library_bars(cfg.trainer.progress_bar and self.is_main_process)

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): who reads which batch."""
        return self.strategy.data_parallel

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.plan.accumulation

    # --- building -------------------------------------------------------------------------
    def compose(self, model_obj: torch.nn.Module, optimizer=None, lr_scheduler=None,
                lr_scheduler_fn=None, total_iters: int | None = None):
        """Move the model to the device and wrap it; build what was not given.

        `lr_scheduler_fn` is called as `lr_scheduler_fn(optimizer=optimizer)` (the seed's
        `partial(get_linear_schedule_with_warmup, ...)`); without either, the configured
        scheduler is built for `total_iters` (default: trainer.train_iters).
        """
        t = self.cfg.trainer
        context = ApplyContext(self.device, self.run_dir if self.is_main_process else None,
                               rounds_lengths(self.cfg))
        model = self.transforms.apply(model_obj, context, before_move=True)
        model = model.to(self.device)
        self._kv_cache_was_on = training_without_kv_cache(model)
        model = self.transforms.apply(model, context, before_move=False)
        model = self.strategy.prepare(model)
        self.num_parameters = self.strategy.count_parameters(model)
        log.info("model parameters: %s (%.1fM)", f"{self.num_parameters:,}",
                 self.num_parameters / 1e6)
        layers, hidden = model_shape(model, self.cfg.model.num_layers, self.cfg.model.hidden_size)
        flops_parameters = self.transforms.flops_parameters(
            self.num_parameters, sum(p.numel() for p in model.parameters()))
        self.model_flops = ModelFlops(flops_parameters, layers, hidden, self.device,
                                      self.world_size)

        def schedule(optimizer):
            if lr_scheduler is not None:
                return lr_scheduler
            if lr_scheduler_fn is not None:
                return lr_scheduler_fn(optimizer=optimizer)
            total = total_iters or t.train_iters
            if not total:
                raise ConfigError(["engine.compose() needs total_iters (or trainer.train_iters) "
                                   "to build the lr schedule; pass total_iters=N or "
                                   "lr_scheduler_fn"])
            return build_scheduler(optimizer, self.cfg.scheduler, total, t.lr)

        wrapped = self.strategy.wrap(model, optimizer, schedule)
        self.model, self.optimizer, self.lr_scheduler = wrapped
        return wrapped

    # --- the step ---------------------------------------------------------------------------
    def autocast(self):
        return self.strategy.autocast()

    def accumulating(self, last_micro_batch: bool):
        """Skip the gradient synchronisation on every micro-batch but the last of a step."""
        return self.strategy.accumulate(last_micro_batch)

    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1) -> None:
        """Gradients of `loss`, averaged over `accumulation_steps` micro-batches."""
        global TRAINING_CALLS
        TRAINING_CALLS += 1
        self.strategy.backward(loss, accumulation_steps)

    def forward_backward(self, forward_step, data_iterator, model, num_microbatches: int,
                         forward_only: bool = False) -> list:
        """One step's micro-batches, `forward_step(data_iterator, model) -> loss` each (with
        megatron-core: through its pipeline schedule); their detached losses."""
        return self.strategy.forward_backward(forward_step, data_iterator, model,
                                              num_microbatches, forward_only,
                                              tick=self.rank_progress.tick)

    def step(self) -> StepResult:
        """Unscale, clip, step (skipped on fp16 overflow), advance the lr, zero the grads. The
        gradient norm is a tensor: read it only when logging (no host sync here)."""
        global TRAINING_CALLS
        TRAINING_CALLS += 1
        result = self.strategy.step()
        self.transforms.after_step(self.model)
        return result

    @contextlib.contextmanager
    def main_process_first(self):
        """Rank 0 runs the block first (downloads, generated files, caches), then the others."""
        if self.world_size > 1 and self.rank != 0:
            dist.barrier()
        yield
        if self.world_size > 1 and self.rank == 0:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def to_device(self, batch):
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict) or hasattr(batch, "items"):
            return {k: self.to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate `tensor` from every rank along dim 0 (sizes may differ between ranks;
        while a padding batch of an evaluation loader is read, this rank adds no row)."""
        return gather_rows(tensor[:0] if self.padding_batch else tensor, self.world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def _rng_state(self) -> dict:
        return {**rng_state(), **self.strategy.rng_state()}

    def save_checkpoint(self, step: int, state: dict, extra=None) -> Path:
        """Every rank writes its shards, rank 0 adds the replicated states, every rank's RNG,
        the transforms' files and `extra(directory)`, and seals it (collective;
        rapidformer/checkpoint/protocol.py). `state`: the template's or own loop's dict (its
        "train_state" and any keys of its own), recorded with the run's (checkpoint/state.py)."""
        rng = self.checkpoints.gather_objects(self._rng_state())
        record = CheckpointState(
            step=step, train_state=dict(state.get("train_state") or {}),
            world_size=self.world_size, strategy=self.strategy.name,
            memory=self.strategy.memory, layout=self.strategy.layout(),
            model=model_record(self.cfg.model, self.num_parameters),
            transforms=self.transforms.records(),
            extra={k: v for k, v in state.items() if k not in ("step", "train_state")})

        def files(directory: Path) -> None:
            self.transforms.write_files(directory)
            if extra is not None:
                extra(directory)
        path = self.checkpoints.save(step, record.to_json(), rng, files,
                                     manifest={"strategy": record.strategy,
                                               "layout": record.layout})
        if self.is_main_process:
            self.transforms.checkpoint_written()
        return path

    def resume_state(self) -> CheckpointState | None:
        """What the checkpoint this run resumes from records (None: a fresh run); read, not
        loaded: a template plans its data position from it before compose."""
        if self.resume_checkpoint is None:
            return None
        return read_state(self.resume_checkpoint)

    def load_checkpoint(self, path: Path, also: tuple[str, ...] = ()) -> dict:
        """Load checkpoint `path` into the composed model, optimizer and schedule (collective),
        or raise naming every change this run cannot resume from (checkpoint/resume.py; `also`:
        the template's own, e.g. a position past the end); the dict the template or own loop
        saved."""
        saved = read_state(path)
        plan = resume_plan(saved, ThisRun(self.strategy, self.transforms, self.cfg.model,
                                          self.num_parameters, self.world_size), path, also)
        self.strategy.load(path)
        ranks = store.load(path, "rng.pt")["ranks"]
        if plan.restores_rng and len(ranks) == self.world_size:
            set_rng_state(ranks[self.rank])
            self.strategy.set_rng_state(ranks[self.rank])
        else:
            log.warning("checkpoint %s was written by %d processes (%s), this run has %d (%s): "
                        "random streams (dropout) restart from the seed", path, len(ranks),
                        saved.layout, self.world_size, self.strategy.layout())
        log.info("resumed from %s (step %d)", path, saved.step)
        return saved.user_view()

    def load_weights(self, path: Path) -> None:
        """Training is over: the model (and optimizer) take checkpoint `path`'s states, e.g.
        the best evaluation's before the export (collective)."""
        self.strategy.load(path)

    # --- export -------------------------------------------------------------------------------
    def unwrapped_model(self) -> torch.nn.Module:
        """The user's model under the strategy's, torch.compile's and ORTModule's wrappers (a
        strategy that shards in place keeps its class)."""
        return self.strategy.unwrap(self.model)

    def export_hf(self, tokenizer=None, step: int | None = None) -> Path | None:
        """One consolidated Hugging Face `save_pretrained` directory (fp32), written atomically
        at run_dir/hf_model by rank 0. Strategies that consolidate from files (ZeRO) read the
        checkpoint of `step`; the transforms then make it a plain model (LoRA: merged)."""
        saved = self.checkpoint_root / f"step_{step:08d}" if step is not None else None
        exported = self.strategy.export_model(self.model, tokenizer, saved)  # collective
        if exported is None or not self.is_main_process:
            return None
        exported = self.transforms.export(*exported)  # e.g. adapters merged into the base
        if exported is None:
            return None
        model, state_dict = exported
        final = self.run_dir / "hf_model"
        tmp = self.run_dir / ".tmp-hf_model"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with kv_cache_as_configured(model, self._kv_cache_was_on):
                model.save_pretrained(str(tmp), state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            honour_umask(tmp)  # safetensors writes model.safetensors 0600
        except BaseException:  # a full disk, a stop: no half export left (the checkpoint is)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        log.info("exported Hugging Face model to %s", final)
        return final
