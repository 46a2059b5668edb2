"""trainer.best_metric and trainer.early_stopping_patience, in-process on tiny models: which
step is best, which checkpoints pruning leaves, that the export holds the best checkpoint's
weights, that early stopping stops at the right step, that a resumed run remembers the best,
and the PreTrainer's loop too. The evaluation's metric is scripted per step (a real evaluation
runs, then the compared value is replaced), so that the best step is known in advance."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint import store as checkpoint
from rapidformer.checkpoint.state import read_state
from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.errors import ConfigError, InputError
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner
from rapidformer.templates.best import BestTracker, inferred_mode
from rapidformer.templates.pretrainer import PreTrainer

# the quickstart's BERT made tinier, on 64 examples: 2 steps per epoch of 32, an evaluation of
# 16 after every step, no interval checkpoints
TINY = ["+recipe=quickstart", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=1",
        "trainer.device=cpu", "data.synthetic_train_size=64", "data.synthetic_eval_size=16",
        "trainer.micro_batch_size=32", "trainer.global_batch_size=32", "trainer.epochs=null",
        "trainer.eval_interval=1", "trainer.save_interval=100", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_layers=1", "model.vocab_size=200", "data.max_seq_length=32"]
ACCURACY = {1: 0.5, 2: 0.8, 3: 0.6, 4: 0.7, 5: 0.75, 6: 0.7, 7: 0.79, 8: 0.5}


class ScriptedFinetuner(SequenceClassificationFinetuner):
    """The black-box classifier whose validation/accuracy at step N is script[N]."""
    script = ACCURACY

    def _evaluate(self, model, loaders, sink, state):
        metrics = super()._evaluate(model, loaders, sink, state)
        return {**metrics, "validation/accuracy": self.script[state.step]}


def finetune(run: Path, *overrides: str, trainer=ScriptedFinetuner):
    from rapidformer.engine import RapidformerEngine

    _, cfg = settle(compose([*TINY, f"trainer.output_dir={run}", *overrides]), str(run))
    return trainer(engine=RapidformerEngine(cfg, run)).train()


def steps_saved(run: Path) -> list[int]:
    return [int(p.name[5:]) for p in checkpoint.scan(run / "checkpoints")[0]]


def exported_equals(run: Path, step: int) -> bool:
    from safetensors.torch import load_file

    exported = load_file(str(run / "hf_model" / "model.safetensors"))
    saved = checkpoint.load(run / "checkpoints" / f"step_{step:08d}", "model.pt")
    shared = set(exported) & set(saved)
    assert len(shared) > 10  # the same names: the comparison compares something
    return all(torch.equal(exported[k], saved[k]) for k in shared)


def test_the_best_checkpoint_is_kept_beside_the_last_exported_and_resumed(tmp_path, caplog,
                                                                           capsys):
    """Stopped at step 3 (best: step 2, 0.8) and resumed to step 6, whose evaluations are all
    below 0.8: the best stays step 2 (a run that forgot it would pick step 5's 0.75)."""
    from rapidformer.cli.verbs.verify import verify_command

    run = tmp_path / "run"
    common = ["trainer.train_iters=6", "trainer.keep_last=1",
              "trainer.best_metric=validation/accuracy"]
    finetune(run, *common, "trainer.exit_interval=3", "trainer.export_hf=false")
    saved = read_state(run / "checkpoints" / "step_00000003").train_state["best"]
    assert (saved["step"], saved["value"], saved["evaluated_at"]) == (2, 0.8, 3)
    with caplog.at_level("INFO", logger="rapidformer"):
        state = finetune(run, *common, "trainer.resume=auto")
    assert state.best["step"] == 2
    # each new best got its checkpoint when it was evaluated (no interval checkpoints);
    # pruning left the last and the best
    assert steps_saved(run) == [2, 6]
    marker = json.loads((run / "checkpoints" / checkpoint.BEST).read_text())
    assert (marker["step"], marker["metric"], marker["mode"], marker["value"]) == \
        (2, "validation/accuracy", "max", 0.8)
    assert marker["evaluated_at"] == 6 and marker["evaluations_without_improvement"] == 4
    assert "exporting the best checkpoint, step_00000002 (validation/accuracy=0.8000), not the " \
           "last (step 6)" in caplog.text
    assert exported_equals(run, 2) and not exported_equals(run, 6)
    # the marker is no checkpoint: resume=auto takes the newest, verify checks both
    assert checkpoint.latest(run / "checkpoints").name == "step_00000006"
    assert verify_command([str(run)]) == 0
    assert "best     step_00000002: validation/accuracy=0.8\n" in capsys.readouterr().out


def test_early_stopping_ends_the_run_normally_at_the_right_step(tmp_path, caplog):
    """Patience 2 with min_delta 0.05: step 3 (0.6) and step 4 (0.7, below 0.8 + 0.05) do not
    improve; the run stops after step 4's evaluation, its last checkpoint and the export of the
    best (step 2), and does not evaluate step 4 again."""
    run = tmp_path / "run"
    with caplog.at_level("INFO", logger="rapidformer"):
        state = finetune(run, "trainer.train_iters=8", "trainer.best_metric=validation/accuracy",
                         "trainer.early_stopping_patience=2",
                         "trainer.early_stopping_min_delta=0.05")
    assert state.step == 4
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "loss" in r) == 4
    assert [r["step"] for r in records if "validation/loss" in r] == [1, 2, 3, 4]
    assert steps_saved(run) == [2, 4]
    assert "early stopping at step 4 of 8: no improvement of more than 0.05 in " \
           "validation/accuracy for 2 evaluations (trainer.early_stopping_patience=2)" \
        in caplog.text
    assert exported_equals(run, 2)


class CreepingFinetuner(ScriptedFinetuner):
    script = {1: 0.5, 2: 0.8, 3: 0.82, 4: 0.83, 5: 0.84, 6: 0.9}


def test_improvements_within_min_delta_move_the_best_but_count_for_stopping(tmp_path):
    """Steps 3-5 each beat the best by less than 0.05: each becomes the best, and after three
    of them (patience 3) the run stops at step 5."""
    run = tmp_path / "run"
    state = finetune(run, "trainer.train_iters=6", "trainer.best_metric=validation/accuracy",
                     "trainer.early_stopping_patience=3", "trainer.early_stopping_min_delta=0.05",
                     "trainer.export_hf=false", "trainer.keep_last=1", trainer=CreepingFinetuner)
    assert state.step == 5 and state.best["step"] == 5 and state.best["value"] == 0.84
    assert steps_saved(run) == [5]


def test_a_metric_no_evaluation_produces_names_the_available_ones(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        finetune(run, "trainer.train_iters=4", "trainer.eval_interval=2",
                 "trainer.best_metric=validation/rouge", trainer=SequenceClassificationFinetuner)
    assert "trainer.best_metric=validation/rouge: the evaluation at step 2 produced no such " \
           "metric; it produced: validation/accuracy, validation/f1, validation/loss" in str(err.value)
    assert steps_saved(run) == [2]  # the steps taken are saved before the error ends the run


@pytest.mark.parametrize("overrides, messages", [
    (["trainer.best_metric=accuracy", "trainer.early_stopping_patience=0"],
     ["trainer.best_metric=accuracy is not a metric of the validation evaluation: its key "
      "starts with validation/, e.g. trainer.best_metric=validation/accuracy",
      "trainer.early_stopping_patience=0 must be a positive integer (evaluations without "
      "improvement) or null (train to the end)"]),
    (["trainer.early_stopping_patience=3", "trainer.best_mode=min"],
     ["trainer.best_mode=min needs trainer.best_metric (the metric it applies to)",
      "trainer.early_stopping_patience=3 needs trainer.best_metric (the metric it applies to)"]),
    (["trainer.best_metric=validation/f1", "trainer.early_stopping_min_delta=0.1"],
     ["trainer.early_stopping_min_delta=0.1 has no effect without "
      "trainer.early_stopping_patience"]),
])
def test_bad_settings_are_refused_up_front(overrides, messages):
    with pytest.raises(ConfigError) as err:
        settle(compose(overrides), output_dir="out")
    problems = err.value.problems  # all at once
    assert len(problems) == len(messages)
    for message in messages:
        assert any(problem.startswith(message) for problem in problems), (message, problems)


def test_the_mode_follows_the_metric_name():
    assert [inferred_mode(m, None) for m in ("validation/loss", "validation/ppl",
                                             "validation/perplexity", "validation/accuracy",
                                             "validation/f1", "validation/rougeL")] == \
        ["min", "min", "min", "max", "max", "max"]
    assert inferred_mode("validation/loss", "max") == "max"


def test_a_resume_takes_the_marker_when_it_knows_later_evaluations(tmp_path):
    """The final evaluation runs after the last checkpoint: its result is only in the marker.
    A marker of evaluations after the resumed step (another timeline) or of another metric is
    not taken."""
    from types import SimpleNamespace

    t = SimpleNamespace(best_metric="validation/loss", best_mode=None, keep_last=2,
                        early_stopping_patience=None, early_stopping_min_delta=0.0)
    saved = {"metric": "validation/loss", "mode": "min", "step": 4, "value": 0.5,
             "evaluated_at": 6, "evaluations_without_improvement": 1}
    checkpoint.write_best(tmp_path, {**saved, "step": 8, "value": 0.4, "evaluated_at": 8,
                                     "evaluations_without_improvement": 0})
    for step, expected in ((8, 8), (7, 4)):
        tracker = BestTracker(t, tmp_path, True)
        tracker.resume(saved, step)
        assert tracker.record.step == expected
    other = BestTracker(SimpleNamespace(**{**vars(t), "best_metric": "validation/ppl"}),
                        tmp_path, True)
    other.resume(saved, 8)
    assert other.record.step is None


# --- the PreTrainer -------------------------------------------------------------------------
VOCAB, SEQ = 64, 16
LOSS = {2: 3.0, 4: 2.0, 6: 2.5, 8: 2.4, 10: 2.1, 12: 1.0}


class ScriptedPretrainer(PreTrainer):
    """A tiny GPT-2 on random tokens whose validation/loss at iteration N is LOSS[N]."""

    def train_valid_test_datasets_provider(self, num_samples):
        data = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(0))
        rows = [{"input_ids": row} for row in data]
        return rows[:48], rows[48:], None

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB,
                                          n_positions=SEQ)), None, None

    def run_forward_step(self, data_iterator, model):
        ids = next(data_iterator)["input_ids"]
        return model(input_ids=ids, labels=ids).loss

    def _evaluate(self, name, model, data_iterator, state, sink):
        metrics = super()._evaluate(name, model, data_iterator, state, sink)
        return {**metrics, "validation/loss": LOSS[state.step]} if name == "validation" \
            else metrics


def test_the_pretrainer_keeps_the_lowest_loss_and_stops_early(tmp_path, caplog):
    """validation/loss (mode min, inferred) is best at iteration 4; patience 2 stops after
    iteration 8's evaluation."""
    from rapidformer.engine import RapidformerEngine

    run = tmp_path / "run"
    overrides = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu",
                 "trainer.train_iters=12", "trainer.eval_interval=2", "trainer.eval_iters=1",
                 "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.lr=1e-3",
                 "trainer.keep_last=1", "trainer.best_metric=validation/loss",
                 "trainer.early_stopping_patience=2", f"trainer.output_dir={run}",
                 f"user_script={__file__}"]  # a white-box PreTrainer (this module's)
    _, cfg = settle(compose(overrides), str(run))
    with caplog.at_level("INFO", logger="rapidformer"):
        state = ScriptedPretrainer(engine=RapidformerEngine(cfg, run)).train()
    assert state.step == 8 and state.best["step"] == 4 and state.best["mode"] == "min"
    assert steps_saved(run) == [4, 8]
    assert "early stopping at iteration 8 of 12: no improvement in validation/loss for 2 " \
           "evaluations" in caplog.text
    assert exported_equals(run, 4)
    # resumed with the same settings it would stop again after one more iteration: refused
    _, again = settle(compose([*overrides, "trainer.resume=auto"]), str(run))
    with pytest.raises(InputError, match="already stopped early at step 8 of 12"):
        ScriptedPretrainer(engine=RapidformerEngine(again, run)).train()
    assert steps_saved(run) == [4, 8]
