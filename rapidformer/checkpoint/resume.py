"""Resume after a change: from a checkpoint's state and this run to a plan, or one refusal that
names every change it cannot take and the way out.

Two decisions, both here:

- `resume_plan`: whether the checkpoint's tensors load into this run (the strategy's memory mode
  and layout, each model transform's record, the model's size) and whether the random streams
  restore (only at the same world size and layout);
- `epoch_position` and `last_step`: where a Finetuner continues in this run's epochs, and the
  step it ends at, when the batch size or the training set changed since the checkpoint. The
  steps left are counted in the new terms, so a resumed run trains every epoch it was asked
  for; a run the checkpoint went past is refused (`past_the_end`, the PreTrainer's too), in
  the same refusal as every other problem of the resume;
- `stopped_early`: a run that early stopping ended is finished in its own terms: resumed with
  a patience that is still over, it is refused (nothing trains, nothing on disk changes); a
  larger patience, or none, trains on.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rapidformer.checkpoint.state import CheckpointState
from rapidformer.errors import InputError


@dataclass(frozen=True)
class ThisRun:
    """What a checkpoint is compared with: the running strategy and transforms, the model's
    settings and size (None before compose), the number of processes."""
    strategy: object  # an accelerators.base.Strategy
    transforms: object  # a transforms.Transforms
    model_cfg: object
    num_parameters: int | None
    world_size: int


@dataclass(frozen=True)
class ResumePlan:
    restores_rng: bool  # the random streams continue (same world size and layout)


FRESH_RUN = ("start a fresh run (a new trainer.output_dir, or trainer.overwrite=true without "
             "trainer.resume)")


def resume_plan(saved: CheckpointState, run: ThisRun, where: Path,
                also: tuple[str, ...] = ()) -> ResumePlan:
    """The plan to resume this run from checkpoint `where`, or InputError naming every
    problem (`also`: what the template found, e.g. a position past the training asked for).
    A transform whose settings changed changes the parameters that train: its own problem
    says so, and the model's size is compared only when the transforms agree."""
    transform_problems = run.transforms.resume_problems(saved.transforms, where)
    problems = [problem for problem in (
        *also, run.strategy.resume_problem(saved), *transform_problems,
        None if transform_problems else model_change(saved, run.model_cfg,
                                                     run.num_parameters)) if problem]
    if len(problems) == 1:
        raise InputError(f"checkpoint {where} {problems[0]}")
    if problems:
        lines = "\n".join(f"  - it {p}" for p in problems)
        raise InputError(f"checkpoint {where} cannot be resumed by this run "
                         f"({len(problems)} problems):\n{lines}")
    layout = run.strategy.layout()
    same_layout = saved.world_size == run.world_size and \
        all(saved.layout.get(k) == v for k, v in layout.items())
    return ResumePlan(restores_rng=same_layout)


def model_change(saved: CheckpointState, model_cfg, num_parameters: int | None) -> str | None:
    """Why the checkpoint's weights cannot fit this run's model (a phrase after "checkpoint
    PATH "), or None."""
    if saved.model is None or num_parameters is None or \
            saved.model.num_parameters == num_parameters:
        return None
    before = saved.model.settings
    changed = [f"model.{k}={v} (was {before[k]})" for k, v in asdict(model_cfg).items()
               if k in before and before[k] != v]
    what = ("; changed: " + ", ".join(changed)) if changed else \
        " (no model setting changed: the task, whose head is part of the model, or the " \
        "vocabulary trained on the data may have)"
    return (f"holds a model of {saved.model.num_parameters:,} parameters, this run builds "
            f"{num_parameters:,}{what}; resume with the model settings it was written with, or "
            f"{FRESH_RUN}")


@dataclass(frozen=True)
class EpochPosition:
    epoch: int  # the epoch the next step is in
    step_in_epoch: int  # steps of it already taken, in this run's steps
    notes: list[str] = field(default_factory=list)  # what changed, for the log


def epoch_position(saved: dict, steps_per_epoch: int, global_batch_size: int) -> EpochPosition:
    """Where a Finetuner's checkpoint (`saved`: its train_state) continues in this run's
    epochs of `steps_per_epoch` steps of `global_batch_size` samples. The samples already
    taken in the current epoch are kept, counted in this run's steps (rounded up: no sample is
    seen twice in the epoch, when the batch size changed; another training set is another
    permutation); an epoch already complete in those terms is over."""
    epoch, in_epoch = saved["epoch"], saved["step_in_epoch"]
    saved_batch = saved.get("global_batch_size") or global_batch_size
    saved_steps = saved.get("steps_per_epoch") or steps_per_epoch
    notes = []
    taken = in_epoch * saved_batch  # samples of the current epoch trained on
    position = math.ceil(taken / global_batch_size)
    if (saved_batch, saved_steps) != (global_batch_size, steps_per_epoch) or \
            position >= steps_per_epoch:
        recorded = saved.get("steps_per_epoch") or "an unrecorded number"
        notes.append(f"resuming with {steps_per_epoch} steps per epoch of {global_batch_size} "
                     f"samples (the checkpoint had {recorded} of {saved_batch}): {taken} "
                     f"samples of epoch {epoch} were taken")
    if position >= steps_per_epoch:
        notes.append(f"epoch {epoch} is complete in this run's terms: continuing with epoch "
                     f"{epoch + 1}")
        epoch, position = epoch + 1, 0
    return EpochPosition(epoch, position, notes)


def last_step(step: int, position: EpochPosition, steps_per_epoch: int, epochs: int | None,
              train_iters: int | None) -> tuple[int, str | None]:
    """The step a resumed Finetuner ends at: trainer.train_iters, or the steps left in
    trainer.epochs from `position`, counted in this run's terms and added to the `step` taken;
    and why the checkpoint cannot be resumed when it is past the training asked for (a
    phrase after "checkpoint PATH "; the run then ends where the checkpoint is)."""
    if train_iters:
        problem = past_the_end(step, train_iters, f"trainer.train_iters={train_iters}")
        return (step if problem else train_iters), problem
    left = (epochs - position.epoch) * steps_per_epoch - position.step_in_epoch
    done = f"{position.epoch} epochs" + (f" and {position.step_in_epoch} steps of the next"
                                         if position.step_in_epoch else "")
    problem = past_the_end(step, step + left, f"trainer.epochs={epochs}", done)
    return (step if problem else step + left), problem


def stopped_early(saved: CheckpointState, where: Path, trainer_cfg, total: int) -> str | None:
    """Why checkpoint `where` cannot resume a run that ends at step `total`: its run stopped
    early (trainer.early_stopping_patience ran out) and these settings would stop it again,
    after a step that replaces its best and export (a phrase after "checkpoint PATH "); or
    None. A larger patience, or none, trains on."""
    from rapidformer.checkpoint import store
    from rapidformer.checkpoint.early_stop import early_stop_of, early_stop_reason

    record = early_stop_of(trainer_cfg, (saved.train_state or {}).get("best"),
                           store.read_best(where.parent), saved.step)
    if record is None:
        return None
    count, patience = record["evaluations_without_improvement"], \
        trainer_cfg.early_stopping_patience
    reason = early_stop_reason(record["metric"], trainer_cfg.early_stopping_min_delta, count)
    return (f"is of a run that already stopped early at step {record['evaluated_at']} of "
            f"{total} ({reason}, trainer.early_stopping_patience={patience}): it is finished "
            f"in its own terms, and nothing is left to train with these settings. To train on, "
            f"resume with a larger patience (trainer.early_stopping_patience={count + 1} or "
            f"more) or without early stopping (trainer.early_stopping_patience=null "
            f"trainer.early_stopping_min_delta=0), or {FRESH_RUN}")


def past_the_end(step: int, total: int, asked: str, done: str | None = None) -> str | None:
    """Why a checkpoint at `step` cannot resume a run that ends at step `total` (`asked`: the
    setting that says so), or None."""
    if step <= total:
        return None
    return (f"has trained {done or f'{step} steps'}, past what this run asks ({asked}); "
            f"nothing is left to train: ask for more (a larger trainer.epochs or "
            f"trainer.train_iters), or {FRESH_RUN}")
