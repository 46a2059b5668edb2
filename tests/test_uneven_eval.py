"""Evaluation with fewer examples than processes, or unevenly many per process: every task's
metrics on 2 gloo ranks (started in-process, one pair for the whole table) equal one process's
on the same data and weights, for validation sets of 0, 1, 2, 3 and 9 examples in batches of 4,
and 3 in batches of 1 (at 1, at 9 and at 3 in ones, a rank's share runs out a batch early and
it evaluates a padding batch; at 0 no rank has a batch). Under DDP every forward is a collective (it broadcasts buffers), under FSDP2
every forward and every step of a generation is: a rank with a batch fewer would hang the
others, which the collective timeout turns into a failure here. The pretraining tasks'
evaluation (trainer.eval_iters) is compared at validation splits of 1, 2 and 3 documents.

Then the rule for the splits a task evaluates (tasks/base.py): one the task's filtering empties
is an error that names the file, the count and why, and the fix; data without a validation
split trains without evaluation, said at the start and recorded in metrics.jsonl."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, free_port

BATCH = 4
# (examples, batch size): the evaluations of each case
ROWS = ((0, BATCH), (1, BATCH), (2, BATCH), (3, BATCH), (9, BATCH), (3, 1))
# a rank that skips a collective fails the test in a minute, not in the default ten
COMMON = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu",
          f"trainer.micro_batch_size={BATCH}", "trainer.global_batch_size=null",
          "trainer.epochs=1", "launcher.collective_timeout=60"]
SYNTHETIC = ["data.synthetic_train_size=16", "data.synthetic_eval_size=9"]
BERT = ["model=bert_tiny", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_layers=1", "model.vocab_size=300"]
T5 = ["model=t5_tiny", "model.hidden_size=32", "model.intermediate_size=64",
      "model.num_layers=1"]
LLAMA = ["model=llama_tiny", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1"]
# case: (task, overrides)
CASES = {
    "sequence_classification": ("sequence_classification",
                                ["+recipe=quickstart", *BERT, "data.max_seq_length=32"]),
    "token_classification": ("token_classification",
                             ["+recipe=bert_ner", *BERT, "data=synthetic",
                              "data.max_seq_length=32"]),
    "question_answering": ("question_answering",
                           ["+recipe=bert_squad", *BERT, "data=synthetic",
                            "data.max_seq_length=64", "task.doc_stride=16"]),
    "masked_lm": ("masked_lm", ["+recipe=bert_mlm", *BERT, "data=synthetic",
                                "data.max_seq_length=32"]),
    "seq2seq_lm": ("seq2seq_lm", ["+recipe=t5_summarize", "data=synthetic", *T5,
                                  "task.source_prefix=", "data.max_seq_length=32",
                                  "task.max_target_length=6"]),
    "sft": ("sft", ["+recipe=llama_sft", *LLAMA, "data.max_seq_length=64",
                    "task.sample_generations=2", "task.max_new_tokens=4"]),
    # sharded weights (FSDP2, ZeRO-3): each forward, and each step of a generation, gathers them
    "sequence_classification_fsdp": ("sequence_classification",
                                     ["+recipe=quickstart", *BERT, "data.max_seq_length=32",
                                      "memory=fsdp"]),
    "seq2seq_lm_zero3": ("seq2seq_lm", ["+recipe=t5_summarize", "data=synthetic", *T5,
                                       "task.source_prefix=", "data.max_seq_length=32",
                                       "task.max_target_length=6", "memory=zero3"]),
    "sft_fsdp": ("sft", ["+recipe=llama_sft", *LLAMA, "data.max_seq_length=64",
                         "task.sample_generations=2", "task.max_new_tokens=4", "memory=fsdp"]),
}
DOCUMENTS = (1, 2, 3)  # the pretraining tasks' validation documents
CORPUS = 24


# --- the table: each rank's metrics and one process's ---------------------------------------

def first_examples(task: str, valid, n: int):
    """The validation set's first `n` examples (question answering: their windows)."""
    if task == "question_answering":
        return valid.select([i for i, e in enumerate(valid["example_index"]) if e < n])
    return valid.select(range(n))


def evaluate_case(case: str, world: int, run_dir: Path) -> dict:
    """{"NxB": metrics} of one case, its model built once (from a fixed seed, on every rank
    and in the one process alike) and scored on its first N examples in batches of B (ROWS)."""
    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class

    task, overrides = CASES[case]
    if world == 1:  # the reference: one plain process (no sharding to do)
        overrides = [o for o in overrides if not o.startswith("memory=")]
    _, cfg = settle(compose([*COMMON, *SYNTHETIC, *overrides,
                             f"launcher.nproc_per_node={world}"]), str(run_dir))
    engine = RapidformerEngine(cfg, run_dir)
    trainer = task_class(task)(engine=engine)
    with engine.main_process_first():  # rank 0 writes the generated data and tokenizer
        _, valid, _, collate = trainer.train_valid_test_datasets_provider()
    prompts = getattr(trainer, "prompts", [])
    torch.manual_seed(0)
    model, _, _ = engine.compose(trainer.model_optimizer_lr_scheduler_provider()[0],
                                 total_iters=1)
    results = {}
    for n, batch_size in ROWS:
        trainer.prompts = prompts[:n]  # sft: greedy answers to the first prompts of the n
        loader = trainer.build_data_loader(first_examples(task, valid, n), collate_fn=collate,
                                           batch_size=batch_size)
        results[f"{n}x{batch_size}"] = trainer.evaluate(model, loader)
    return results


def pretraining_args(data: dict, kind: str, documents: int) -> list[str]:
    split = f"data.split={CORPUS - documents},{documents},0"
    if kind == "bert_pretraining":
        return ["+recipe=bert_pretrain", "model=bert_tiny", f"data.path={data['bert']}",
                f"model.tokenizer={data['vocab']}", "data.max_seq_length=32", split]
    return ["+recipe=gpt_pretrain", "model=gpt2_tiny", f"data.path={data['gpt']}",
            f"model.tokenizer={data['gpt2_vocab']}", f"model.merge_file={data['merges']}",
            "data.max_seq_length=32", split]


def evaluate_pretraining(kind: str, documents: int, data: dict, world: int, run_dir: Path
                         ) -> dict:
    """The PreTrainer's validation (trainer.eval_iters=3 global batches of 8) of a model built
    from a fixed seed, on a validation split of `documents` documents."""
    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class
    from rapidformer.templates.pretrainer import PretrainState, train_valid_test_num_samples

    class Nowhere:
        def write(self, step, record):
            pass

    _, cfg = settle(compose([*pretraining_args(data, kind, documents), "trainer.device=cpu",
                             "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
                             "trainer.train_iters=2", "trainer.eval_iters=3",
                             "data.num_workers=0", "launcher.collective_timeout=60",
                             f"launcher.nproc_per_node={world}"]), str(run_dir))
    engine = RapidformerEngine(cfg, run_dir)
    trainer = task_class(kind)(engine=engine)
    t = cfg.trainer
    _, valid, _ = trainer.train_valid_test_datasets_provider(train_valid_test_num_samples(
        t.train_iters, t.eval_interval, t.eval_iters, t.global_batch_size))
    torch.manual_seed(0)
    model, _, _ = engine.compose(trainer.model_optimizer_lr_scheduler_provider()[0],
                                 total_iters=1)
    return trainer._evaluate("validation", model, trainer.build_data_iterator(valid),
                             PretrainState(), Nowhere())


def evaluate_all(root: Path, world: int, data: dict) -> dict:
    results = {}
    for case in CASES:
        results.update({f"{case}/{n}": m for n, m in
                        evaluate_case(case, world, root / f"run{world}" / case).items()})
    for kind in ("causal_lm", "bert_pretraining"):
        for documents in DOCUMENTS:
            results[f"{kind}/{documents}"] = evaluate_pretraining(
                kind, documents, data, world, root / f"run{world}" / f"{kind}_{documents}")
    return json.loads(json.dumps(results))  # as the ranks' come back: JSON (NaN kept)


def _worker(rank: int, world: int, port: int, root: str, data: dict):
    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results = evaluate_all(Path(root), world, data)
    Path(root, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    from rapidformer.data.corpus import write_pretraining_sample

    data = write_pretraining_sample(tmp_path_factory.mktemp("corpus"), num_docs=CORPUS)
    return {k: str(v) for k, v in data.items()}


@pytest.fixture(scope="module")
def table(tmp_path_factory, corpus) -> tuple[dict, list[dict], float]:
    """(one process's metrics, each of 2 ranks', the seconds the ranks took), case by case."""
    root = tmp_path_factory.mktemp("uneven_eval")
    start = time.monotonic()
    ranks = mp.start_processes(_worker, args=(2, free_port(), str(root), corpus), nprocs=2,
                               join=False, start_method="spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes on CI's two cores: no thread team spinning
    try:
        single = evaluate_all(root, 1, corpus)  # meanwhile
    finally:
        torch.set_num_threads(threads)
    while not ranks.join():
        pass
    took = time.monotonic() - start
    return single, [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)], took


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("key", [f"{case}/{n}x{b}" for case in CASES for n, b in ROWS]
                         + [f"{kind}/{d}" for kind in ("causal_lm", "bert_pretraining")
                            for d in DOCUMENTS])
def test_two_ranks_report_the_one_process_metrics(table, key):
    single, (rank0, rank1), _ = table
    assert json.dumps(rank0[key]) == json.dumps(rank1[key])  # every rank, bit for bit
    assert sorted(rank0[key]) == sorted(single[key]) and single[key], key
    for metric, value in single[key].items():
        assert same(rank0[key][metric], value), (key, metric, rank0[key][metric], value)
    count = int(key.rsplit("/", 1)[1].split("x")[0])
    if count and not key.startswith(("masked_lm", "causal_lm", "bert_pretraining")):
        # a number: the examples were scored (a masked-LM subset may hold no masked token)
        assert all(not math.isnan(v) for v in single[key].values()), (key, single[key])
    if count == 0:
        assert all(math.isnan(v) for v in single[key].values()), (key, single[key])


# --- the commands, through the CLI: one validation example, two processes -----------

RECIPES = {
    "quickstart": ["+recipe=quickstart", *BERT, "data.max_seq_length=32",
                   "trainer.micro_batch_size=8"],
    "llama_sft": ["+recipe=llama_sft", *LLAMA, "data.max_seq_length=64",
                  "trainer.micro_batch_size=8", "task.sample_generations=1",
                  "task.max_new_tokens=4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_validation_example_on_two_processes_trains_evaluates_and_exports(tmp_path, recipe):
    """The issue's reproductions: one evaluation hung (sft: a DDP forward is a collective),
    the other crashed on the rank without an example. Now both finish, and their validations,
    best checkpoint and early stop are one process's."""
    from tests.conftest import assert_ok, read_metrics, run_cli, run_in_process

    args = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu",
            *RECIPES[recipe], "data.synthetic_train_size=64", "data.synthetic_eval_size=1",
            "trainer.global_batch_size=16", "trainer.epochs=null", "trainer.train_iters=8",
            "trainer.eval_interval=2", "trainer.lr=1e-2", "trainer.best_metric=validation/loss",
            # the loss falls, so "max" makes the first evaluation the best and stops early at
            # the third: the best checkpoint, early stopping and the best's export are used
            "trainer.best_mode=max", "trainer.early_stopping_patience=2",
            "launcher.collective_timeout=60"]
    runs = {}
    for world in (1, 2):
        run = tmp_path / f"world{world}"
        command = [*args, f"launcher.nproc_per_node={world}", f"trainer.output_dir={run}"]
        if world == 1:  # the reference, in this process: the two processes are the subject
            run_in_process(command, cwd=tmp_path)
        else:
            assert_ok(run_cli(command, cwd=tmp_path, timeout=300))
        assert (run / "hf_model" / "config.json").is_file()
        evaluations = [r for r in read_metrics(run) if "validation/loss" in r]
        best = json.loads((run / "checkpoints" / "best.json").read_text())
        runs[world] = evaluations, best
    (single, single_best), (two, two_best) = runs[1], runs[2]
    assert [r["step"] for r in two] == [r["step"] for r in single] == [2, 4, 6]  # stopped early
    for one, other in zip(single, two):
        for key, value in one.items():
            if key.startswith("validation/"):
                assert other[key] == pytest.approx(value, rel=1e-4), (one["step"], key)
    assert (two_best["step"], two_best["evaluated_at"]) == \
        (single_best["step"], single_best["evaluated_at"]) == (2, 6)


# --- how the examples are laid out over ranks ---------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 9, 16])
def test_every_example_once_and_the_same_batches_on_every_rank(size, world, batch_size):
    from rapidformer.templates.finetuner import even_eval_batches

    plans = [even_eval_batches(size, rank, world, batch_size) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1  # in step: as many forwards on every rank
    real = sorted(i for plan in plans for rows, padding in plan if not padding for i in rows)
    assert real == list(range(size))  # each example once, none missing
    one_process = -(-size // batch_size)
    for plan in plans:
        assert all(0 < len(rows) <= batch_size for rows, _ in plan)
        assert all(len(rows) == 1 for rows, padding in plan if padding)
        assert len(plan) <= one_process  # never more batches than one process reads
        assert [padding for _, padding in plan] == sorted(padding for _, padding in plan)


def test_a_padding_batch_adds_no_row_to_a_gather_and_the_flag_does_not_outlive_the_loop():
    from rapidformer.templates.finetuner import _DeviceLoader

    class Engine:
        world_size, padding_batch = 1, False

        def to_device(self, batch):
            return batch

        def gather(self, tensor):
            from rapidformer.engine import RapidformerEngine

            return RapidformerEngine.gather(self, tensor)

    engine = Engine()
    loader = _DeviceLoader([torch.ones(2), torch.ones(1)], engine, [False, True])
    rows = [len(engine.gather(batch)) for batch in loader]
    assert rows == [2, 0] and engine.padding_batch is False
    for _ in _DeviceLoader([torch.ones(1)], engine, [True]):
        break  # left at a padding batch
    assert engine.padding_batch is False


# --- the rule of the evaluated splits -----------------------------------------------------------

def chat(question: str, answer: str | None) -> dict:
    turns = [{"role": "user", "content": question}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer else [])}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def provider_of(task: str, overrides: list[str], run_dir: Path):
    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class

    _, cfg = settle(compose([*COMMON, *overrides]), str(run_dir))
    return task_class(task)(engine=RapidformerEngine(cfg, run_dir))


SFT_TRAIN = [chat("where does anna live ?", "paris")] * 8
LONG = "where does anna live ? " * 40


@pytest.mark.parametrize("validation, packing, message", [
    ([chat("where does anna live ?", None)] * 3, False,
     "all 3 of its examples were dropped (3 with no assistant turn). give the rows an "
     "assistant turn"),
    ([chat(LONG, "paris")] * 2, False,
     "all 2 of its examples were dropped (2 cut to data.max_seq_length=64 tokens before an "
     "assistant token). raise data.max_seq_length (now 64)"),
    ([chat(LONG, "paris"), chat("who ?", None)], True,
     "all 2 of its examples were dropped (1 cut to data.max_seq_length=64 tokens before an "
     "assistant token; 1 with no assistant turn). raise data.max_seq_length (now 64) or give "
     "the rows an assistant turn"),
])
def test_sft_validation_emptied_by_its_filter_is_an_error(tmp_path, validation, packing,
                                                          message):
    from rapidformer.errors import InputError

    write_jsonl(tmp_path / "data" / "train.jsonl", SFT_TRAIN)
    file = write_jsonl(tmp_path / "data" / "validation.jsonl", validation)
    trainer = provider_of("sft", ["+recipe=llama_sft", *LLAMA, "data=local",
                                  f"data.path={tmp_path / 'data'}", "data.max_seq_length=64",
                                  f"data.packing={packing}"], tmp_path / "run")
    with pytest.raises(InputError) as error:
        trainer.train_valid_test_datasets_provider()
    text = str(error.value)
    assert text.startswith(f"{file}: task=sft has nothing to score in the validation split: ")
    assert message in text.replace(":", ".")
    assert "remove the validation split from the data to train without evaluation" in text


def test_sft_training_split_emptied_by_its_filter_is_an_error(tmp_path):
    from rapidformer.errors import InputError

    file = write_jsonl(tmp_path / "data" / "train.jsonl", [chat("who ?", None)] * 2)
    trainer = provider_of("sft", ["+recipe=llama_sft", *LLAMA, "data=local",
                                  f"data.path={tmp_path / 'data'}"], tmp_path / "run")
    with pytest.raises(InputError) as error:
        trainer.train_valid_test_datasets_provider()
    assert str(error.value) == (f"{file}: task=sft has nothing to train on in the train split: "
                                f"all 2 of its examples were dropped (2 with no assistant turn). "
                                f"give the rows an assistant turn (a prompt/response or messages "
                                f"row with the assistant's answer)")


@pytest.mark.parametrize("validation, message", [
    ([{"text": ""}, {"text": "  "}],
     "all 2 of its examples were dropped (no text in data.text_column=text)"),
    ([{"text": "anna"}],
     "none of its 1 examples has a token masked at data.mask_prob=0.01"),
])
def test_masked_lm_validation_without_a_token_to_score_is_an_error(tmp_path, validation,
                                                                   message):
    from rapidformer.errors import InputError

    write_jsonl(tmp_path / "data" / "train.jsonl",
                [{"text": "anna lives in paris and works for acme"}] * 8)
    file = write_jsonl(tmp_path / "data" / "validation.jsonl", validation)
    trainer = provider_of("masked_lm", ["+recipe=bert_mlm", *BERT, "data=local",
                                        f"data.path={tmp_path / 'data'}", "data.mask_prob=0.01",
                                        "data.max_seq_length=32"], tmp_path / "run")
    with pytest.raises(InputError) as error:
        trainer.train_valid_test_datasets_provider()
    assert str(error.value).startswith(f"{file}: task=masked_lm has nothing to score in the "
                                       f"validation split: {message}")


def test_a_white_box_empty_validation_dataset_is_an_error_before_training(tmp_path):
    from rapidformer.errors import InputError
    from rapidformer.templates.finetuner import Finetuner

    class Empty(Finetuner):
        def train_valid_test_datasets_provider(self):
            return [{"x": 1}] * 8, [], None, None

        def model_optimizer_lr_scheduler_provider(self):
            raise AssertionError("no model is built for a run that is refused")

        def run_forward_step(self, batch, model):
            raise AssertionError

        def run_compute_metrics(self, model, eval_dataloader):
            raise AssertionError

    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle

    _, cfg = settle(compose(COMMON), str(tmp_path))
    with pytest.raises(InputError, match="returned an empty validation dataset: every "
                                         "evaluation would score nothing. Give it examples, "
                                         "or return None for it to train without evaluation"):
        Empty(engine=RapidformerEngine(cfg, tmp_path)).train()


def test_data_without_a_validation_split_trains_without_evaluation_and_says_so(tmp_path):
    from rapidformer import __main__ as module_main
    from rapidformer.cli.summary import summary_lines
    from rapidformer.observability.records import NO_EVALUATION, read_metrics

    write_jsonl(tmp_path / "data" / "train.jsonl", SFT_TRAIN)
    run = tmp_path / "run"
    module_main.main([*COMMON, "+recipe=llama_sft", *LLAMA, "data=local",
                      f"data.path={tmp_path / 'data'}", "data.max_seq_length=64",
                      "trainer.eval_interval=1", f"trainer.output_dir={run}"])
    said = [line for line in (run / "rapidformer.log").read_text().splitlines()
            if "without evaluation" in line]
    assert len(said) == 1 and "[WARNING]" in said[0]  # once, at the start
    assert "training without evaluation: the data has no validation split" in said[0]
    records = read_metrics(run)
    notes = [r for r in records if NO_EVALUATION in r]
    assert len(notes) == 1 and notes[0][NO_EVALUATION].startswith("training without evaluation")
    assert not any(k.startswith("validation/") for r in records for k in r)
    shown = [line.split(None, 1)[1] for line in summary_lines(run)
             if line.strip().startswith("evaluation ")]
    assert shown == [f"none: {notes[0][NO_EVALUATION]}"]


def test_pretraining_validation_share_of_no_document_is_an_error(tmp_path, corpus):
    from rapidformer.errors import InputError

    trainer = provider_of("causal_lm", [*pretraining_args(corpus, "causal_lm", 1),
                                        "data.split=999,1,0", "trainer.train_iters=2",
                                        "trainer.eval_iters=1", "trainer.global_batch_size=8"],
                          tmp_path)
    with pytest.raises(InputError, match=rf"data.split=999,1,0 gives the validation split 0.10% "
                                         rf"of data.path's documents, which is not one whole "
                                         rf"document of its {CORPUS} documents"):
        trainer.train_valid_test_datasets_provider([16, 8, 0])


@pytest.mark.parametrize("overrides, why", [
    (["data.split=100,0,0"], "data.split=100,0,0 gives validation no share"),
    (["trainer.eval_iters=0"], "trainer.eval_iters=0"),
])
def test_pretraining_without_validation_says_so_once(tmp_path, corpus, caplog, overrides, why):
    from rapidformer.observability.records import NO_EVALUATION
    from rapidformer.templates.pretrainer import PretrainState

    class Sink:
        records = []

        def write(self, step, record):
            self.records.append(record)

    trainer = provider_of("causal_lm", [*pretraining_args(corpus, "causal_lm", 1),
                                        "trainer.train_iters=2", "trainer.global_batch_size=8",
                                        *overrides], tmp_path)
    with caplog.at_level(logging.WARNING, logger="rapidformer"):
        _, valid, _ = trainer.train_valid_test_datasets_provider([16, 0, 0])
    assert valid is None
    assert [r.getMessage() for r in caplog.records] == [f"training without evaluation: {why}; "
                                                        f"give validation a share of data.split "
                                                        f"and trainer.eval_iters >= 1 to "
                                                        f"evaluate"]
    sink = Sink()
    for step in (1, 2):
        assert trainer._evaluate("validation", None, None, PretrainState(step=step), sink) == {}
    assert sink.records == [{NO_EVALUATION: caplog.records[0].getMessage()}]
