"""The seed's pretraining command lines: the model they build is named by the task (else the
tokenizer type) and the shape flags, as Megatron-LM's scripts build it; a line that cannot run
is refused before any work."""
from __future__ import annotations

import json

import pytest

from rapidformer.cli.console import translate
from tests.conftest import read_metrics

# the seed's Megatron GPT pretraining flags as a black-box line (issue 35), a tiny shape
GPT_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "128", "--max-position-embeddings", "128"]
RUN = ["--micro-batch-size", "4", "--global-batch-size", "8", "--data-impl", "mmap",
       "--split", "980,20", "--lr", "1e-3", "--lr-decay-style", "linear",
       "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction", ".01",
       "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
       "trainer.progress_bar=false", "trainer.tensorboard=false", "data.num_workers=0"]
# the seed's black-box BERT pretraining line (docs: `rapidformer --task pretraining ...`), its
# shape made tiny and its accelerator flags (ORT, FSDP with fp16: refused here) left out
BERT_SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
              "--seq-length", "64", "--max-position-embeddings", "64"]


def gpt_line(data: dict, *more: str) -> list[str]:
    return ["--task", "causal_lm", "--data-path", data["gpt"],
            "--vocab-file", str(data["gpt2_vocab"]), "--merge-file", str(data["merges"]),
            "--tokenizer-type", "GPT2BPETokenizer", *GPT_SHAPE, "--train-iters", "3", *RUN,
            *more]


def bert_line(prefix: str, vocab, *more: str) -> list[str]:
    return ["--task", "pretraining", *BERT_SHAPE, "--tokenizer-type", "BertWordPieceLowerCase",
            "--train-iters", "3", "--data-path", prefix, "--vocab-file", str(vocab),
            "--min-lr", "0.0", "--lr-decay-iters", "2000", *RUN, *more]


def seed_run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of `rapidformer ARGV`, in this process."""
    from rapidformer.cli.console import main

    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().err


def validate(argv: list[str], capsys) -> int:
    from rapidformer.cli.verbs import run_verb

    return run_verb("validate", argv)


def exported(run) -> dict:
    return json.loads((run / "hf_model" / "config.json").read_text())


# --- the translation -----------------------------------------------------------------------------
def test_the_model_follows_the_task_the_tokenizer_type_and_the_parallel_sizes():
    def model_of(argv):
        return [o for o in translate(argv)[1] if o.startswith(("model=", "model.intermediate"))]

    assert model_of(["--task", "causal_lm", *GPT_SHAPE]) == \
        ["model=gpt2_small", "model.intermediate_size=256"]
    assert model_of(["--task", "pretraining", *BERT_SHAPE]) == \
        ["model=bert_base", "model.intermediate_size=128"]
    assert model_of(["--task", "causal_lm", "--hidden-size", "64", "--ffn-hidden-size", "100"]) \
        == ["model=gpt2_small", "model.intermediate_size=100"]
    # the seed's white-box Megatron GPT line: its tokenizer type names the family, tensor and
    # pipeline parallelism a megatron-core model
    megatron_gpt = ["--user-script", "train.py", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--num-layers", "12",
                    "--hidden-size", "768", "--tokenizer-type", "GPT2BPETokenizer",
                    "--data-path", "corpus", "--data-impl", "mmap"]
    assert model_of(megatron_gpt) == ["model=megatron_gpt", "model.intermediate_size=3072"]
    assert model_of(["--task", "pretraining", "--tensor-model-parallel-size", "2"]) == \
        ["model=megatron_bert"]
    # a pretrained model keeps its own shape (the flags are checked against it), a fine-tuning
    # line its default model
    assert model_of(["--task", "pretraining", "--pretrained-model-name-or-path", "bert-base-uncased",
                     "--hidden-size", "768"]) == ["model=hf"]
    assert model_of(["--task", "sequence_classification", "--num-layers", "2"]) == []


# --- the lines run -----------------------------------------------------------------------------
def test_the_seed_gpt_line_trains_the_gpt_its_flags_describe(tmp_path, pretraining_data, capsys):
    run = tmp_path / "gpt"
    line = gpt_line(pretraining_data, "--save", str(run))
    assert validate(line, capsys) == 0  # the verbs read the seed's flags too
    assert "model=gpt2_small" in capsys.readouterr().out
    code, err = seed_run(line, capsys)
    assert code == 0, err[-3000:]
    config = exported(run)
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_layer"], config["n_embd"], config["n_head"], config["n_inner"],
            config["n_positions"]) == (2, 64, 4, 256, 128)
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]


@pytest.mark.parametrize("pretrained", [False, True])
def test_the_seed_bert_line_trains(tmp_path, pretraining_data, capsys, pretrained):
    """Built from the flags (bert_base's defaults, the flags' shape), or a local pretrained
    BERT of the same shape standing in for bert-base-uncased."""
    run = tmp_path / "bert"
    more = []
    if pretrained:
        from transformers import BertConfig, BertForPreTraining, BertTokenizer

        local = tmp_path / "bert-tiny-uncased"
        vocab = len(BertTokenizer(vocab=str(pretraining_data["vocab"])))
        BertForPreTraining(BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=128,
                                      max_position_embeddings=64)).save_pretrained(local)
        more = ["--pretrained-model-name-or-path", str(local)]
    code, err = seed_run(bert_line(pretraining_data["bert"], pretraining_data["vocab"], *more,
                                   "--save", str(run)), capsys)
    assert code == 0, err[-3000:]
    config = exported(run)
    assert config["architectures"] == ["BertForPreTraining"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["intermediate_size"], config["max_position_embeddings"]) == (2, 32, 2, 128, 64)
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]


@pytest.fixture
def no_work(monkeypatch):
    """Counts what a refused run must not have started: an engine, a dataset index."""
    from rapidformer import engine
    from rapidformer.data import megatron

    built = []
    original = megatron._build
    monkeypatch.setattr(megatron, "_build", lambda *a, **k: built.append(1) or original(*a, **k))
    before = engine.ENGINES_CREATED
    yield lambda: (engine.ENGINES_CREATED - before, len(built))


@pytest.mark.parametrize("change, message", [
    # a shape the model cannot have
    ({"--hidden-size": "66"}, "model.hidden_size=66 is not divisible by "
                              "model.num_attention_heads=4"),
    # BERT's masking needs WordPiece data
    ({"--task": "pretraining"}, "task=bert_pretraining masks WordPiece tokens"),
    # a switch of BERT's on a GPT line
    ({"--bert-no-binary-head": None}, "task.binary_head"),
    # the seed's accelerator flags as its BERT line has them
    ({"--onnx-runtime-training": None, "--fsdp-memory-optimization": None,
      "--mixed-precision": None}, "graph=ort with memory=fsdp"),
])
def test_a_seed_line_that_cannot_run_is_refused_before_any_work(tmp_path, pretraining_data,
                                                                capsys, no_work, change,
                                                                message):
    argv = gpt_line(pretraining_data, "--save", str(tmp_path / "run"))
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag] if value is None else [flag, value]
    assert validate(argv, capsys) == 2 and message in capsys.readouterr().err
    code, err = seed_run(argv, capsys)
    assert code == 2 and message in err, err[-3000:]
    assert no_work() == (0, 0)
    assert not (tmp_path / "run").exists()
