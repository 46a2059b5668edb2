"""trainer.eval_micro_batch_size: fine-tuning evaluates in batches of its own size (null: the
training micro batch), with the same metrics; a PreTrainer task refuses it (it evaluates
trainer.eval_iters global batches in training micro-batches)."""
from __future__ import annotations

import pytest

from tests.test_eval_reduce import TASKS, evaluate_task


def test_evaluation_batches_of_their_own_size_give_the_same_metrics(tmp_path):
    task = "sequence_classification"
    default, weights = evaluate_task(task, TASKS[task], tmp_path / "default")
    own, same_weights = evaluate_task(task, [*TASKS[task], "trainer.eval_micro_batch_size=5"],
                                      tmp_path / "own")
    assert weights == same_weights
    assert own == pytest.approx(default, abs=1e-6)


def test_the_loader_reads_evaluation_batches_of_their_size_and_training_ones_of_its(tmp_path):
    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class
    from tests.test_eval_reduce import COMMON

    _, cfg = settle(compose([*COMMON, *TASKS["sequence_classification"],
                             "trainer.eval_micro_batch_size=5"]), str(tmp_path))
    trainer = task_class("sequence_classification")(engine=RapidformerEngine(cfg, tmp_path))
    train, valid, _, collate = trainer.train_valid_test_datasets_provider()
    sizes = [len(b["labels"]) for b in trainer.build_data_loader(valid, collate_fn=collate)]
    assert sizes == [5] * 7 + [2]  # 37 examples
    shuffled = trainer.build_data_loader(train, shuffle=True, collate_fn=collate)
    assert {len(b["labels"]) for b in shuffled} == {8}  # 48 examples, the micro batch


def test_a_pretraining_task_refuses_it():
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError
    from rapidformer.preflight import settle

    with pytest.raises(ConfigError, match="trainer.eval_micro_batch_size=8 has no effect with "
                                          "task=causal_lm"):
        settle(compose(["+recipe=gpt_pretrain", "trainer.eval_micro_batch_size=8"]), "out")
    with pytest.raises(ConfigError, match="trainer.eval_micro_batch_size"):
        settle(compose(["+recipe=quickstart", "trainer.eval_micro_batch_size=0"]), "out")
