"""Finetuner: the seed's fine-tuning template. Subclasses implement four methods; `train()`
prepares the data, the model and the resumed position in the epochs, and runs the loop both
templates share (rapidformer/templates/skeleton.py) over epochs."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from rapidformer.checkpoint.resume import epoch_position, last_step, stopped_early
from rapidformer.config.validate import best_without_evaluations
from rapidformer.data.sampler import ResumableSampler
from rapidformer.errors import ConfigError, InputError, RapidformerError
from rapidformer.runtime.loader_workers import DataLoader
from rapidformer.observability.format import format_metrics, precision_label
from rapidformer.observability.metrics import MetricsSink
from rapidformer.observability.records import NO_EVALUATION
from rapidformer.templates.contract import check_overrides, loss_problem, model_problem, provided
from rapidformer.templates.item_weights import loss_items, micro_batch_weights
from rapidformer.templates.loop import CountingIterator
from rapidformer.templates.skeleton import Advanced, Course, TemplateLoop

log = logging.getLogger("rapidformer")


@dataclass
class TrainState:
    step: int = 0           # optimizer steps taken
    epoch: int = 0          # epochs completed
    step_in_epoch: int = 0  # optimizer steps taken in the current epoch
    # the epoch's layout when saved (0: a checkpoint older than these fields)
    steps_per_epoch: int = 0
    global_batch_size: int = 0
    # trainer.best_metric's record (rapidformer/templates/best.py): the best so far survives
    # a resume
    best: dict | None = None


def continue_epoch(state: TrainState, steps_per_epoch: int, global_batch_size: int
                   ) -> TrainState:
    """The resumed position in this run's epochs (checkpoint/resume.py: `epoch_position`),
    the changes it made logged."""
    position = epoch_position(asdict(state), steps_per_epoch, global_batch_size)
    for note in position.notes:
        log.warning(note)
    return TrainState(state.step, position.epoch, position.step_in_epoch, steps_per_epoch,
                      global_batch_size, state.best)


class Finetuner(TemplateLoop):
    """Subclass and implement:

    - `train_valid_test_datasets_provider()` -> (train, valid, test, collate_fn)
    - `model_optimizer_lr_scheduler_provider()` -> (model, optimizer or None, lr_scheduler or None)
    - `run_forward_step(batch, model)` -> loss
    - `run_compute_metrics(model, eval_dataloader)` -> dict of metrics (`model` is a list)

    Set `self.train_collate_fn` in the first to give training batches a collate function of
    their own (e.g. packed rows); evaluation and test use the one the method returns.

    Validation: a validation dataset of None trains without evaluation (said at the start and
    recorded in metrics.jsonl); an empty one is an error. On several processes each rank
    evaluates its share of the examples, in the same number of batches as every other rank: a
    rank whose share runs out first evaluates padding batches (a copy of one example) to stay in
    step with the others' collectives. `self.gather` leaves out a padding batch's rows, and
    `self.padding_batch` says whether the batch being evaluated is one: add nothing of it to a
    sum (run its forward all the same).
    """

    def __init__(self, engine):
        super().__init__(engine)  # self.engine, self.cfg, self.tokenizer
        self.train_collate_fn = None  # training's own collate function, if it has one

    # --- the four methods of the seed's template ------------------------------------------------
    def train_valid_test_datasets_provider(self):
        raise self._missing("train_valid_test_datasets_provider(self)",
                            "(train_dataset, valid_dataset, test_dataset, collate_fn)")

    def model_optimizer_lr_scheduler_provider(self):
        raise self._missing("model_optimizer_lr_scheduler_provider(self)",
                            "(model, optimizer or None, lr_scheduler or None)")

    def run_forward_step(self, batch, model):
        raise self._missing("run_forward_step(self, batch, model)", "the loss tensor")

    def run_compute_metrics(self, model, eval_dataloader):
        raise self._missing("run_compute_metrics(self, model, eval_dataloader)",
                            "a dict of metrics")

    def _missing(self, signature: str, returns: str) -> RapidformerError:
        return RapidformerError(f"{type(self).__name__} must implement {signature}, returning "
                                f"{returns}: it is one of the Finetuner template's four methods")

    # --- helpers the seed exposes ------------------------------------------------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s rows from every rank, concatenated (a padding batch's rows left out)."""
        return self.engine.gather(tensor)

    @property
    def padding_batch(self) -> bool:
        """Whether the evaluation batch being read is padding (build_data_loader): its forward
        runs, as every rank's does, but it counts for nothing."""
        return self.engine.padding_batch

    def _lengths(self, dataset) -> list[int] | None:
        """Token counts for data.group_by_length, from the dataset's input_ids column."""
        if not self.cfg.data.group_by_length:
            return None
        names = getattr(dataset, "column_names", None) or []
        if "input_ids" not in names:
            log.info("data.group_by_length: the training dataset has no input_ids column; "
                     "micro-batches are not grouped by length")
            return None
        return [len(ids) for ids in dataset["input_ids"]]

    def build_data_loader(self, dataset, shuffle: bool = False, collate_fn=None,
                          batch_size: int | None = None):
        """A loader over this rank's share of `dataset` whose batches arrive on the device, of
        `batch_size` rows, else trainer.micro_batch_size shuffled (training) and
        trainer.eval_micro_batch_size (else the micro batch) unshuffled (evaluation).
        Unshuffled on several processes: every example once over all ranks and the same number
        of batches on every rank, padding batches included (even_eval_batches)."""
        engine = self.engine
        t = self.cfg.trainer
        batch_size = batch_size or (t.micro_batch_size if shuffle else
                                    t.eval_micro_batch_size or t.micro_batch_size)
        common = dict(collate_fn=collate_fn, num_workers=self.cfg.data.num_workers,
                      pin_memory=engine.device.type == "cuda")
        if engine.world_size > 1 and not shuffle:
            planned = even_eval_batches(len(dataset), engine.rank, engine.world_size, batch_size)
            loader = DataLoader(dataset, batch_sampler=[rows for rows, _ in planned], **common)
            return _DeviceLoader(loader, engine, [padding for _, padding in planned])
        if engine.world_size > 1:
            sampler = DistributedSampler(dataset, engine.world_size, engine.rank, shuffle=True,
                                         seed=self.cfg.trainer.seed)
        elif shuffle:
            sampler = RandomSampler(dataset,
                                    generator=torch.Generator().manual_seed(self.cfg.trainer.seed))
        else:
            sampler = SequentialSampler(dataset)
        return _DeviceLoader(DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                        **common), engine)

    # --- the loop ----------------------------------------------------------------------------------
    def train(self):
        check_overrides(self, Finetuner, ("train_valid_test_datasets_provider",
                                          "model_optimizer_lr_scheduler_provider",
                                          "run_forward_step", "run_compute_metrics"))
        engine, t = self.engine, self.cfg.trainer
        with engine.main_process_first():  # rank 0 fills caches and writes generated files
            train_ds, valid_ds, test_ds, collate_fn = provided(
                self, "train_valid_test_datasets_provider",
                self.train_valid_test_datasets_provider(),
                "(train_dataset, valid_dataset, test_dataset, collate_fn)", count=4)
        if valid_ds is not None and len(valid_ds) == 0:
            raise InputError(f"{type(self).__name__}.train_valid_test_datasets_provider returned "
                             f"an empty validation dataset: every evaluation would score "
                             f"nothing. Give it examples, or return None for it to train "
                             f"without evaluation")
        model, optimizer, lr_scheduler = provided(
            self, "model_optimizer_lr_scheduler_provider",
            self.model_optimizer_lr_scheduler_provider(),
            "(model, optimizer or None, lr_scheduler or None)", count=3, check=model_problem)
        sampler = self._train_sampler(train_ds)
        total_iters, past_the_end = self._last_step(sampler.steps_per_epoch)
        model, optimizer, lr_scheduler = engine.compose(model, optimizer, lr_scheduler,
                                                        total_iters=total_iters)
        train_loader = self._train_loader(train_ds, sampler,
                                          self.train_collate_fn or collate_fn)
        eval_loaders = {name: self.build_data_loader(ds, collate_fn=collate_fn)
                        for name, ds in (("validation", valid_ds),) if ds is not None}
        if t.best_metric and not eval_loaders:
            raise ConfigError([best_without_evaluations(
                t.best_metric, "there is no validation data", pretraining=False)])

        state = TrainState(steps_per_epoch=sampler.steps_per_epoch,
                           global_batch_size=t.global_batch_size)
        if engine.resume_checkpoint is not None:
            early = stopped_early(engine.resume_state(), engine.resume_checkpoint, t,
                                  total_iters)
            saved = engine.load_checkpoint(engine.resume_checkpoint,
                                           also=tuple(p for p in (past_the_end, early) if p))[
                "train_state"]
            state = continue_epoch(TrainState(**saved), sampler.steps_per_epoch,
                                   t.global_batch_size)
        batches = CountingIterator(_epochs(train_loader, sampler, state), engine.to_device)
        course = EpochCourse(self, sampler.steps_per_epoch, eval_loaders, test_ds, collate_fn)
        return self._run_loop(model, optimizer, total_iters, state, batches, course)

    # what run_forward_step's loss averages over in a batch (templates/item_weights.py):
    # "examples", "labels", "next_labels", or None (each micro-batch's mean weighs the same)
    loss_unit: str | None = None
    _weights: list | None = None  # this step's factors, one a micro-batch (_step_batches)

    def _step_batches(self, batches):
        """With several micro-batches or ranks, the step's micro-batches are read first, and
        each one's loss weighs its items (templates/item_weights.py)."""
        engine, p = self.engine, self.cfg.parallelism
        self._weights = None
        if self.loss_unit and (engine.accumulation > 1 or engine.world_size > 1) and \
                p.tensor_model_parallel_size == p.pipeline_model_parallel_size == 1:
            step = [next(batches) for _ in range(engine.accumulation)]
            self._weights = micro_batch_weights([loss_items(b, self.loss_unit) for b in step],
                                                engine.world_size, engine.all_reduce_sum,
                                                engine.device)
            return iter(step)
        return batches

    def _forward_step(self, batches, model):
        loss = provided(self, "run_forward_step", self.run_forward_step(next(batches), model),
                        "the loss (a tensor of one value)", check=loss_problem)
        if not (self._weights and torch.is_tensor(loss)):
            return loss
        weight = self._weights.pop(0)
        # a micro-batch of no item (every masked-LM label left unmasked) has a 0/0 mean: it
        # adds nothing to the step (its gradient is zero already: no label to reach)
        return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))

    def _last_step(self, steps_per_epoch: int) -> tuple[int, str | None]:
        """The step training ends at: trainer.train_iters, or trainer.epochs' steps; resumed,
        the steps the checkpoint's position leaves, counted in this run's epochs, and why the
        checkpoint is past them (refused with the resume's other problems, when it loads)."""
        t, saved = self.cfg.trainer, self.engine.resume_state()
        if saved is None:
            return t.train_iters or t.epochs * steps_per_epoch, None
        position = epoch_position(saved.train_state, steps_per_epoch, t.global_batch_size)
        return last_step(saved.step, position, steps_per_epoch, t.epochs, t.train_iters)

    def _train_sampler(self, train_ds) -> ResumableSampler:
        t = self.cfg.trainer
        sampler = ResumableSampler(len(train_ds), t.global_batch_size, self.engine.rank,
                                   self.engine.world_size, shuffle=True, seed=t.seed,
                                   lengths=self._lengths(train_ds),
                                   micro_batch_size=t.micro_batch_size)
        if sampler.steps_per_epoch == 0:
            raise InputError(f"the training split has {len(train_ds)} examples, fewer than one "
                             f"global batch (trainer.global_batch_size={t.global_batch_size}); "
                             f"lower the batch size or add data")
        return sampler

    def _train_loader(self, train_ds, sampler, collate_fn) -> DataLoader:
        t = self.cfg.trainer
        # the loader's own generator: iter() would otherwise draw from the global RNG, and a
        # resumed run would then see other dropout masks than an uninterrupted one
        return DataLoader(train_ds, batch_size=t.micro_batch_size, sampler=sampler,
                          collate_fn=collate_fn, num_workers=self.cfg.data.num_workers,
                          pin_memory=self.engine.device.type == "cuda",
                          generator=torch.Generator().manual_seed(t.seed))

    # --- the verbs the loop uses -------------------------------------------------------------------
    def _evaluate(self, model, loaders: dict, sink: MetricsSink, state: TrainState) -> dict:
        results = {}
        for name, loader in loaders.items():
            metrics = self.evaluate(model, loader)
            results.update({f"{name}/{k}": v for k, v in metrics.items()})
        if results:
            sink.write(state.step, {"epoch": state.epoch, **results})
            log.info("eval at step %d: %s", state.step, format_metrics(results))
        return results

    def evaluate(self, model, loader) -> dict:
        model.eval()
        with torch.no_grad(), self.engine.autocast():
            metrics = self.run_compute_metrics([model], loader)
        model.train()
        return {k: float(v) for k, v in dict(metrics).items()}

    def _test(self, model, test_ds, collate_fn, sink, state) -> None:
        """End of training: score the test split, if it is labelled."""
        if test_ds is not None and len(test_ds) and self.test_is_labelled(test_ds):
            metrics = self.evaluate(model, self.build_data_loader(test_ds, collate_fn=collate_fn))
            sink.write(state.step, {f"test/{k}": v for k, v in metrics.items()})
            log.info("test: %s", format_metrics(metrics))

    def test_is_labelled(self, test_ds) -> bool:
        """Whether the test split can be scored; GLUE's test labels are -1."""
        return False


WITHOUT_VALIDATION = ("training without evaluation: the data has no validation split (no "
                      "validation file, or a white-box provider's validation dataset is None); "
                      "give one (data.validation_file=FILE, or a validation/dev file beside "
                      "the training file) to evaluate")


class EpochCourse(Course):
    """A Finetuner's run over epochs of `steps_per_epoch` steps: the validation loaders after
    every epoch (or trainer.eval_interval steps), the test split at the end."""

    def __init__(self, finetuner: Finetuner, steps_per_epoch: int, eval_loaders: dict, test_ds,
                 collate_fn):
        self.finetuner, self.steps_per_epoch = finetuner, steps_per_epoch
        self.eval_loaders, self.test_ds, self.collate_fn = eval_loaders, test_ds, collate_fn
        self.noted = False  # the record of training without evaluation is written

    def log_start(self, total_iters: int, state: TrainState) -> None:
        engine, cfg = self.finetuner.engine, self.finetuner.cfg
        log.info("training %d iterations (%d per epoch, %d micro-batches of %d per step), "
                 "precision=%s, device=%s", total_iters, self.steps_per_epoch,
                 engine.accumulation, cfg.trainer.micro_batch_size, precision_label(cfg.precision),
                 engine.device)
        if not self.eval_loaders:
            log.warning("%s", WITHOUT_VALIDATION)

    def advance(self, state: TrainState) -> Advanced:
        """One more step of the epoch (the step's record names its epoch); the epoch's last
        step ends it, and the next step starts the next epoch."""
        state.step_in_epoch += 1
        advanced = Advanced({"epoch": state.epoch},
                            epoch_done=state.step_in_epoch >= self.steps_per_epoch)
        if advanced.epoch_done:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        return advanced

    def validate(self, model, sink, state: TrainState) -> dict:
        if not self.eval_loaders and not self.noted:  # once: the summary says it
            sink.write(state.step, {NO_EVALUATION: WITHOUT_VALIDATION})
            self.noted = True
        return self.finetuner._evaluate(model, self.eval_loaders, sink, state)

    def test(self, model, sink, state: TrainState) -> None:
        self.finetuner._test(model, self.test_ds, self.collate_fn, sink, state)


def _epochs(loader, sampler, state):
    """The training micro-batches, epoch after epoch, from the state's position: each epoch in
    the sampler's order for (epoch, steps already taken in it). An epoch that yields nothing
    is an error, not an endless wait."""
    while True:
        sampler.set_epoch(state.epoch, state.step_in_epoch)
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise RapidformerError(f"epoch {state.epoch} from step {state.step_in_epoch} of "
                                   f"{sampler.steps_per_epoch} yields no training batch")


def even_eval_batches(size: int, rank: int, world_size: int, batch_size: int
                      ) -> list[tuple[list[int], bool]]:
    """This rank's evaluation batches, each (example indices, whether it is padding): every
    example exactly once over all ranks (strided, not padded: gather takes unequal sizes), and
    the same number of batches on every rank. Each forward may be a collective (sharded weights
    gather, DDP broadcasts buffers), and so is every gather of metrics: a rank with a batch
    fewer would leave the others waiting forever. A rank whose share runs out first (fewer
    examples than ranks, or one example fewer than rank 0 at a batch's edge) evaluates padding
    batches of one example (example 0) that count for nothing."""
    mine = list(range(rank, size, world_size))
    batches = [(mine[i:i + batch_size], False) for i in range(0, len(mine), batch_size)]
    most = -(-len(range(0, size, world_size)) // batch_size)  # rank 0's share is the largest
    return batches + [([0], True)] * (most - len(batches))


class _DeviceLoader:
    """A DataLoader whose batches are moved to the engine's device; with `padding` (a flag per
    batch), the engine knows while a padding batch is read (its gather leaves its rows out)."""

    def __init__(self, loader, engine, padding: list[bool] | None = None):
        self.loader, self.engine, self.padding = loader, engine, padding

    def __iter__(self):
        if self.padding is None:
            for batch in self.loader:
                yield self.engine.to_device(batch)
            return
        try:
            for batch, padding in zip(self.loader, self.padding, strict=True):
                self.engine.padding_batch = padding
                yield self.engine.to_device(batch)
                self.engine.padding_batch = False
        finally:  # a loop left early (break, an error) leaves no padding flag behind
            self.engine.padding_batch = False

    def __len__(self):
        return len(self.loader)
