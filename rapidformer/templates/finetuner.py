"""Finetuner: the seed's fine-tuning template. Subclasses implement four methods; `train()`
is the loop, written to read top to bottom."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from rapidformer.data.sampler import ResumableSampler
from rapidformer.errors import InputError, NonFiniteLoss, RapidformerError
from rapidformer.grad_spikes import GradNormSpikes
from rapidformer.observability import MetricsSink
from rapidformer.preemption import StopSignals, newest_checkpoint
from rapidformer.templates.contract import check_overrides

log = logging.getLogger("rapidformer")


@dataclass
class TrainState:
    step: int = 0           # optimizer steps taken
    epoch: int = 0          # epochs completed
    step_in_epoch: int = 0  # optimizer steps taken in the current epoch


class Finetuner:
    """Subclass and implement:

    - `train_valid_test_datasets_provider()` -> (train, valid, test, collate_fn)
    - `model_optimizer_lr_scheduler_provider()` -> (model, optimizer or None, lr_scheduler or None)
    - `run_forward_step(batch, model)` -> loss
    - `run_compute_metrics(model, eval_dataloader)` -> dict of metrics (`model` is a list)
    """

    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        self.tokenizer = None  # set it to have the tokenizer saved with checkpoints and export

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
        return self.engine.gather(tensor)

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
        """A loader over this rank's share of `dataset` whose batches arrive on the device."""
        engine = self.engine
        if engine.world_size > 1 and shuffle:
            sampler = DistributedSampler(dataset, engine.world_size, engine.rank, shuffle=True,
                                         seed=self.cfg.trainer.seed)
        elif engine.world_size > 1:
            batches = even_eval_batches(len(dataset), engine.rank, engine.world_size,
                                        batch_size or self.cfg.trainer.micro_batch_size)
            loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn,
                                num_workers=self.cfg.data.num_workers,
                                pin_memory=self.engine.device.type == "cuda")
            return _DeviceLoader(loader, self.engine)
        elif shuffle:
            sampler = RandomSampler(dataset,
                                    generator=torch.Generator().manual_seed(self.cfg.trainer.seed))
        else:
            sampler = SequentialSampler(dataset)
        loader = DataLoader(dataset, batch_size=batch_size or self.cfg.trainer.micro_batch_size,
                            sampler=sampler, collate_fn=collate_fn,
                            num_workers=self.cfg.data.num_workers,
                            pin_memory=self.engine.device.type == "cuda")
        return _DeviceLoader(loader, self.engine)

    # --- the loop ----------------------------------------------------------------------------------
    def train(self):
        check_overrides(self, Finetuner, ("train_valid_test_datasets_provider",
                                          "model_optimizer_lr_scheduler_provider",
                                          "run_forward_step", "run_compute_metrics"))
        engine, t = self.engine, self.cfg.trainer
        with engine.main_process_first():  # rank 0 fills caches and writes generated files
            train_ds, valid_ds, test_ds, collate_fn = self.train_valid_test_datasets_provider()
        model, optimizer, lr_scheduler = self.model_optimizer_lr_scheduler_provider()

        sampler = ResumableSampler(len(train_ds), t.global_batch_size, engine.rank,
                                   engine.world_size, shuffle=True, seed=t.seed,
                                   lengths=self._lengths(train_ds),
                                   micro_batch_size=t.micro_batch_size)
        if sampler.steps_per_epoch == 0:
            raise InputError(f"the training split has {len(train_ds)} examples, fewer than one "
                             f"global batch (trainer.global_batch_size={t.global_batch_size}); "
                             f"lower the batch size or add data")
        total_iters = t.train_iters or t.epochs * sampler.steps_per_epoch
        model, optimizer, lr_scheduler = engine.compose(model, optimizer, lr_scheduler,
                                                        total_iters=total_iters)
        # the loader's own generator: iter() would otherwise draw from the global RNG, and a
        # resumed run would then see other dropout masks than an uninterrupted one
        train_loader = DataLoader(train_ds, batch_size=t.micro_batch_size, sampler=sampler,
                                  collate_fn=collate_fn, num_workers=self.cfg.data.num_workers,
                                  pin_memory=engine.device.type == "cuda",
                                  generator=torch.Generator().manual_seed(t.seed))
        eval_loaders = {name: self.build_data_loader(ds, collate_fn=collate_fn)
                        for name, ds in (("validation", valid_ds),) if ds is not None and len(ds)}
        accumulation = t.global_batch_size // (t.micro_batch_size * engine.world_size)

        state = TrainState()
        resume_from = engine.resume_checkpoint
        if resume_from is not None:
            state = TrainState(**engine.load_checkpoint(resume_from)["train_state"])
        sink = MetricsSink(engine.run_dir, t.tensorboard, enabled=engine.is_main_process,
                           logger=self.cfg.logger, config=asdict(self.cfg))
        progress = _progress(total_iters, state.step, t.progress_bar and engine.is_main_process)
        log.info("training %d iterations (%d per epoch, %d micro-batches of %d per step), "
                 "precision=%s, device=%s", total_iters, sampler.steps_per_epoch, accumulation,
                 t.micro_batch_size, self.cfg.precision.dtype, engine.device)

        window = _Window(t.grad_norm_spike_factor)
        last_eval_step = -1
        stopped_early = False
        stop = StopSignals().install(engine.world_size)
        while state.step < total_iters and not stopped_early:
            sampler.set_epoch(state.epoch, state.step_in_epoch)
            batches = iter(train_loader)
            while state.step_in_epoch < sampler.steps_per_epoch and state.step < total_iters:
                model.train()
                for micro in range(accumulation):
                    waited = time.perf_counter()
                    batch = engine.to_device(next(batches))
                    window.data_wait += time.perf_counter() - waited
                    with engine.accumulating(last_micro_batch=micro == accumulation - 1):
                        with engine.autocast():
                            loss = self.run_forward_step(batch, model)
                        engine.rank_progress.tick()
                        engine.backward(loss, accumulation_steps=accumulation)
                    window.add_micro(loss.detach(), batch)
                result = engine.step()
                state.step += 1
                state.step_in_epoch += 1
                window.add_step(result)
                progress.update(1)

                if state.step % t.log_interval == 0 or state.step == total_iters:
                    record = window.flush(optimizer, engine, state.step)
                    sink.write(state.step, {"epoch": state.epoch, **record})
                    progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                    log.info("step %d/%d loss %.4f lr %.3e grad_norm %.3f %.1f samples/s",
                             state.step, total_iters, record["loss"], record["lr"],
                             record["grad_norm"], record["samples_per_s"])
                epoch_done = state.step_in_epoch == sampler.steps_per_epoch
                if epoch_done:
                    state.epoch += 1
                    state.step_in_epoch = 0
                if (t.eval_interval and state.step % t.eval_interval == 0) or \
                        (epoch_done and t.eval_interval is None):
                    self._evaluate(model, eval_loaders, sink, state)
                    last_eval_step = state.step
                exiting = bool(t.exit_interval and state.step % t.exit_interval == 0
                               and state.step < total_iters)
                preempted = stop.requested()
                if (t.save_interval and state.step % t.save_interval == 0) or \
                        (epoch_done and t.save_interval is None) or exiting or preempted:
                    save_if_finite(self._save, state, window, engine)
                if preempted:
                    end_preempted(stop, engine, state.step, progress, sink)
                if exiting:
                    log.info("trainer.exit_interval=%d reached at step %d: checkpoint saved, "
                             "stopping (resume with trainer.resume=auto)", t.exit_interval,
                             state.step)
                    stopped_early = True
                if exiting or epoch_done:
                    break

        progress.close()
        stop.restore()
        if not stopped_early:
            if last_eval_step != state.step:
                self._evaluate(model, eval_loaders, sink, state)
            self._finish(model, test_ds, collate_fn, sink, state, window)
        sink.close()
        return state

    # --- the verbs the loop uses -------------------------------------------------------------------
    def _evaluate(self, model, loaders: dict, sink: MetricsSink, state: TrainState) -> dict:
        results = {}
        for name, loader in loaders.items():
            metrics = self.evaluate(model, loader)
            results.update({f"{name}/{k}": v for k, v in metrics.items()})
        if results:
            sink.write(state.step, {"epoch": state.epoch, **results})
            log.info("eval at step %d: %s", state.step,
                     ", ".join(f"{k}={v:.4f}" for k, v in results.items()))
        return results

    def evaluate(self, model, loader) -> dict:
        model.eval()
        with torch.no_grad(), self.engine.autocast():
            metrics = self.run_compute_metrics([model], loader)
        model.train()
        return {k: float(v) for k, v in dict(metrics).items()}

    def _save(self, state: TrainState) -> None:
        tokenizer = self.tokenizer
        extra = (lambda d: tokenizer.save_pretrained(str(d / "tokenizer"))) if tokenizer else None
        self.engine.save_checkpoint(state.step, {"step": state.step,
                                                 "train_state": asdict(state)}, extra)

    def _finish(self, model, test_ds, collate_fn, sink, state, window) -> None:
        """End of training: score a labelled test split, keep a final checkpoint, export."""
        if test_ds is not None and len(test_ds) and self.test_is_labelled(test_ds):
            metrics = self.evaluate(model, self.build_data_loader(test_ds, collate_fn=collate_fn))
            sink.write(state.step, {f"test/{k}": v for k, v in metrics.items()})
            log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.cfg.trainer.save_last and \
                not (self.engine.checkpoint_root / f"step_{state.step:08d}").is_dir():
            save_if_finite(self._save, state, window, self.engine)
        if self.cfg.trainer.export_hf:
            self.engine.export_hf(self.tokenizer, step=state.step)

    def test_is_labelled(self, test_ds) -> bool:
        """Whether the test split can be scored; GLUE's test labels are -1."""
        return False


def save_if_finite(save, state, window, engine) -> bool:
    """Checkpoint unless the last step's loss was NaN/Inf: a diverged model must never
    replace (or, through keep_last, prune) a good checkpoint."""
    if not window.loss_is_finite(engine, state.step):
        log.warning("no checkpoint at step %d: its loss is not finite (the newest complete "
                    "checkpoint stays the resume point)", state.step)
        return False
    save(state)
    return True


def end_preempted(stop, engine, step: int, progress, sink) -> None:
    """A run stopped by a signal, after its checkpoint: close the outputs, leave with code 75."""
    progress.close()
    sink.close()
    stop.restore()
    raise stop.error(step, engine.checkpoint_root)


class _Window:
    """Loss, tokens and timing since the last log line, kept on the device until then."""

    def __init__(self, spike_factor: float | None = None):
        self.spikes = GradNormSpikes(spike_factor)
        # steps in a row whose loss was NaN/Inf, and the most of them since the last check:
        # device tensors, read only at log lines and before checkpoints (no sync per step)
        self.nonfinite_run = self.nonfinite_peak = 0
        self.step_loss = 0.0
        self.reset()

    def reset(self):
        self.loss_sum, self.micro, self.steps, self.skipped = 0.0, 0, 0, 0
        self.samples, self.tokens, self.grad_norm = 0, 0, None
        self.grad_norm_max = None  # the window's largest norm, on the device (NaN ignored)
        self.slots = 0  # token positions computed, padding included
        self.data_wait = 0.0  # seconds blocked waiting for the next batch
        self.started = time.perf_counter()

    def add_micro(self, loss, batch=None):
        self.loss_sum = self.loss_sum + loss.float()
        self.step_loss = self.step_loss + loss.float()
        self.micro += 1
        if batch is not None:
            self.add_input(batch)

    def add_input(self, batch):
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if ids is not None:
            self.samples += ids.shape[0]
            self.slots += ids.numel()
            self.tokens = self.tokens + (mask.sum() if mask is not None else ids.numel())

    def add_step(self, result):
        self.steps += 1
        self.grad_norm = result["grad_norm"]
        norm = torch.as_tensor(self.grad_norm, dtype=torch.float32)
        self.grad_norm_max = norm if self.grad_norm_max is None else \
            torch.fmax(self.grad_norm_max, norm.to(self.grad_norm_max.device))
        if torch.is_tensor(self.step_loss):  # a pipeline stage without the loss has none
            bad = (~torch.isfinite(self.step_loss)).to(torch.int64)
            self.nonfinite_run = (self.nonfinite_run + bad) * bad
            self.nonfinite_peak = torch.maximum(torch.as_tensor(self.nonfinite_peak,
                                                                device=bad.device),
                                                self.nonfinite_run)
        self.step_loss = 0.0

    def loss_is_finite(self, engine, step: int) -> bool:
        """Whether the last step's loss was finite on every rank; stops the run (with the
        newest complete checkpoint untouched) after trainer.max_nonfinite_steps bad steps."""
        counts = engine.all_reduce_max(torch.stack([
            torch.as_tensor(self.nonfinite_peak, device=engine.device),
            torch.as_tensor(self.nonfinite_run, device=engine.device)]).to(torch.int64)).tolist()
        peak, run = counts
        self.nonfinite_peak = 0
        limit = engine.cfg.trainer.max_nonfinite_steps
        if limit is not None and peak >= limit:
            name = newest_checkpoint(engine.checkpoint_root)
            newest = (f"the newest complete checkpoint, {name}, is untouched "
                      f"(trainer.resume=auto resumes from it)" if name
                      else "no checkpoint was written")
            raise NonFiniteLoss(
                f"the loss was NaN or infinite for {peak} steps in a row (by step {step}); "
                f"stopped without saving: {newest}. Lower trainer.lr, set trainer.clip_grad, "
                f"or use precision=bf16 or fp32; trainer.max_nonfinite_steps={limit} sets how "
                f"many such steps stop a run")
        return run == 0

    def flush(self, optimizer, engine, step: int) -> dict:
        self.loss_is_finite(engine, step)  # raises after too many non-finite steps
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        # one small all-reduce per log line: the loss of the whole global batch, all ranks' work
        totals = engine.all_reduce_sum(torch.stack([
            torch.as_tensor(self.loss_sum, dtype=torch.float64, device=engine.device),
            torch.as_tensor(float(self.micro), dtype=torch.float64, device=engine.device),
            torch.as_tensor(float(self.samples), dtype=torch.float64, device=engine.device),
            torch.as_tensor(self.tokens, dtype=torch.float64, device=engine.device),
            torch.as_tensor(float(self.slots), dtype=torch.float64, device=engine.device)])).tolist()
        loss_sum, micro, samples, tokens, slots = totals
        record = {"loss": loss_sum / max(micro, 1),
                  "lr": optimizer.param_groups[0]["lr"],
                  "grad_norm": float(self.grad_norm),
                  "grad_norm_max": float(self.grad_norm_max),
                  "samples_per_s": samples / elapsed,
                  "tokens_per_s": tokens / elapsed,
                  # model FLOPs at the window's mean sequence length (rapidformer/flops.py)
                  **engine.model_flops.record(tokens / elapsed, tokens / max(samples, 1)),
                  # share of this rank's wall time spent blocked on input: the loader must keep
                  # it near zero
                  "data_wait_frac": self.data_wait / elapsed,
                  # share of the computed token positions that were padding
                  "padding_frac": 1.0 - tokens / slots if slots else 0.0}
        if self.spikes.check(step, record["grad_norm_max"]):
            record["grad_norm_spikes"] = self.spikes.count
        if engine.precision.loss_scale is not None:
            record["loss_scale"] = engine.precision.loss_scale
            record["skipped_steps"] = engine.precision.skipped_steps
        if engine.device.type == "cuda":
            # between steps the allocation is the model states; the peak adds activations
            record["mem_allocated_gb"] = torch.cuda.memory_allocated(engine.device) / 2**30
            record["peak_mem_gb"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        self.reset()
        return record


def even_eval_batches(size: int, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """This rank's evaluation batches: every example exactly once over all ranks (strided, not
    padded: gather takes unequal sizes), and the same number of batches on every rank — with
    sharded weights (ZeRO-3, FSDP2) each forward is a collective, so a rank with one batch more
    would wait for the others forever. A rank with fewer examples splits a batch in two."""
    mine = list(range(rank, size, world_size))
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    most = max(-(-len(range(r, size, world_size)) // batch_size) for r in range(world_size))
    while len(batches) < most and any(len(b) > 1 for b in batches):
        last = max(i for i, b in enumerate(batches) if len(b) > 1)
        batches[last:last + 1] = [batches[last][:-1], batches[last][-1:]]
    return batches


class _DeviceLoader:
    """A DataLoader whose batches are moved to the engine's device."""

    def __init__(self, loader, engine):
        self.loader, self.engine = loader, engine

    def __iter__(self):
        for batch in self.loader:
            yield self.engine.to_device(batch)

    def __len__(self):
        return len(self.loader)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="it",
                dynamic_ncols=True)
