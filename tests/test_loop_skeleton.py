"""The loop written once (rapidformer/templates/skeleton.py) and the LoopControl verbs it runs
(rapidformer/templates/loop.py): both templates run the one skeleton, its questions change
nothing, an evaluation is recorded where it happens, and saving is separate from stopping. The
behaviour end to end: tests/test_best_checkpoint.py, test_nonfinite.py, test_trust.py,
test_preemption.py, test_signals.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.templates.finetuner import Finetuner
from rapidformer.templates.loop import LoopControl
from rapidformer.templates.pretrainer import PreTrainer
from rapidformer.templates.skeleton import TemplateLoop


def test_both_templates_run_the_one_skeleton():
    for template in (Finetuner, PreTrainer):
        assert issubclass(template, TemplateLoop)
        for name in ("train_step", "_save", "_run_loop"):
            assert name not in vars(template), (template.__name__, name)


def loop_control(tmp_path, *overrides: str, total_iters: int = 10):
    """A LoopControl outside a run (not entered): its questions and checkpoints, and the
    checkpoints it writes (steps, in order)."""
    _, cfg = settle(compose(["trainer.device=cpu", f"trainer.output_dir={tmp_path}",
                             *overrides]), str(tmp_path))
    engine = SimpleNamespace(cfg=cfg, checkpoint_root=tmp_path / "checkpoints",
                             is_main_process=True, device=torch.device("cpu"),
                             all_reduce_max=lambda tensor: tensor)
    written = []
    loop = LoopControl(engine, total_iters, SimpleNamespace(step=0, best=None),
                       lambda state: written.append(state.step))
    return loop, written


def test_the_questions_change_nothing(tmp_path):
    loop, written = loop_control(tmp_path, "trainer.eval_interval=2", "trainer.save_interval=3",
                                 "trainer.exit_interval=5")
    before = dict(vars(loop))
    steps = range(1, 11)
    assert [s for s in steps if loop.eval_due(s)] == [2, 4, 6, 8, 10]
    assert [s for s in steps if loop.save_due(s)] == [3, 6, 9]
    assert [s for s in steps if loop.exit_due(s)] == [5]  # not the last step: the run ends there
    assert all(loop.final_evaluation_due(s) for s in steps)
    assert vars(loop) == before and loop.evaluated_at == -1 and written == []


def test_without_intervals_an_epoch_end_evaluates_and_saves(tmp_path):
    loop, _ = loop_control(tmp_path, "trainer.eval_interval=null", "trainer.save_interval=null")
    assert not loop.eval_due(3) and not loop.save_due(3) and not loop.exit_due(3)
    assert loop.eval_due(3, epoch_done=True) and loop.save_due(3, epoch_done=True)


def test_an_evaluation_is_recorded_where_it_happens(tmp_path):
    loop, written = loop_control(tmp_path, "trainer.eval_interval=2")
    assert loop.eval_due(4) and loop.final_evaluation_due(4)  # asked: nothing recorded
    loop.evaluated(SimpleNamespace(step=4, best=None), {"validation/loss": 1.0})
    assert not loop.final_evaluation_due(4) and loop.final_evaluation_due(5)
    assert written == []  # without trainer.best_metric an evaluation saves nothing


def test_a_step_is_saved_once(tmp_path):
    loop, written = loop_control(tmp_path)
    state = SimpleNamespace(step=3, best=None)
    assert loop.save(state) and loop.save(state)  # the second: already saved by this run
    state.step = 4
    assert loop.save(state)
    assert written == [3, 4]
