"""The fine-tuning tasks beyond sequence classification: token classification (NER), extractive
question answering, masked LM and seq2seq LM. Label alignment, entity scores and answer
extraction on hand-made examples with known answers; each task trained on its generated data
(its metric must move the right way between the first and the last evaluation); each on 2
processes with one memory mode."""
from __future__ import annotations

import json

import pytest

from tests.conftest import assert_ok, read_metrics, run_cli

QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.export_hf=false",
         "trainer.log_interval=5", "model=bert_tiny", "data=synthetic", "trainer.lr=1e-3",
         "trainer.micro_batch_size=16", "trainer.global_batch_size=32", "model.vocab_size=400"]
# task -> (recipe and its overrides, the metric, +1 when it should rise / -1 fall); each
# evaluates every 5 steps (seq2seq, whose evaluation generates, every 10)
TASKS = {
    "token_classification": (["+recipe=bert_ner", "data.synthetic_train_size=320",
                              "trainer.epochs=2"], "f1", +1),
    "question_answering": (["+recipe=bert_squad", "data.max_seq_length=64", "task.doc_stride=16",
                            "data.synthetic_train_size=640", "trainer.epochs=2"],
                           "exact_match", +1),
    "masked_lm": (["+recipe=bert_mlm", "data.synthetic_train_size=640", "trainer.epochs=2"],
                  "perplexity", -1),
    "seq2seq_lm": (["+recipe=t5_summarize", "model=t5_tiny", "task.source_prefix=",
                    "data.max_seq_length=48", "task.max_target_length=16", "trainer.lr=3e-3",
                    "data.synthetic_train_size=640", "trainer.epochs=2",
                    "trainer.eval_interval=10"], "rougeL", +1),
}


# --- hand-made examples -----------------------------------------------------------------------

def test_word_labels_align_to_sub_tokens():
    from rapidformer.data.token_labels import align_labels

    names = ["O", "B-PER", "I-PER", "B-LOC"]
    # [CLS] ann ##a smith lives in new ##ark [SEP]: words 0..4, two of them split in two
    word_ids = [None, 0, 0, 1, 2, 3, 4, 4, None]
    tags = [1, 2, 0, 0, 3]  # anna smith: PER; newark: LOC
    assert align_labels(word_ids, tags, False, names) == \
        [-100, 1, -100, 2, 0, 0, 3, -100, -100]
    # every sub-token labelled: a B- tag's continuation becomes I- (B-LOC has no I-LOC: kept)
    assert align_labels(word_ids, tags, True, names) == [-100, 1, 2, 2, 0, 0, 3, 3, -100]


def test_entity_scores_follow_conll_rules():
    from rapidformer.data.token_labels import entities, entity_counts, precision_recall_f1

    gold = ["B-PER", "I-PER", "O", "B-LOC", "I-LOC", "O", "I-ORG"]
    assert entities(gold) == {("PER", 0, 1), ("LOC", 3, 4), ("ORG", 6, 6)}
    # an I- of another type starts a new entity; a B- right after an entity ends it
    assert entities(["B-PER", "I-LOC", "B-LOC", "B-LOC"]) == \
        {("PER", 0, 0), ("LOC", 1, 1), ("LOC", 2, 2), ("LOC", 3, 3)}
    predicted = ["B-PER", "I-PER", "O", "B-LOC", "O", "O", "B-ORG"]  # LOC cut short
    correct, n_pred, n_gold = entity_counts([predicted], [gold])
    assert (correct, n_pred, n_gold) == (2, 3, 3)
    assert precision_recall_f1(correct, n_pred, n_gold)["f1"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    from rapidformer.data.synthetic_tasks import squad_example
    from rapidformer.data.tokenizers import train_wordpiece

    import random
    rng = random.Random(0)
    texts = [f"{e['question']} {e['context']}" for e in (squad_example(rng, i) for i in range(200))]
    return train_wordpiece(texts, tmp_path_factory.mktemp("wp"), 300, True, 512)


def test_windows_point_at_the_answer_and_extraction_finds_it(wordpiece):
    """A context longer than the sequence is read in overlapping windows; the window holding
    the answer points at it, the others at [CLS]; logits that favour the answer's tokens give
    back its exact text."""
    from datasets import Dataset

    from rapidformer.config.schema import DataConfig, TaskConfig
    from rapidformer.data.qa import (best_answers, eval_features, exact_match, f1_score,
                                     train_features)

    context = ("anna lives in paris . ben carter works for acme . dora bought a car . "
               "emil novak lives in new york . fatima works for zenith .")
    answer = "new york"
    row = {"id": "0", "question": "where does emil novak live ?", "context": context,
           "answers": {"text": [answer], "answer_start": [context.index(answer)]}}
    d, t = DataConfig(max_seq_length=24), TaskConfig(doc_stride=8)
    examples = Dataset.from_list([row])
    train = examples.map(lambda b: train_features(b, wordpiece, d, t), batched=True,
                         remove_columns=examples.column_names)
    assert len(train) >= 3  # the context did not fit one window
    pointed = [(s, e) for s, e in zip(train["start_positions"], train["end_positions"]) if s]
    assert pointed, "no window holds the answer"
    for window, (s, e) in zip(train, zip(train["start_positions"], train["end_positions"])):
        if s:
            assert wordpiece.decode(window["input_ids"][s:e + 1]) == answer
    features = examples.map(lambda b, idx: eval_features(b, idx, wordpiece, d, t), batched=True,
                            with_indices=True, remove_columns=examples.column_names)
    assert set(features["example_index"]) == {0}
    # logits: high at the answer's tokens in the first window holding it, noise elsewhere
    starts, ends = [], []
    for window, (s, e) in zip(features, zip(train["start_positions"], train["end_positions"])):
        length = len(window["input_ids"])
        starts.append([5.0 if (i == s and s) else 0.1 * (i % 3) for i in range(length)])
        ends.append([5.0 if (i == e and s) else 0.1 * (i % 2) for i in range(length)])
    predicted = best_answers(starts, ends, features["example_index"], features["offset_mapping"],
                             [context], n_best=5, max_answer_length=10)
    assert predicted == [answer]
    assert exact_match("New York!", [answer]) == 1.0
    assert f1_score("the new york city", [answer]) == pytest.approx(0.8)
    assert f1_score("paris", [answer]) == 0.0


# --- each task trains -------------------------------------------------------------------------

@pytest.mark.parametrize("task", list(TASKS))
def test_task_trains_and_its_metric_moves_the_right_way(task, tmp_path):
    from rapidformer import __main__ as module_main

    overrides, metric, direction = TASKS[task]
    # evaluate twice per epoch: the first evaluation is early in training
    module_main.main([*QUIET, "trainer.eval_interval=5", *overrides,
                      "data.synthetic_eval_size=64", f"trainer.output_dir={tmp_path}"])
    evals = [r[f"validation/{metric}"] for r in read_metrics(tmp_path)
             if f"validation/{metric}" in r]
    assert len(evals) >= 3, evals
    assert direction * (evals[-1] - evals[0]) > 0, (metric, evals)
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("task,memory", [("token_classification", "zero2"),
                                         ("question_answering", "fsdp"),
                                         ("masked_lm", "none"), ("seq2seq_lm", "zero3")])
def test_task_on_two_processes(task, memory, tmp_path):
    overrides, metric, _ = TASKS[task]
    precision = "precision=bf16" if memory != "none" else "precision=fp32"
    assert_ok(run_cli([*QUIET, *overrides, "trainer.epochs=1", "data.synthetic_train_size=128",
                       "data.synthetic_eval_size=33", f"memory={memory}", precision,
                       "launcher.nproc_per_node=2", f"trainer.output_dir={tmp_path / 'run'}"],
                      cwd=tmp_path))
    records = read_metrics(tmp_path / "run")
    final = [r for r in records if f"validation/{metric}" in r][-1]
    assert final[f"validation/{metric}"] == final[f"validation/{metric}"]  # a number, not NaN
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "ok"


def test_task_settings_are_checked():
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="task=seq2seq_lm needs an encoder-decoder model"):
        settle(compose(["+recipe=t5_summarize", "model=bert_tiny", "data=synthetic"]))
    with pytest.raises(ConfigError, match="task.doc_stride=64 must be positive and below"):
        settle(compose(["+recipe=bert_squad", "model=bert_tiny", "data=synthetic",
                         "data.max_seq_length=64", "task.doc_stride=64"]))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("precision,memory", [("bf16", "none"), ("fp16", "none"),
                                              ("fp16", "zero2")])
def test_task_on_a_gpu_in_half_precision(task, precision, memory, tmp_path):
    """fp16 (loss scaling; DeepSpeed's under ZeRO, which has no fp16 on a CPU) and bf16."""
    from rapidformer import __main__ as module_main

    overrides, metric, _ = TASKS[task]
    module_main.main([*QUIET, *overrides, "trainer.epochs=1", "data.synthetic_eval_size=32",
                      f"precision={precision}", f"memory={memory}", "trainer.device=cuda",
                      f"trainer.output_dir={tmp_path}"])
    records = read_metrics(tmp_path)
    final = [r for r in records if f"validation/{metric}" in r][-1]
    assert final[f"validation/{metric}"] == final[f"validation/{metric}"]
    losses = [r["loss"] for r in records if "loss" in r]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
