"""A loss that turns NaN stops the run after trainer.max_nonfinite_steps steps in a row, with
exit code 4, and no checkpoint is written from a diverged step: the newest complete one stays
the good one."""
from __future__ import annotations

import math

import torch

from rapidformer.checkpoint import store as checkpoint
from rapidformer.errors import EXIT_DIVERGED
from tests.conftest import FAST, run_cli, train_losses

# the black-box task, made to diverge from the 5th optimizer step (2 micro-batches per step)
DIVERGING = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class Diverging(SequenceClassificationFinetuner):
    calls = 0

    def run_forward_step(self, batch, model):
        loss = super().run_forward_step(batch, model)
        Diverging.calls += 1
        return loss * float("nan") if Diverging.calls > 8 else loss


Diverging(engine=RapidformerEngine()).train()
'''


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    script = tmp_path / "diverging.py"
    script.write_text(DIVERGING)
    run = tmp_path / "run"
    result = run_cli([f"user_script={script}", *FAST, "trainer.train_iters=20",
                      "trainer.save_interval=2", "trainer.max_nonfinite_steps=3",
                      "trainer.export_hf=false", f"trainer.output_dir={run}"], cwd=tmp_path)
    assert result.returncode == EXIT_DIVERGED, result.stderr[-3000:]
    assert ("rapidformer: error: the loss was NaN or infinite for 3 steps in a row (by step 7); "
            "stopped without saving: the newest complete checkpoint, step_00000004, is untouched"
            ) in result.stderr
    assert "no checkpoint at step 6: its loss is not finite" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    complete, broken = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000002", "step_00000004"] and not broken
    weights = torch.load(complete[-1] / "model.pt", map_location="cpu")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    losses = train_losses(run)
    assert all(math.isfinite(losses[s]) for s in (1, 2, 3, 4))
    assert all(math.isnan(losses[s]) for s in (5, 6)) and 7 not in losses


def test_the_advice_is_true_of_the_run_that_stopped():
    """A bf16 run is not told to use bf16 (issue 37's run was), clipping is suggested only
    where it is off, and the accelerators the run used are named to rule out one at a time."""
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.templates.loop import nonfinite_advice

    def advice(*overrides):
        return nonfinite_advice(settle(compose(["+recipe=quickstart", *overrides]), "out")[1])

    issue = advice("precision=bf16", "trainer.unpad=true", "graph=compile",
                   "graph.mode=reduce-overhead")
    assert issue == ("Lower trainer.lr; to tell whether an accelerator is at fault, rerun "
                     "without each of graph=compile, graph.mode=reduce-overhead, "
                     "trainer.unpad=true (a setting the loss depends on is a bug: please "
                     "report it)")
    assert advice("precision=fp16", "trainer.clip_grad=0") == (
        "Lower trainer.lr, set trainer.clip_grad or use precision=bf16 or fp32")
    assert advice("precision=fp32") == "Lower trainer.lr"
