"""What the Finetuner's and the PreTrainer's loops share around their steps: the metrics window
and sink, the progress bar, the step's log line, when to log, evaluate, save and stop, the stop
signals (SIGTERM/SIGINT: a checkpoint, then exit code 75), the non-finite-loss guard before
every save, a checkpoint before an evaluation's error ends the run, the best evaluation's
checkpoint and early stopping (trainer.best_metric, rapidformer/templates/best.py), and the
run's end (the last checkpoint before the final evaluations, the Hugging Face export of the
best or last weights after them).

Each verb does what its name says and nothing more; the order they run in is the loop
skeleton's (rapidformer/templates/skeleton.py, `TemplateLoop._run_loop`):

- after each step: `step_taken` (the window, the log line);
- questions, which change nothing: `eval_due`, `save_due`, `exit_due` (trainer.exit_interval),
  `final_evaluation_due`; `stop_requested` asks whether a stop signal came (a collective);
- evaluations: `evaluating` (around one: a failure saves the steps taken first), `evaluated`
  (records it; the best's checkpoint; early stopping, `stopped_early`);
- checkpoints: `save` (unless this run saved the step already), `save_if_finite` (unless the
  loss is not finite), `save_last` (trainer.save_last, after the steps);
- stopping: `stopped_by_signal` (the error a stop signal ends the run with, exit code 75),
  `exiting` (trainer.exit_interval's log line);
- the end: `end_steps` (the progress bar, the signal handlers), `report_compiles`, `export`,
  `ended` (an early stop's record, written last).

Leaving the `with LoopControl(...)` block, also by an exception, restores the signal handlers
and closes the progress bar and the sink.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from typing import Callable

import torch

from rapidformer.checkpoint import store
from rapidformer.data.counts import BatchCounts, take_counts
from rapidformer.data.lengths import expected_recompiles
from rapidformer.errors import NonFiniteLoss, Preempted
from rapidformer.templates.best import BestTracker
from rapidformer.transforms import settings as transform_settings
from rapidformer.observability.compile_log import CompileLog
from rapidformer.observability.console import logs_through
from rapidformer.observability.grad_spikes import GradNormSpikes
from rapidformer.observability.metrics import MetricsSink
from rapidformer.checkpoint.early_stop import early_stop_reason
from rapidformer.observability.records import EARLY, STOPPED
from rapidformer.observability.step_profiler import StepProfiler
from rapidformer.runtime.preemption import StopSignals, newest_checkpoint

log = logging.getLogger("rapidformer")
LOOPS_STARTED = 0  # the user-script runner checks that a script trained

# the step line: the Finetuner counts steps; the PreTrainer counts iterations in Megatron's
# manner and adds the share of the window spent waiting for data
STEP_LINES = {"step": "step %d/%d loss %.4f lr %.3e grad_norm %.3f %.1f samples/s",
              "iteration": "iteration %d/%d loss %.4f lr %.3e grad_norm %.3f %.1f samples/s "
                           "(%.1f%% waiting for data)"}


def nonfinite_advice(cfg) -> str:
    """What to try after the loss stopped being finite, true of this run: clipping where it is
    off, fp16's narrow range only for an fp16 run, and the accelerators it runs with (a loss
    should not depend on them: issue 37's NaN came from the packed attention under
    graph=compile)."""
    fixes = ["lower trainer.lr"] + (["set trainer.clip_grad"] if not cfg.trainer.clip_grad
                                    else [])
    if cfg.precision.dtype == "fp16":
        fixes.append("use precision=bf16 or fp32")
    advice = ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
    graph = [] if cfg.graph.name == "eager" else [f"graph={cfg.graph.name}"] + (
        [f"graph.mode={cfg.graph.mode}"] if cfg.graph.mode else [])
    accelerators = [*graph, *transform_settings(cfg)]
    if accelerators:
        advice += (f"; to tell whether an accelerator is at fault, rerun without each of "
                   f"{', '.join(accelerators)} (a setting the loss depends on is a bug: "
                   f"please report it)")
    return advice[0].upper() + advice[1:]


class LoopControl:
    """The control around a training loop's steps, for `total_iters` steps from `state.step`
    (`state` has `.step` and `.best`, the best evaluation's record, which checkpoints keep);
    `write(state)` writes a checkpoint of `state`. `unit` names the steps in the log: "step"
    (the Finetuner) or "iteration" (the PreTrainer). An epoch-based loop tells `eval_due` and
    `save_due` when a step ended an epoch: with trainer.eval_interval or
    trainer.save_interval unset, it evaluates or saves then."""

    def __init__(self, engine, total_iters: int, state, write: Callable, unit: str = "step"):
        self.engine, self.total_iters, self.start_step = engine, total_iters, state.step
        self.write, self.unit = write, unit
        self.t = engine.cfg.trainer
        self.window = _Window(self.t.grad_norm_spike_factor)
        self._unlogged = None  # (step, optimizer, fields) of a step not yet in a record
        self.evaluated_at = -1  # the step of the last evaluation
        self.saved_at = -1  # the step of this run's last checkpoint
        self.best = BestTracker(self.t, engine.checkpoint_root, engine.is_main_process)
        self.best.resume(state.best, state.step)
        state.best = asdict(self.best.record) if self.best.record else None
        self.stopped_early = False  # trainer.early_stopping_patience ran out
        self.sink = self.progress = self.stop = None
        self._closing = contextlib.ExitStack()

    def __enter__(self) -> LoopControl:
        global LOOPS_STARTED
        LOOPS_STARTED += 1
        engine, t = self.engine, self.t
        with self._closing as closing:  # undone at once if a part fails to start
            self.sink = MetricsSink(engine.run_dir, t.tensorboard, enabled=engine.is_main_process,
                                    logger=engine.cfg.logger, config=asdict(engine.cfg))
            closing.callback(self.sink.close)
            self.progress = _progress(self.total_iters, self.start_step,
                                      t.progress_bar and engine.is_main_process)
            closing.callback(self.progress.close)
            closing.enter_context(logs_through(self.progress))  # log lines above the bar
            self.compiling = CompileLog.attach(getattr(engine, "model", None),
                                               engine.cfg.graph.name == "compile",
                                               expected_recompiles(engine.cfg.data.pad_to))
            closing.callback(self.compiling.detach)
            self.profiler = StepProfiler(t.profile_steps, engine.run_dir, engine.rank,
                                         engine.device)
            closing.callback(self.profiler.close)
            self.profiler.before_steps(self.start_step)
            self.stop = StopSignals()
            closing.callback(self.stop.restore)
            self.stop.install(engine.world_size)
            self._closing = closing.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.close()

    def count_input(self, iterator: CountingIterator | None) -> CountingIterator | None:
        """Count `iterator`'s batches (samples, tokens, time waited) in the window, where this
        rank's input counts towards throughput (one rank per model replica)."""
        if iterator is not None:
            iterator.window = self.window if self.engine.strategy.counts_input else None
        return iterator

    # --- after each step --------------------------------------------------------------------
    def step_taken(self, step: int, result, optimizer, **fields) -> None:
        """Step `step` is done (`result`: its StepResult). At trainer.log_interval and at the
        last step the window becomes one metrics record (`fields` first) and one log line."""
        self.window.add_step(result)
        if step == self.start_step + 1:
            self.window.first_step_done(self.engine.device)
        self.compiling.step_done()
        self.profiler.step_done(step)
        self.progress.update(1)
        self._unlogged = (step, optimizer, fields)
        if not (step % self.t.log_interval == 0 or step == self.total_iters):
            return
        self._log(step, optimizer, fields)

    def log_unlogged(self) -> None:
        """Before a stop between log steps (a signal, trainer.exit_interval): the steps since
        the last record become one, so that no step's loss goes unlogged (the resumed run's
        first record holds only its own steps). A collective, as every record is."""
        if self.window.steps and self._unlogged is not None:
            self._log(*self._unlogged)

    def _log(self, step: int, optimizer, fields: dict) -> None:
        self._unlogged = None
        record = self.window.flush(optimizer, self.engine, step)
        self.sink.write(step, {**fields, **record})
        self.progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        args = [step, self.total_iters, record["loss"], record["lr"], record["grad_norm"],
                record["samples_per_s"]]
        if self.unit == "iteration":
            args.append(100 * record["data_wait_frac"])
        log.info(STEP_LINES[self.unit], *args)

    # --- the questions: they change nothing ------------------------------------------------
    def eval_due(self, step: int, epoch_done: bool = False) -> bool:
        """Whether to evaluate after `step`: at trainer.eval_interval (when it is unset, at
        each epoch's end)."""
        interval = self.t.eval_interval
        return bool(interval and step % interval == 0) or (epoch_done and interval is None)

    def save_due(self, step: int, epoch_done: bool = False) -> bool:
        """Whether a checkpoint is due after `step`: at trainer.save_interval (when it is
        unset, at each epoch's end)."""
        interval = self.t.save_interval
        return bool(interval and step % interval == 0) or (epoch_done and interval is None)

    def exit_due(self, step: int) -> bool:
        """Whether trainer.exit_interval ends the run after `step` (not at the last step: the
        run ends there anyway, with its final evaluations and export)."""
        interval = self.t.exit_interval
        return bool(interval and step % interval == 0 and step < self.total_iters)

    def final_evaluation_due(self, step: int) -> bool:
        """Whether the final validation is still to run: not when `step` was evaluated already
        (at an interval, at an epoch's end, or by the evaluation that stopped early)."""
        return self.evaluated_at != step

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (SIGTERM/SIGINT). A collective: every rank
        asks after every step."""
        return self.stop.requested()

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, state) -> bool:
        """A checkpoint of `state` after its step, unless this run wrote that step's already (a
        best evaluation may have) or the step's loss is not finite; False when none exists."""
        if self.saved_at == state.step:
            return True
        return self.save_if_finite(state)

    def save_if_finite(self, state) -> bool:
        """Checkpoint unless the last step's loss was NaN/Inf: a diverged model must never
        replace (or, through keep_last, prune) a good checkpoint."""
        if not self.window.loss_is_finite(self.engine, state.step):
            log.warning("no checkpoint at step %d: its loss is not finite (the newest complete "
                        "checkpoint stays the resume point)", state.step)
            return False
        self.write(state)
        self.saved_at = state.step
        return True

    # --- stopping -----------------------------------------------------------------------------
    def stopped_by_signal(self, step: int) -> Preempted:
        """The error that ends the run after a stop signal (exit code 75), naming the
        checkpoint written, or the newest one when this step's loss kept it from being saved."""
        return self.stop.error(step, self.engine.checkpoint_root)

    def exiting(self, step: int) -> None:
        """trainer.exit_interval ends the run after `step`, as asked: say so, and record it, so
        that the run is reported stopped, not finished (rapidformer/cli/summary.py)."""
        log.info("trainer.exit_interval=%d reached at %s %d of %d: checkpoint saved, stopping "
                 "(resume with trainer.resume=auto)", self.t.exit_interval, self.unit, step,
                 self.total_iters)
        self.sink.write(step, {STOPPED: {"by": f"trainer.exit_interval={self.t.exit_interval}",
                                         "of": self.total_iters}})

    # --- evaluations --------------------------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self, state):
        """Around an evaluation inside the loop: if it fails (a bug in a metric, bad data), the
        steps taken so far are saved first, so that the error loses no training."""
        try:
            yield
        except Exception:
            if not self._saved(state.step):
                log.error("evaluation failed at %s %d: writing a checkpoint of the steps taken "
                          "first", self.unit, state.step)
                self.save_if_finite(state)
            raise

    def _saved(self, step: int) -> bool:
        # a damaged directory of this step is not a save of it (the save sets it aside)
        return store.is_complete(self.engine.checkpoint_root / f"step_{step:08d}")

    def evaluated(self, state, metrics: dict) -> None:
        """An evaluation ran at state.step and gave `metrics`: it is recorded (the final
        validation does not repeat it). With trainer.best_metric a new best gets a checkpoint
        (now, when this step has none) and the marker names it; with
        trainer.early_stopping_patience, the evaluations without improvement are counted and
        `stopped_early` is set when they reach it."""
        self.evaluated_at = state.step
        best = self.best
        # a resumed run that evaluates its resumed step again (a finished run's final
        # evaluation) must not count that evaluation twice
        if best.record is None or best.record.evaluated_at == state.step:
            return
        with self.evaluating(state):  # a metric no evaluation produces: the steps are saved
            record = best.judge(state.step, metrics)
        if record.step == state.step:
            state.best = asdict(record)  # the checkpoint of the best must say it is the best
            if not self.save(state):
                # no checkpoint to keep (its loss is not finite): the previous best stays
                record.step, record.value = best.record.step, best.record.value
                record.evaluations_without_improvement = \
                    best.record.evaluations_without_improvement + 1
            else:
                log.info("best %s so far: %.4f at %s %d", best.metric, record.value, self.unit,
                         state.step)
        best.commit(record)
        state.best = asdict(record)
        if best.patience_over:
            self.stopped_early = True
            kept = (f"the best is {record.value:.4f} at {self.unit} {record.step}"
                    if record.step is not None else "no evaluation gave a number")
            log.info("early stopping at %s %d of %d: %s (trainer.early_stopping_patience=%d); "
                     "%s", self.unit, state.step, self.total_iters,
                     early_stop_reason(best.metric, self.t.early_stopping_min_delta,
                                       record.evaluations_without_improvement),
                     self.t.early_stopping_patience, kept)

    # --- the end ----------------------------------------------------------------------------
    def ended(self, state) -> None:
        """The run is over (its final scores and export written): an early stop is recorded
        last, so that the summary and status.json say the run stopped early, not finished, and
        a resume of it with the same settings is refused (checkpoint/resume.py)."""
        if not self.stopped_early:
            return
        record = self.best.record
        self.sink.write(state.step, {STOPPED: {
            "by": "early stopping", "of": self.total_iters,
            EARLY: {"metric": record.metric, "min_delta": self.t.early_stopping_min_delta,
                    "patience": self.t.early_stopping_patience,
                    "evaluations": record.evaluations_without_improvement}}})

    def end_steps(self) -> None:
        """The steps are over: close the progress bar and give the stop signals their previous
        handlers back (the final evaluations run without them)."""
        self.progress.close()
        self.stop.restore()

    def save_last(self, state) -> None:
        """The last checkpoint (trainer.save_last, unless this step has one), written before a
        final evaluation can fail."""
        if self.t.save_last and not self._saved(state.step):
            self.save_if_finite(state)

    def report_compiles(self) -> None:
        """With graph=compile, after the final evaluations: the graphs compiled in all and the
        recompiles among them."""
        self.compiling.finish()

    def export(self, state, tokenizer=None) -> None:
        """The Hugging Face export (trainer.export_hf), of the best checkpoint's weights when
        trainer.best_metric is set."""
        if not self.t.export_hf:
            return
        step, best = state.step, self.best.record
        path = self.best.checkpoint_of_best()
        if path is not None and not store.is_complete(path):
            log.warning("trainer.export_hf: the best checkpoint, %s, is missing or incomplete "
                        "(removed by hand?): exporting the last weights (%s %d) instead", path,
                        self.unit, state.step)
            path = None
        if path is not None and best.step != state.step:
            # training is over: the model (and optimizer) may take the best checkpoint's states
            self.engine.load_weights(path)  # collective
            step = best.step
        if path is not None:
            log.info("trainer.export_hf: exporting the best checkpoint, %s (%s=%.4f), %s",
                     path.name, best.metric, best.value,
                     "the last one" if step == state.step else f"not the last ({self.unit} "
                     f"{state.step})")
        self.engine.export_hf(tokenizer, step=step)


class CountingIterator:
    """Wraps a batch iterator (moving each batch to the device with `to_device` when given):
    the samples, tokens and seconds spent waiting for each batch go into `window` (the loop's
    log window) when one is attached."""

    def __init__(self, iterator, to_device: Callable | None = None):
        self.iterator, self.to_device = iterator, to_device
        self.window = None

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        batch = next(self.iterator)
        if self.to_device is not None:
            batch = self.to_device(batch)
        counts = take_counts(batch)  # off the batch, whether or not a window reads them
        if self.window is not None:
            self.window.data_wait += time.perf_counter() - started
            self.window.add_input(counts)
        return batch


class _Window:
    """Loss, tokens and timing since the last log line, kept on the device until then."""

    def __init__(self, spike_factor: float | None = None):
        self.spikes = GradNormSpikes(spike_factor)
        # steps in a row whose loss was NaN/Inf, and the most of them since the last check:
        # device tensors, read only at log lines and before checkpoints (no sync per step)
        self.nonfinite_run = self.nonfinite_peak = 0
        self.step_loss = 0.0
        self.loss_scale, self.skipped_steps = None, 0  # fp16 loss scaling, as of the last step
        self.first_step_s = None  # set by first_step_done, written once
        self.reset()

    def reset(self):
        self.loss_sum, self.micro, self.steps, self.skipped = 0.0, 0, 0, 0
        self.samples, self.tokens, self.grad_norm = 0, 0, None
        self.grad_norm_max = None  # the window's largest norm, on the device (NaN ignored)
        self.slots = 0  # token positions computed, padding included
        self.data_wait = 0.0  # seconds blocked waiting for the next batch
        self.started = time.perf_counter()

    def first_step_done(self, device: torch.device) -> None:
        """The process's first step is done: its seconds from the loop's start (compilation,
        allocator growth and the first batch included) go into this window's record. One
        device synchronization, once: the time users wait before training runs at speed."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.first_step_s = time.perf_counter() - self.started

    def add_micro(self, loss, batch=None):
        self.loss_sum = self.loss_sum + loss.float()
        self.step_loss = self.step_loss + loss.float()
        self.micro += 1
        if batch is not None:
            self.add_input(take_counts(batch))

    def add_input(self, counts: BatchCounts | None):
        """One batch's samples, real tokens and slots (data/counts.py)."""
        if counts is not None:
            self.samples += counts.samples
            self.slots += counts.slots
            self.tokens = self.tokens + counts.tokens

    def add_step(self, result):
        self.steps += 1
        self.grad_norm = result.grad_norm
        self.loss_scale, self.skipped_steps = result.loss_scale, result.skipped_steps
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
                f"stopped without saving: {newest}. {nonfinite_advice(engine.cfg)}; "
                f"trainer.max_nonfinite_steps={limit} sets how many such steps stop a run")
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
                  # model FLOPs at the window's mean sequence length (rapidformer/observability/flops.py)
                  **engine.model_flops.record(tokens / elapsed, tokens / max(samples, 1)),
                  # share of this rank's wall time spent blocked on input: the loader must keep
                  # it near zero
                  "data_wait_frac": self.data_wait / elapsed,
                  # share of the computed token positions that were padding
                  "padding_frac": 1.0 - tokens / slots if slots else 0.0,
                  # the window's wall time: accelerate=auto's search (rapidformer/tuning/) sums
                  # it to time the warm-up steps apart from the rest
                  "window_s": elapsed}
        if self.first_step_s is not None:
            record["first_step_s"], self.first_step_s = self.first_step_s, None
        if self.spikes.check(step, record["grad_norm_max"]):
            record["grad_norm_spikes"] = self.spikes.count
        if self.loss_scale is not None:
            record["loss_scale"] = self.loss_scale
            record["skipped_steps"] = self.skipped_steps
        if engine.device.type == "cuda":
            # between steps the allocation is the model states; the peak adds activations
            record["mem_allocated_gb"] = torch.cuda.memory_allocated(engine.device) / 2**30
            record["peak_mem_gb"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        self.reset()
        return record


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="it",
                dynamic_ncols=True)
