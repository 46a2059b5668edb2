"""A step's loss is the mean over every item of its global batch (templates/item_weights.py):
the same rows give the same loss and gradient at any micro batch size, and on any number of
ranks, though their answers have other numbers of labelled tokens."""
from __future__ import annotations

import pytest
import torch

from rapidformer.templates.item_weights import IGNORE, loss_items, micro_batch_weights
from tests.conftest import run_here, read_metrics


def labels(*lengths: int, width: int = 8) -> torch.Tensor:
    rows = torch.full((len(lengths), width), IGNORE)
    for row, n in enumerate(lengths):
        rows[row, width - n:] = 7
    return rows


@pytest.mark.parametrize("unit, batch, items", [
    ("labels", {"labels": labels(3, 5)}, 8),
    ("next_labels", {"labels": labels(3, 8)}, 10),  # the first position predicts nothing
    ("examples", {"labels": torch.tensor([0, 1, 1])}, 3),
    ("examples", {"start_positions": torch.tensor([4, 2]), "input_ids": torch.ones(1, 9)}, 2),
    ("labels", {"input_ids": torch.ones(2, 3)}, None),
    ("labels", ("a", "tuple"), None),
])
def test_what_a_loss_averages_over(unit, batch, items):
    got = loss_items(batch, unit)
    assert (None if got is None else int(got)) == items


def test_weights_make_the_mean_of_means_the_mean_over_items():
    losses = torch.tensor([2.0, 1.0, 4.0, 3.0])  # each micro-batch's mean
    counts = [4, 11, 14, 6]  # its items; two micro-batches on each of two ranks
    sums = losses * torch.tensor(counts, dtype=torch.float)
    expected = float(sums.sum() / sum(counts))
    ranks = [counts[:2], counts[2:]]
    total = float(sum(counts))
    weighted = []
    for mine in ranks:  # each rank's all-reduce returns the sum over both ranks
        weights = micro_batch_weights(mine, 2, lambda t: torch.tensor(total), "cpu")
        weighted += [float(w) for w in weights]
    # the backward averages over micro-batches, the strategy over ranks
    assert float((losses * torch.tensor(weighted)).mean()) == pytest.approx(expected)
    assert micro_batch_weights([4, None], 1, lambda t: t, "cpu") is None


def test_an_sft_step_is_the_same_at_any_micro_batch_size(tmp_path, capsys, monkeypatch):
    """8 chats of answers of other lengths: one micro-batch of 8, or 8 of 1 accumulated."""
    first = {}
    for micro in (8, 1):
        run = tmp_path / f"run{micro}"
        code, printed = run_here(
            ["+recipe=llama_sft", f"data.path={tmp_path / 'data'}", "data.synthetic_train_size=8",
             "data.synthetic_eval_size=4", "trainer.epochs=null", "trainer.train_iters=1",
             "trainer.global_batch_size=8", f"trainer.micro_batch_size={micro}",
             "trainer.log_interval=1", "trainer.device=cpu", "task.sample_generations=0",
             "trainer.progress_bar=false", "trainer.tensorboard=false",
             "trainer.export_hf=false", "trainer.save_last=false", f"trainer.output_dir={run}"],
            capsys, monkeypatch, tmp_path)
        assert code == 0, printed[-3000:]
        first[micro] = next(r for r in read_metrics(run) if "loss" in r and r["step"] == 1)
    assert first[1]["loss"] == pytest.approx(first[8]["loss"], rel=1e-5)
    assert first[1]["grad_norm"] == pytest.approx(first[8]["grad_norm"], rel=1e-4)


def test_a_micro_batch_of_no_item_adds_nothing(tmp_path, capsys, monkeypatch):
    """Masked LM on 8-token rows at micro batch 1: a row often has no masked token (its mean is
    0/0, NaN); the step's loss is that of the rows that have some (it was NaN, and enough such
    steps in a row stopped a healthy run)."""
    import math

    run = tmp_path / "run"
    code, printed = run_here(
        ["task=masked_lm", "model=bert_tiny", "data=synthetic", "data.synthetic_train_size=64",
         "data.synthetic_eval_size=4", "data.max_seq_length=8", "trainer.epochs=null",
         "trainer.train_iters=6", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
         "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.tensorboard=false",
         "trainer.export_hf=false", "trainer.save_last=false", f"trainer.output_dir={run}"],
        capsys, monkeypatch, tmp_path)
    assert code == 0, printed[-3000:]
    steps = [r for r in read_metrics(run) if "loss" in r and "step" in r]
    assert len(steps) == 6 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                                   for r in steps), steps
