"""Pretraining runs through the real CLI: BERT (MLM + NSP) and GPT on generated mmap data, the
seed's white-box script, resume continuity, two processes, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (assert_ok, read_metrics, run_cli, run_here, run_in_process,
                            train_losses)

REPO = Path(__file__).resolve().parents[1]
QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false"]


def bert_args(data: dict) -> list[str]:
    return ["+recipe=bert_pretrain", "model=bert_tiny", f"data.path={data['bert']}",
            f"model.tokenizer={data['vocab']}", "data.max_seq_length=64", "data.num_workers=0",
            "trainer.micro_batch_size=16", "trainer.global_batch_size=32", "trainer.lr=2e-3",
            "trainer.log_interval=5", "trainer.eval_iters=2", *QUIET]


def gpt_args(data: dict) -> list[str]:
    return ["+recipe=gpt_pretrain", "model=gpt2_tiny", f"data.path={data['gpt']}",
            f"model.tokenizer={data['gpt2_vocab']}", f"model.merge_file={data['merges']}",
            "data.max_seq_length=64", "data.split=90,5,5", "data.num_workers=0",
            "trainer.micro_batch_size=4", "trainer.global_batch_size=16", "trainer.lr=3e-3",
            "trainer.log_interval=1", "trainer.eval_iters=2", *QUIET]


@pytest.mark.slow
def test_bert_pretraining_black_box(tmp_path, pretraining_data):
    from transformers import AutoModelForPreTraining, AutoTokenizer

    run = tmp_path / "run"
    assert_ok(run_cli([*bert_args(pretraining_data), "trainer.train_iters=60",
                       "trainer.eval_interval=30", f"trainer.output_dir={run}"], cwd=tmp_path))
    records = read_metrics(run)
    losses = train_losses(run)
    assert sorted(losses) == list(range(5, 61, 5))
    assert losses[60] < losses[5] - 0.7, losses  # masked LM + NSP learn the generated language
    valid = [r["validation/loss"] for r in records if "validation/loss" in r]
    assert len(valid) == 2 and valid[-1] < losses[5] - 0.5  # held-out sentences too
    assert all(0 <= r["data_wait_frac"] < 1 for r in records if "loss" in r)
    state = json.loads((run / "checkpoints" / "step_00000060" / "state.json").read_text())
    assert state["train_state"]["consumed_train_samples"] == 60 * 32
    model = AutoModelForPreTraining.from_pretrained(run / "hf_model")
    assert type(model).__name__ == "BertForPreTraining"
    # the export carries the tokenizer the data was made with
    words = pretraining_data["vocab"].read_text().split("\n")
    exported = AutoTokenizer.from_pretrained(run / "hf_model").get_vocab()
    assert exported == {w: i for i, w in enumerate(w for w in words if w)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_pretraining_resumes_with_the_same_next_samples(tmp_path, pretraining_data, kind,
                                                        capsys, monkeypatch):
    """In this process (the CLI's resume across processes: tests/test_preemption.py)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    build = gpt_args if kind == "gpt" else bert_args
    args = [*build(pretraining_data), "trainer.train_iters=16", "trainer.log_interval=1",
            "data.num_workers=1"]
    for extra in ([f"trainer.output_dir={straight}"],
                  ["trainer.exit_interval=8", f"trainer.output_dir={split}"],
                  ["trainer.resume=auto", f"trainer.output_dir={split}"]):
        code, printed = run_here([*args, *extra], capsys, monkeypatch, tmp_path)
        assert code == 0, printed[-3000:]
        if "trainer.exit_interval=8" in extra:
            assert sorted(train_losses(split)) == list(range(1, 9))
    first, second = train_losses(straight), train_losses(split)
    assert first[16] < first[1] - 0.5, first  # it learns
    for step in range(9, 17):
        assert second[step] == pytest.approx(first[step], rel=1e-5, abs=1e-6), step
    if kind == "gpt":  # 90,5,5: a test split, scored once at the end
        tests = [r for r in read_metrics(straight) if "test/loss" in r]
        assert len(tests) == 1 and tests[0]["test/ppl"] > 1


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(tmp_path, pretraining_data):
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*gpt_args(pretraining_data), "trainer.train_iters=6", "trainer.export_hf=false"]
    # the one-process reference in this process: the launcher's processes are the subject
    run_in_process([*args, f"trainer.output_dir={one}"], cwd=tmp_path)
    assert_ok(run_cli([*args, "launcher.nproc_per_node=2", f"trainer.output_dir={two}"],
                      cwd=tmp_path))
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step


@pytest.mark.slow
def test_seed_white_box_bert_pretrainer(tmp_path, pretraining_data):
    """The seed's MyBertPreTrainer, run with the seed's flags on a local 'pretrained' BERT."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizer

    model_dir = tmp_path / "tiny_bert"
    tokenizer = BertTokenizer(vocab=str(pretraining_data["vocab"]))
    BertForPreTraining(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=64)).save_pretrained(model_dir)
    run = tmp_path / "run"
    script = REPO / "examples" / "rapidformer_pretrain_huggingface_bert_trainer.py"
    assert_ok(run_cli([
        "--user-script", str(script), "--pretrained-model-name-or-path", str(model_dir),
        "--micro-batch-size", "16", "--global-batch-size", "32", "--seq-length", "64",
        "--tokenizer-type", "BertWordPieceLowerCase", "--train-iters", "10",
        "--data-path", pretraining_data["bert"], "--vocab-file", str(pretraining_data["vocab"]),
        "--data-impl", "mmap", "--split", "980,20", "--lr", "1e-3", "--lr-decay-style", "linear",
        "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction", ".01",
        "--log-interval", "5", "--save", str(run), *QUIET], cwd=tmp_path,
        module="rapidformer.cli.console"))
    assert sorted(train_losses(run)) == [5, 10]
    assert (run / "hf_model" / "config.json").is_file()


@pytest.mark.parametrize("change,message", [
    (lambda d: [f"data.path={d['dir']}/missing"], "missing.idx does not exist"),
    (lambda d: [f"model.tokenizer={d['dir']}/nothing.txt"], "needs --vocab-file"),
    (lambda d: ["data.impl=lazy"], "megatron-core reads only mmap"),
    (lambda d: [f"data.path={d['gpt']}"], "made with another vocabulary"),
])
def test_bad_pretraining_input_stops_with_one_message(tmp_path, pretraining_data, change, message,
                                                      capsys, monkeypatch):
    """In this process, as tests/test_bad_input.py's cases: the refusal is the subject."""
    from tests.test_bad_input import call

    monkeypatch.chdir(tmp_path)
    code, stderr = call("rapidformer", [*bert_args(pretraining_data), "trainer.train_iters=2",
                                        f"trainer.output_dir={tmp_path / 'run'}",
                                        *change(pretraining_data)], capsys)
    assert code == 2, stderr[-2000:]
    assert message in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_activation_recompute_gives_the_same_losses(tmp_path, pretraining_data, capsys,
                                                    monkeypatch):
    """Recompute replays each layer in the backward pass (with its dropout masks): the same
    losses as keeping the activations. In this process: the subject is the numerics, not the
    CLI's process."""
    args = [*gpt_args(pretraining_data), "trainer.train_iters=6", "trainer.export_hf=false",
            "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    plain, recompute = tmp_path / "plain", tmp_path / "recompute"
    printed = {}
    for run, extra in ((plain, []), (recompute, ["trainer.checkpoint_activations=true"])):
        code, printed[run] = run_here([*args, *extra, f"trainer.output_dir={run}"], capsys,
                                      monkeypatch, tmp_path)
        assert code == 0, printed[run][-3000:]
    assert "activation recompute: on" in printed[recompute]
    assert "activation recompute: on" not in printed[plain]
    a, b = train_losses(plain), train_losses(recompute)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
