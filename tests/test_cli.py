"""The seed's flags: each maps to one Hydra override, and the seed's commands run."""
from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer.cli.console import SeedFlagError, hydra_command, translate
from tests.conftest import read_metrics, run_cli

# the seed's black-box fine-tuning example, verbatim
SEED_FINETUNE = ["--task", "sequence_classification",
                 "--pretrained-model-name-or-path", "bert-base-cased",
                 "--data-path", "glue", "--data-name", "mrpc", "--epochs", "3",
                 "--micro-batch-size", "16", "--global-batch-size", "64", "--lr", "2e-5",
                 "--lr-decay-style", "linear", "--lr-warmup-iters", "100",
                 "--weight-decay", "1e-2", "--clip-grad", "1.0", "--seed", "42",
                 "--mixed-precision", "--onnx-runtime-training", "--zero-1-memory-optimization"]


def test_seed_finetune_command_translates_flag_by_flag():
    flags, overrides, print_only = translate(SEED_FINETUNE)
    assert flags == [] and not print_only
    assert overrides == [
        "task=sequence_classification", "model=hf", "model.name_or_path=bert-base-cased",
        "data=glue_mrpc", "scheduler=linear", "precision=fp16", "graph=ort", "memory=zero1",
        "trainer.epochs=3", "trainer.micro_batch_size=16", "trainer.global_batch_size=64",
        "trainer.lr=2e-5", "trainer.weight_decay=1e-2", "trainer.clip_grad=1.0",
        "trainer.seed=42", "scheduler.warmup_iters=100"]


def test_print_hydra_gives_the_equivalent_command(tmp_path):
    result = run_cli([*SEED_FINETUNE, "--print-hydra"], cwd=tmp_path, module="rapidformer.cli.console")
    assert result.returncode == 0
    line = result.stdout.strip()
    assert line.startswith("python -m rapidformer task=sequence_classification model=hf")
    assert "memory=zero1" in line and "graph=ort" in line
    assert hydra_command(["--cfg", "job"], ["a=1"]) == "python -m rapidformer a=1 --cfg job"


def test_local_paths_hub_names_and_mixed_overrides(tmp_path):
    _, overrides, _ = translate(["--data-path", str(tmp_path), "trainer.log_interval=5",
                                 "--vocab-file", "v.txt", "--tokenizer-type", "BertWordPieceCase"])
    assert overrides == ["data=pairs_local", f"data.path={tmp_path}",
                         "model.tokenizer_type=BertWordPieceCase", "model.lowercase=false",
                         "model.tokenizer=v.txt", "trainer.log_interval=5"]
    _, hub, _ = translate(["--dataset-path", "glue", "--dataset-name", "qqp"])
    assert hub == ["data=hub", "data.path=glue", "data.subset=qqp"]


def test_seed_pretraining_command_translates():
    """The seed's black-box BERT pretraining line (its data and vocab names are placeholders)."""
    _, overrides, _ = translate([
        "--task", "pretraining", "--pretrained-model-name-or-path", "bert-base-uncased",
        "--num-layers", "12", "--micro-batch-size", "16", "--global-batch-size", "128",
        "--seq-length", "512", "--tokenizer-type", "BertWordPieceLowerCase", "--train-iters", "100",
        "--data-path", "book_wiki_owtv2_small_text_sentence", "--vocab-file", "vocab.txt",
        "--data-impl", "mmap", "--split", "980,20", "--min-lr", "0.0", "--lr-decay-iters", "2000",
        "--lr-warmup-fraction", ".01", "--merge-file", "m.txt", "--mmap-warmup"])
    for expected in ("task=bert_pretraining", "data=megatron",
                     "data.path=book_wiki_owtv2_small_text_sentence", "data.impl=mmap",
                     "data.split=980,20", "model.tokenizer_type=BertWordPieceLowerCase",
                     "model.tokenizer=vocab.txt", "model.merge_file=m.txt",
                     "scheduler.decay_iters=2000", "trainer.train_iters=100",
                     "data.mmap_warmup=true", "data.max_seq_length=512"):
        assert expected in overrides, expected
    _, recompute, _ = translate(["--checkpoint-activations", "--lr", "1e-4"])
    assert recompute == ["trainer.checkpoint_activations=true", "trainer.lr=1e-4"]
    _, megatron, _ = translate(["--sequence-parallel", "--use-distributed-optimizer"])
    assert megatron == ["parallelism.sequence_parallel=true", "memory=zero1"]
    _, gpt, _ = translate(["--task", "casual_lm"])
    assert gpt == ["task=causal_lm", "model=gpt2_small"]  # a GPT, shaped by the flags
    for task in ("token_classification", "question_answering", "masked_lm", "seq2seq_lm"):
        _, overrides, _ = translate(["--task", task, "--data-path", str(Path(__file__).parent)])
        assert overrides == [f"task={task}", "data=local", f"data.path={Path(__file__).parent}"]


@pytest.mark.parametrize("argv,message,code", [
    (["--micro-bach-size", "16"], "--micro-bach-size (did you mean --micro-batch-size?)", 2),
    (["--task", "sequence_clasification"], "unknown task", 2),
    (["--tokenizer-type", "GPT2Tokenizer"], "--tokenizer-type GPT2Tokenizer: unknown", 2),
    (["--zero-1-memory-optimization", "--fsdp-memory-optimization"],
     "conflicting flags: memory=fsdp and memory=zero1", 2),
])
def test_bad_or_unbuilt_flags_are_refused(argv, message, code):
    with pytest.raises(SeedFlagError) as info:
        translate(argv)
    assert message in str(info.value) and info.value.exit_code == code


def test_seed_command_with_incompatible_accelerators_stops_clearly(tmp_path):
    """The seed's example asks for ONNX Runtime with fp16 and ZeRO-1 at once: each clash is
    named before any work."""
    result = run_cli(SEED_FINETUNE, cwd=tmp_path, module="rapidformer.cli.console")
    assert result.returncode == 2
    assert "graph=ort with memory=zero1" in result.stderr
    assert "graph=ort with precision=fp16" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_seed_finetune_command_runs_on_local_model_and_data(tmp_path, pairs_dir, tiny_pretrained):
    """The seed's black-box example with a local model and local data for the hub names, and
    without the accelerators that are not built yet (ORT, ZeRO)."""
    argv = list(SEED_FINETUNE[:-2])
    argv[argv.index("bert-base-cased")] = str(tiny_pretrained)
    argv[argv.index("glue")] = str(pairs_dir)
    argv[argv.index("--epochs") + 1] = "1"
    argv[argv.index("--global-batch-size") + 1] = "32"
    argv[argv.index("--lr") + 1] = "1e-3"
    run = tmp_path / "run"
    result = run_cli([*argv, "--seq-length", "64", "--log-interval", "1", "--save", str(run),
                      "trainer.progress_bar=false"], cwd=tmp_path, module="rapidformer.cli.console")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert all("loss_scale" in r for r in records if "loss" in r)  # --mixed-precision: fp16
    assert any("validation/accuracy" in r for r in records)
