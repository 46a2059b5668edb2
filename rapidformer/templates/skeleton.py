"""The training loop of both templates, written once. `Finetuner` and `PreTrainer` subclass
`TemplateLoop`; each run hands it a `Course`: the template's data position and how a step
advances it (the Finetuner's epochs and steps in the epoch, with the epoch's end; the
PreTrainer's consumed samples), its validation, and its final test. The checkpoint's payload
is the template's train state (its dataclass, as it stands after the step).

After each step, in this order: the data position moves on, the step is logged, an
evaluation runs when one is due (and a new best gets its checkpoint; early stopping counts
it), then a checkpoint when one is due, a stop signal ends the run (a checkpoint, then exit
code 75) and trainer.exit_interval ends it (a checkpoint, no final evaluation or export).
After the steps: the last checkpoint, the final validation (unless the last step had one),
the test, and the export. LoopControl (rapidformer/templates/loop.py) owns each of these
verbs; this module owns their order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rapidformer.accelerators.base import StepResult
from rapidformer.templates.loop import LoopControl


@dataclass
class Advanced:
    """What a step's advance of the data position tells the loop."""
    fields: dict = field(default_factory=dict)  # the step's metrics record starts with them
    epoch_done: bool = False  # the step ended an epoch (evaluate and save then, unless
    # trainer.eval_interval or trainer.save_interval say otherwise)


class Course:
    """What one run of a template gives the loop besides its model and batches."""

    unit = "step"  # what the log calls a step: "step" or "iteration"

    def log_start(self, total_iters: int, state) -> None:
        """The run's first line: how many steps, of what."""

    def advance(self, state) -> Advanced:
        """Step state.step was taken (already counted): move the data position past it."""
        raise NotImplementedError

    def validate(self, model, sink, state) -> dict:
        """The validation at state.step: its metrics, written to `sink` and logged."""
        raise NotImplementedError

    def test(self, model, sink, state) -> None:
        """The end of training: score the test data, if there is any to score."""


class TemplateLoop:
    """What the Finetuner and the PreTrainer share: the loop over a Course (`_run_loop`), one
    training step (`train_step`) and the checkpoint of the train state (`_save`). A template
    gives `_forward_step(batches, model)`, which calls its `run_forward_step`."""

    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        self.tokenizer = None  # set it to have the tokenizer saved with checkpoints and export

    def train_step(self, model, batches, window) -> StepResult:
        """One optimizer step: engine.accumulation micro-batches through `run_forward_step`
        (with megatron-core: its pipeline schedule), then the optimizer step."""
        model.train()
        batches = self._step_batches(batches)
        for loss in self.engine.forward_backward(self._forward_step, batches, model,
                                                 self.engine.accumulation):
            window.add_micro(loss)
        return self.engine.step()

    def _step_batches(self, batches):
        """Where a step reads its micro-batches from (a template may read them ahead)."""
        return batches

    def _forward_step(self, batches, model):
        raise NotImplementedError

    def _save(self, state) -> None:
        tokenizer = self.tokenizer
        extra = (lambda d: tokenizer.save_pretrained(str(d / "tokenizer"))) if tokenizer else None
        self.engine.save_checkpoint(state.step, {"step": state.step,
                                                 "train_state": asdict(state)}, extra)

    def _run_loop(self, model, optimizer, total_iters: int, state, batches, course: Course):
        """Train `model` from `state` (a resumed one or a fresh one) to step `total_iters`,
        reading micro-batches from `batches`; `state` as it ends."""
        with LoopControl(self.engine, total_iters, state, self._save, course.unit) as loop:
            course.log_start(total_iters, state)
            batches = loop.count_input(batches)
            while state.step < total_iters and not loop.stopped_early:
                result = self.train_step(model, batches, loop.window)
                state.step += 1
                advanced = course.advance(state)
                loop.step_taken(state.step, result, optimizer, **advanced.fields)
                if loop.eval_due(state.step, advanced.epoch_done):
                    with loop.evaluating(state):  # a failure saves the steps taken first
                        metrics = course.validate(model, loop.sink, state)
                    loop.evaluated(state, metrics)  # the best's checkpoint; early stopping
                preempted = loop.stop_requested()  # a collective: every rank, every step
                exiting = loop.exit_due(state.step)
                if preempted or exiting:
                    loop.log_unlogged()  # the steps since the last log line
                if preempted or exiting or loop.save_due(state.step, advanced.epoch_done):
                    loop.save(state)  # not twice: a best evaluation may have saved this step
                if preempted:
                    raise loop.stopped_by_signal(state.step)  # exit code 75
                if exiting:
                    loop.exiting(state.step)
                    return state  # no final evaluation, save or export
            loop.log_unlogged()  # an early stop between log steps
            loop.end_steps()
            loop.save_last(state)  # written before the final scores, which may fail
            if loop.final_evaluation_due(state.step):  # an early stop evaluated this step
                loop.evaluated(state, course.validate(model, loop.sink, state))
            course.test(model, loop.sink, state)
            loop.report_compiles()
            loop.export(state, self.tokenizer)
            loop.ended(state)  # an early stop is recorded as the run's last record
        return state
