"""BERT pretraining on document-level data, as Megatron's preprocess tool writes it without
--split-sentences (one sequence per document): next-sentence prediction has no pair to make,
so the run is refused naming task.binary_head (the seed's --bert-no-binary-head), and with
task.binary_head=false it trains masked LM alone: a Hugging Face BertForMaskedLM, or a
megatron-core BertModel without its pooler and binary head."""
from __future__ import annotations

import json

import pytest

from tests.conftest import read_metrics

KEY = "task.binary_head=false (the seed's --bert-no-binary-head)"


@pytest.fixture(scope="module")
def document_bert(pretraining_data, tmp_path_factory) -> str:
    """The generated corpus with a WordPiece vocabulary, one sequence per document, each ended
    by Megatron's [EOS] (--append-eod, no --split-sentences)."""
    from rapidformer.data.preprocess_data import main as preprocess

    out = tmp_path_factory.mktemp("document_bert") / "bert"
    preprocess(["--input", str(pretraining_data["dir"] / "corpus.json"), "--output-prefix",
                str(out), "--vocab-file", str(pretraining_data["vocab"]), "--tokenizer-type",
                "BertWordPieceLowerCase", "--append-eod"])
    return f"{out}_text_document"


def command(data, prefix, run, *more):
    return ["task=bert_pretraining", "model=bert_tiny", "data=megatron", f"data.path={prefix}",
            "model.tokenizer_type=BertWordPieceLowerCase", f"model.tokenizer={data['vocab']}",
            "data.max_seq_length=64", "trainer.train_iters=3", "trainer.micro_batch_size=4",
            "trainer.global_batch_size=8", "trainer.eval_iters=1", "trainer.log_interval=1",
            "trainer.progress_bar=false", "trainer.tensorboard=false", "data.num_workers=0",
            f"trainer.output_dir={run}", *more]


def start(argv, capsys) -> tuple[int, str]:
    from rapidformer.cli.hydra_main import main

    try:
        main(argv)
        return 0, capsys.readouterr().err
    except SystemExit as exc:
        return exc.code, capsys.readouterr().err


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if "loss" in r]


def test_the_seed_switch_is_the_key():
    from rapidformer.cli.console import translate

    assert "task.binary_head=false" in translate(["--task", "pretraining",
                                                  "--bert-no-binary-head"])[1]


def test_document_level_data_is_refused_with_nsp_and_trains_without(
        tmp_path, pretraining_data, document_bert, capsys, monkeypatch):
    from rapidformer import engine
    from rapidformer.cli.verbs import run_verb
    from rapidformer.data import megatron

    refused = command(pretraining_data, document_bert, tmp_path / "nsp")
    assert run_verb("validate", refused) == 2
    assert KEY in capsys.readouterr().err
    built = []
    monkeypatch.setattr(megatron, "_build", lambda *a, **k: built.append(a))
    engines = engine.ENGINES_CREATED
    code, err = start(refused, capsys)
    assert code == 2, err[-3000:]
    assert "has one sentence per document" in err and KEY in err, err[-3000:]
    # refused before any work: no engine, no dataset index, no run directory
    assert engine.ENGINES_CREATED == engines and not built
    assert not (tmp_path / "nsp").exists()
    monkeypatch.undo()

    run = tmp_path / "mlm"
    code, err = start(command(pretraining_data, document_bert, run, "task.binary_head=false"),
                      capsys)
    assert code == 0, err[-3000:]
    config = json.loads((run / "hf_model" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]  # no next-sentence head
    assert len(losses(run)) == 3 and all(0 < loss < 20 for loss in losses(run))


def test_megatron_bert_without_its_binary_head_trains_masked_lm(tmp_path, pretraining_data,
                                                                document_bert, capsys):
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    code, err = start(command(pretraining_data, document_bert, run, "model=megatron_bert_tiny",
                              "task.binary_head=false", "trainer.train_iters=2"), capsys)
    assert code == 0, err[-3000:]
    assert len(losses(run)) == 2 and all(0 < loss < 20 for loss in losses(run))
    # megatron-core's BertModel built without its pooler and binary head
    saved = FileSystemReader(str(run / "checkpoints" / "step_00000002" / "megatron")) \
        .read_metadata().state_dict_metadata
    assert "embedding.word_embeddings.weight" in saved
    assert not [key for key in saved if key.startswith(("binary_head", "pooler"))]


def test_the_key_is_bert_pretrainings_own():
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="task.binary_head=false has no effect"):
        compose(["task=causal_lm", "task.binary_head=false"])
