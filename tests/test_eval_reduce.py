"""Evaluation metrics are reduced over ranks: on 2 gloo ranks (started in-process, one launch
for every task) each rank reports the same numbers, and they equal one process's on the same
data and weights. The evaluation set (37 examples) splits unevenly over the ranks and into
batches of other sizes than one process's, so a mean of per-batch or per-rank means would
differ. Covered: the five fine-tuning tasks' run_compute_metrics and the PreTrainer's
evaluation (a white-box GPT-2 on random tokens)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, free_port

COMMON = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu",
          "trainer.micro_batch_size=8", "trainer.global_batch_size=null", "trainer.epochs=1",
          "data.synthetic_train_size=48", "data.synthetic_eval_size=37", "model=bert_tiny",
          "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
          "model.vocab_size=300"]
TASKS = {
    "sequence_classification": ["+recipe=quickstart", "data.max_seq_length=32"],
    "token_classification": ["+recipe=bert_ner", "data=synthetic", "data.max_seq_length=32"],
    "question_answering": ["+recipe=bert_squad", "data=synthetic", "data.max_seq_length=64",
                           "task.doc_stride=16"],
    "masked_lm": ["+recipe=bert_mlm", "data=synthetic", "data.max_seq_length=32"],
    "seq2seq_lm": ["+recipe=t5_summarize", "data=synthetic", "model=t5_tiny",
                   "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
                   "task.source_prefix=", "data.max_seq_length=32", "task.max_target_length=8"],
}
VOCAB, SEQ = 64, 16


def checksum(model) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def evaluate_task(name: str, overrides: list[str], run_dir: Path) -> tuple[dict, float]:
    """The task's validation metrics, and a checksum of the weights they were computed with
    (made from a fixed seed: one process and the ranks run at the same time)."""
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.engine import RapidformerEngine
    from rapidformer.tasks import task_class

    _, cfg = settle(compose([*COMMON, *overrides]), str(run_dir))
    engine = RapidformerEngine(cfg, run_dir)
    trainer = task_class(name)(engine=engine)
    with engine.main_process_first():  # rank 0 writes the generated data and tokenizer
        _, valid, _, collate = trainer.train_valid_test_datasets_provider()
    torch.manual_seed(0)
    model = trainer.model_optimizer_lr_scheduler_provider()[0]
    weights = checksum(model)
    model, _, _ = engine.compose(model, total_iters=1)
    return trainer.evaluate(model, trainer.build_data_loader(valid, collate_fn=collate)), weights


def evaluate_pretrainer(run_dir: Path, world: int) -> tuple[dict, float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.engine import RapidformerEngine
    from rapidformer.templates.pretrainer import PretrainState, PreTrainer

    class Recorded:
        def write(self, step, record):
            pass

    class Tiny(PreTrainer):
        def run_forward_step(self, data_iterator, model):
            ids = next(data_iterator)["input_ids"]
            return model(input_ids=ids, labels=ids).loss

    # 4 micro-batches of 2 per evaluation: 4 on one rank, 2 on each of two
    _, cfg = settle(compose(["trainer.device=cpu", "trainer.train_iters=1", "trainer.eval_iters=1",
                              "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
                              f"launcher.nproc_per_node={world}", f"user_script={__file__}"]),
                     str(run_dir))
    engine = RapidformerEngine(cfg, run_dir)
    trainer = Tiny(engine=engine)
    data = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    weights = checksum(model)
    model, _, _ = engine.compose(model, total_iters=1)
    valid = trainer.build_data_iterator([{"input_ids": row} for row in data])
    return trainer._evaluate("validation", model, valid, PretrainState(), Recorded()), weights


def evaluate_all(root: Path, world: int) -> dict:
    """Task -> (metrics, weights checksum)."""
    results = {name: evaluate_task(name, [f"launcher.nproc_per_node={world}", *overrides],
                                   root / f"run{world}" / name)
               for name, overrides in TASKS.items()}
    results["pretrainer"] = evaluate_pretrainer(root / f"run{world}" / "pretrainer", world)
    return results


def _worker(rank: int, world: int, port: int, root: str):
    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results = evaluate_all(Path(root), world)
    Path(root, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(one process's metrics, each of 2 ranks'), task by task."""
    root = tmp_path_factory.mktemp("eval_reduce")
    ranks = mp.start_processes(_worker, args=(2, free_port(), str(root)), nprocs=2,
                               join=False, start_method="spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes on CI's two cores: no thread team spinning
    try:
        single = json.loads(json.dumps(evaluate_all(root, 1)))  # meanwhile; as JSON, like theirs
    finally:
        torch.set_num_threads(threads)
    while not ranks.join():
        pass
    return single, [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("task", [*TASKS, "pretrainer"])
def test_every_rank_reports_the_one_process_metrics(evaluations, task):
    (single, weights), (rank0, weights0), (rank1, weights1) = \
        (evaluation[task] for evaluation in (evaluations[0], *evaluations[1]))
    assert weights0 == weights1 == weights  # the same model everywhere
    assert rank0 == rank1  # the same numbers on every rank, bit for bit
    assert sorted(rank0) == sorted(single) and single
    for metric, value in single.items():
        assert rank0[metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric
