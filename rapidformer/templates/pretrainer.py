"""PreTrainer: the seed's pretraining template. Subclasses implement three methods; `train()`
prepares the data, the model and the resumed data position, and runs the loop both templates
share (rapidformer/templates/skeleton.py) over iterations, in Megatron's manner.

The loop asks the provider for Megatron's sample counts, reads the data through an iterator
that `run_forward_step(data_iterator, model)` pulls micro-batches from, and keeps the data
position (consumed samples) in every checkpoint, so a resumed run sees the same next samples.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rapidformer.config.validate import best_without_evaluations
from rapidformer.data.sampler import PretrainingBatchSampler
from rapidformer.errors import ConfigError, InputError, RapidformerError
from rapidformer.runtime.loader_workers import DataLoader
from rapidformer.observability.format import format_value, precision_label
from rapidformer.observability.metrics import MetricsSink
from rapidformer.checkpoint.resume import past_the_end, stopped_early
from rapidformer.templates.contract import check_overrides, loss_problem, model_problem, provided
from rapidformer.templates.loop import CountingIterator
from rapidformer.templates.skeleton import Advanced, Course, TemplateLoop

log = logging.getLogger("rapidformer")


@dataclass
class PretrainState:
    step: int = 0                    # iterations (optimizer steps) taken
    consumed_train_samples: int = 0  # the data position: global batches x their size
    consumed_valid_samples: int = 0
    # trainer.best_metric's record (rapidformer/templates/best.py): the best so far survives
    # a resume
    best: dict | None = None


def train_valid_test_num_samples(train_iters: int, eval_interval: int | None, eval_iters: int,
                         global_batch_size: int) -> list[int]:
    """[train, valid, test] samples, as Megatron asks its dataset provider for them: one global
    batch per iteration; eval_iters batches per evaluation, evaluating every eval_interval
    iterations and once more at the end; eval_iters batches of test."""
    interval = eval_interval or train_iters
    evaluations = train_iters // interval + 1
    return [train_iters * global_batch_size, evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size]


class PreTrainer(TemplateLoop):
    """Subclass and implement:

    - `train_valid_test_datasets_provider(train_val_test_num_samples)` -> (train, valid, test)
      (valid and test may be None)
    - `model_optimizer_lr_scheduler_provider()` -> (model, optimizer or None, lr_scheduler or None)
    - `run_forward_step(data_iterator, model)` -> loss (pull one micro-batch with
      `next(data_iterator)`, e.g. through `mpu.broadcast_data`)

    Optionally set `self.collate_fn` (default: torch's default collate of dict samples) and
    `self.tokenizer` (saved with checkpoints and the Hugging Face export).
    """

    def __init__(self, engine):
        super().__init__(engine)  # self.engine, self.cfg, self.tokenizer
        self.collate_fn = None

    # --- the three methods of the seed's template -----------------------------------------------
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        raise self._missing("train_valid_test_datasets_provider(self, train_val_test_num_samples)",
                            "(train_dataset, valid_dataset or None, test_dataset or None)")

    def model_optimizer_lr_scheduler_provider(self):
        raise self._missing("model_optimizer_lr_scheduler_provider(self)",
                            "(model, optimizer or None, lr_scheduler or None)")

    def run_forward_step(self, data_iterator, model):
        raise self._missing("run_forward_step(self, data_iterator, model)", "the loss tensor")

    def _missing(self, signature: str, returns: str) -> RapidformerError:
        return RapidformerError(f"{type(self).__name__} must implement {signature}, returning "
                                f"{returns}: it is one of the PreTrainer template's three methods")

    # --- the loop ----------------------------------------------------------------------------------
    def train(self):
        check_overrides(self, PreTrainer, ("train_valid_test_datasets_provider",
                                           "model_optimizer_lr_scheduler_provider",
                                           "run_forward_step"))
        engine, t = self.engine, self.cfg.trainer
        if not t.train_iters:
            raise ConfigError(["the PreTrainer counts iterations, not epochs: set "
                               "trainer.train_iters (the seed's --train-iters)"])
        total_iters = t.train_iters
        num_samples = train_valid_test_num_samples(total_iters, t.eval_interval, t.eval_iters,
                                           t.global_batch_size)
        log.info("asking the dataset provider for %s train/valid/test samples", num_samples)
        train_ds, valid_ds, test_ds = provided(
            self, "train_valid_test_datasets_provider",
            self.train_valid_test_datasets_provider(num_samples),
            "(train_dataset, valid_dataset or None, test_dataset or None)", count=3)
        if train_ds is None or len(train_ds) < t.micro_batch_size * engine.data_parallel[1]:
            raise InputError(f"the training dataset has {0 if train_ds is None else len(train_ds)} "
                             f"samples, fewer than one micro-batch per process; add data or "
                             f"give training a larger share of data.split")
        model, optimizer, lr_scheduler = provided(
            self, "model_optimizer_lr_scheduler_provider",
            self.model_optimizer_lr_scheduler_provider(),
            "(model, optimizer or None, lr_scheduler or None)", count=3, check=model_problem)
        model, optimizer, lr_scheduler = engine.compose(model, optimizer, lr_scheduler,
                                                        total_iters=total_iters)

        state = PretrainState()
        if engine.resume_checkpoint is not None:
            saved = engine.resume_state()
            late = past_the_end(saved.step, total_iters, f"trainer.train_iters={total_iters}")
            early = stopped_early(saved, engine.resume_checkpoint, t, total_iters)
            state = PretrainState(**engine.load_checkpoint(
                engine.resume_checkpoint, also=tuple(p for p in (late, early) if p))[
                    "train_state"])
        train_iter = self.build_data_iterator(train_ds, state.consumed_train_samples)
        valid_iter = self.build_data_iterator(valid_ds, state.consumed_valid_samples)
        if t.best_metric and (valid_iter is None or t.eval_iters == 0):
            why = "trainer.eval_iters=0" if t.eval_iters == 0 else "there is no validation data"
            raise ConfigError([best_without_evaluations(t.best_metric, why, pretraining=True)])
        course = SampleCourse(self, valid_iter, test_ds)
        return self._run_loop(model, optimizer, total_iters, state, train_iter, course)

    def _forward_step(self, data_iterator, model):
        return provided(self, "run_forward_step", self.run_forward_step(data_iterator, model),
                        "the loss (a tensor of one value), or a pipeline schedule's "
                        "(output_tensor, loss_func) pair", check=loss_problem)

    # --- data --------------------------------------------------------------------------------------
    def build_data_iterator(self, dataset, consumed_samples: int = 0):
        """An endless iterator of this process's micro-batches, from `consumed_samples` on (None
        for no dataset). It counts samples, tokens and the time spent waiting for a batch."""
        if dataset is None or len(dataset) == 0:
            return None
        engine, t = self.engine, self.cfg.trainer
        dp_rank, dp_size = engine.data_parallel
        if len(dataset) < t.micro_batch_size * dp_size:
            log.warning("a dataset of %d samples is smaller than one micro-batch per "
                        "data-parallel rank: skipped", len(dataset))
            return None
        sampler = PretrainingBatchSampler(len(dataset), consumed_samples, t.micro_batch_size,
                                          dp_rank, dp_size)
        workers = self.cfg.data.num_workers
        # the loader's own generator: iter() would otherwise draw worker seeds from the global
        # RNG, and a resumed run would then see other dropout masks than an uninterrupted one
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                            generator=torch.Generator().manual_seed(t.seed),
                            num_workers=workers, pin_memory=engine.device.type == "cuda",
                            persistent_workers=workers > 0,
                            prefetch_factor=4 if workers > 0 else None)
        return CountingIterator(iter(loader))

    # --- the verbs the loop uses -------------------------------------------------------------------
    def _evaluate(self, name: str, model, data_iterator, state: PretrainState,
                  sink: MetricsSink) -> dict:
        """Mean loss over eval_iters iterations' worth of micro-batches, and its perplexity."""
        engine, t = self.engine, self.cfg.trainer
        if data_iterator is None or t.eval_iters == 0:
            return {}
        micro_batches = t.eval_iters * t.global_batch_size // (t.micro_batch_size
                                                               * engine.data_parallel[1])
        model.eval()
        # (sum of micro-batch losses, their count): with pipeline stages only the last has them
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        with torch.no_grad():
            for loss in engine.forward_backward(self.run_forward_step, data_iterator, model,
                                                micro_batches, forward_only=True):
                total += torch.stack([loss.double(), torch.ones_like(loss, dtype=torch.float64)])
        model.train()
        if name == "validation":
            state.consumed_valid_samples += t.eval_iters * t.global_batch_size
        loss_sum, count = engine.all_reduce_sum(total).tolist()
        loss = loss_sum / count
        results = {f"{name}/loss": loss, f"{name}/ppl": math.exp(min(loss, 50.0))}
        sink.write(state.step, results)
        log.info("%s at iteration %d: loss %s, perplexity %.2f", name, state.step,
                 format_value(loss), results[f"{name}/ppl"])
        return results


class SampleCourse(Course):
    """A PreTrainer's run over iterations of one global batch each: the data position is the
    samples consumed; validation takes trainer.eval_iters iterations' worth of batches from
    where the last one stopped, the test the same from the test data's start."""

    unit = "iteration"

    def __init__(self, pretrainer: PreTrainer, valid_iter, test_ds):
        self.pretrainer, self.valid_iter, self.test_ds = pretrainer, valid_iter, test_ds

    def log_start(self, total_iters: int, state: PretrainState) -> None:
        engine, cfg = self.pretrainer.engine, self.pretrainer.cfg
        log.info("pretraining %d iterations from iteration %d (%d micro-batches of %d per "
                 "process per iteration), precision=%s, device=%s", total_iters, state.step,
                 engine.accumulation, cfg.trainer.micro_batch_size, precision_label(cfg.precision),
                 engine.device)

    def advance(self, state: PretrainState) -> Advanced:
        state.consumed_train_samples += self.pretrainer.cfg.trainer.global_batch_size
        return Advanced({"consumed_samples": state.consumed_train_samples})

    def validate(self, model, sink, state: PretrainState) -> dict:
        return self.pretrainer._evaluate("validation", model, self.valid_iter, state, sink)

    def test(self, model, sink, state: PretrainState) -> None:
        test_iter = self.pretrainer.build_data_iterator(self.test_ds, 0)
        self.pretrainer._evaluate("test", model, test_iter, state, sink)
