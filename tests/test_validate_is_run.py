"""`rapidformer validate` says what the run's start says: on a table of configs, good ones and
bad ones of different kinds (the config, the hub, data and tokenizer files, pretraining data
against its tokenizer, model and task), validate's exit code and problems equal those of the
real run started in this process, and a run refuses before any work: no engine, no dataset
index, no run directory."""
from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest

from tests.conftest import FAST

# stop right after the start: one step, no evaluation of pretraining data, no export
SHORT = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.export_hf=false",
         "trainer.train_iters=1", "trainer.epochs=null", "data.num_workers=0"]
TINY_PAIRS = [o for o in FAST if "epochs" not in o]


def gpt(data, *more):
    return ["task=causal_lm", "model=gpt2_tiny", "data=megatron", f"data.path={data['gpt']}",
            "model.tokenizer_type=GPT2BPETokenizer", f"model.tokenizer={data['gpt2_vocab']}",
            f"model.merge_file={data['merges']}", "data.max_seq_length=64",
            "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.eval_iters=0",
            *more]


def bert(data, *more, prefix=None):
    return ["task=bert_pretraining", "model=bert_tiny", "data=megatron",
            f"data.path={prefix or data['bert']}", "model.tokenizer_type=BertWordPieceLowerCase",
            f"model.tokenizer={data['vocab']}", "data.max_seq_length=64",
            "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.eval_iters=0",
            *more]


def pairs(path, *more):
    return ["data=pairs_local", f"data.path={path}",
            *[o for o in TINY_PAIRS if "synthetic" not in o], *more]


def renamed(c, name: str, fmt: str) -> str:
    """A copy of the local pairs whose sentence1 column is called premise, as `fmt` files."""
    import pandas as pd

    out = c.tmp / name
    out.mkdir()
    for split in ("train", "validation"):
        rows = pd.read_json(c.pairs_dir / f"{split}.jsonl", lines=True).rename(
            columns={"sentence1": "premise"})
        if fmt == "csv":
            rows.to_csv(out / f"{split}.csv", index=False)
        elif fmt == "parquet":
            rows.to_parquet(out / f"{split}.parquet")
        else:
            rows.to_json(out / f"{split}.jsonl", orient="records", lines=True)
    return str(out)


def a_file(c) -> str:
    (c.tmp / "notes.txt").write_text("not a checkpoint\n")
    return str(c.tmp / "notes.txt")


# row -> (the command, from the test's inputs `c`; the first problem, None for a run that
# starts)
CASES = {
    # good
    "quickstart": (lambda c: [*TINY_PAIRS], None),
    "local pairs": (lambda c: pairs(c.pairs_dir), None),
    "gpt pretraining": (lambda c: gpt(c.data), None),
    "bert pretraining": (lambda c: bert(c.data), None),
    "bert on documents, no NSP": (lambda c: bert(c.data, "task.binary_head=false",
                                                 prefix=c.document_bert), None),
    # the config
    "bad value": (lambda c: [*TINY_PAIRS, "trainer.lr=-1"], "trainer.lr=-1"),
    "causal_lm on bert_tiny": (
        lambda c: [o for o in gpt(c.data) if o != "model=gpt2_tiny"],
        "task=causal_lm builds a GPT-2- or Llama-shaped model from the config; model.arch=bert "
        "is neither"),
    "bert_pretraining on gpt2_tiny": (lambda c: bert(c.data, "model=gpt2_tiny"),
                                      "task=bert_pretraining builds a BERT; model.arch=gpt2"),
    # the hub
    "hub model offline": (lambda c: [*TINY_PAIRS, "model=hf",
                                     "model.name_or_path=rapidformer-test/no-such-model"],
                          "cannot load the model 'rapidformer-test/no-such-model'"),
    "hub dataset offline": (lambda c: ["data=hub", "data.path=rapidformer-test/no-such-data",
                                       *[o for o in TINY_PAIRS if "synthetic" not in o]],
                            "cannot load the dataset 'rapidformer-test/no-such-data'"),
    # files
    "local data missing": (lambda c: pairs(c.tmp / "no-such-dir"), "data directory not found"),
    "local data without train file": (lambda c: pairs(c.empty), "no training file in"),
    "tokenizer missing": (lambda c: [*TINY_PAIRS, f"model.tokenizer={c.tmp / 'vocab.txt'}"],
                          "tokenizer not found"),
    "megatron prefix missing": (lambda c: gpt(c.data, f"data.path={c.tmp / 'corpus'}"),
                                "corpus.idx does not exist"),
    "vocab file missing": (lambda c: gpt(c.data, f"model.tokenizer={c.tmp / 'vocab.json'}"),
                           "vocab.json"),
    "merge file missing": (lambda c: gpt(c.data, f"model.merge_file={c.tmp / 'merges.txt'}"),
                           "merges.txt"),
    "user script missing": (lambda c: [*TINY_PAIRS, f"user_script={c.tmp / 'train.py'}"],
                            "no such file"),
    "resume from nowhere": (lambda c: [*TINY_PAIRS, f"trainer.resume={c.tmp / 'step_1'}"],
                            "no such checkpoint directory"),
    "resume from a file": (lambda c: [*TINY_PAIRS, f"trainer.resume={a_file(c)}"],
                           "is not a checkpoint: neither a step_NNNNNNNN directory"),
    "resume from a folder of no checkpoint": (
        lambda c: [*TINY_PAIRS, f"trainer.resume={c.empty}"],
        "is not a checkpoint: neither a step_NNNNNNNN directory"),
    # a column the task reads is missing, in each format (the run read the files to find out)
    "local jsonl without the text column": (
        lambda c: pairs(renamed(c, "jsonl_premise", "jsonl")),
        "the train split has no column 'sentence1' (data.text_a_column)"),
    "local csv without the text column": (
        lambda c: pairs(renamed(c, "csv_premise", "csv")),
        "the train split has no column 'sentence1' (data.text_a_column)"),
    "local parquet without the text column": (
        lambda c: pairs(renamed(c, "parquet_premise", "parquet")),
        "the train split has no column 'sentence1' (data.text_a_column)"),
    "local data, the column renamed by its key": (
        lambda c: pairs(renamed(c, "mapped", "csv"), "data.text_a_column=premise"), None),
    # what trainer.best_metric needs: an evaluation
    "best metric, no validation file": (
        lambda c: pairs(c.train_only, "trainer.best_metric=validation/accuracy"),
        "trainer.best_metric=validation/accuracy needs evaluations, but data.path="),
    "best metric, no evaluation": (
        lambda c: gpt(c.data, "trainer.best_metric=validation/loss"),
        "trainer.best_metric=validation/loss needs evaluations, but trainer.eval_iters=0"),
    # pretraining data against its tokenizer and task
    "another vocabulary": (lambda c: bert(c.data, f"data.path={c.data['gpt']}"),
                           "the data was made with another vocabulary"),
    "documents for NSP": (lambda c: bert(c.data, prefix=c.document_bert),
                          "has one sentence per document"),
    "no training documents": (lambda c: gpt(c.data, "data.split=0,1"),
                              "leaves no training documents"),
    "validation of no document": (lambda c: gpt(c.data, "data.split=9999,1",
                                                "trainer.eval_iters=1"),
                                  "which is not one whole document"),
}


def problems_of(stderr: str) -> list[str]:
    """The problems rapidformer reported on stderr, each as one text ([] for none)."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        said = re.match(r"rapidformer: (?:error: )?(.*)", line)
        if not said or said.group(1).startswith(("recipe:", "nothing was run", "note:",
                                                 "the Hugging Face hub")):
            continue
        text = said.group(1)
        if re.match(r"(invalid config|not available here) \(\d+ problems\):", text):
            return [item[4:] for item in lines[i + 1:] if item.startswith("  - ")]
        return [text.removeprefix("invalid config: ")]
    return []


def validate(argv, capsys) -> tuple[int, list[str]]:
    from rapidformer.cli.verbs import run_verb

    code = run_verb("validate", argv)
    captured = capsys.readouterr()
    assert (code == 0) == captured.out.startswith("ok: "), captured
    return code, problems_of(captured.err) if code else []


def start(argv, capsys) -> tuple[int, list[str]]:
    from rapidformer.cli.hydra_main import main

    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    return code, problems_of(err) if code else []


@pytest.fixture(scope="module")
def document_bert(pretraining_data, tmp_path_factory) -> str:
    """WordPiece data as Megatron's tool writes it without --split-sentences: one sequence per
    document, ended by Megatron's [EOS] (--append-eod)."""
    from rapidformer.data.preprocess_data import main as preprocess

    out = tmp_path_factory.mktemp("document_bert") / "bert"
    preprocess(["--input", str(pretraining_data["dir"] / "corpus.json"), "--output-prefix",
                str(out), "--vocab-file", str(pretraining_data["vocab"]), "--tokenizer-type",
                "BertWordPieceLowerCase", "--append-eod"])
    return f"{out}_text_document"


@pytest.mark.parametrize("row", CASES)
def test_validate_says_what_the_run_start_says(row, tmp_path, capsys, monkeypatch,
                                               pretraining_data, pairs_dir, document_bert):
    from rapidformer import engine
    from rapidformer.data import megatron

    command, first = CASES[row]
    inputs = SimpleNamespace(data=pretraining_data, pairs_dir=pairs_dir, tmp=tmp_path,
                             document_bert=document_bert, empty=tmp_path / "empty",
                             train_only=tmp_path / "train_only")
    inputs.empty.mkdir()
    inputs.train_only.mkdir()
    shutil.copy(pairs_dir / "train.jsonl", inputs.train_only)
    run = tmp_path / "run"
    argv = [*command(inputs), *SHORT, f"trainer.output_dir={run}"]

    verdict = validate(argv, capsys)
    assert not run.exists()  # validate writes nothing

    built = []
    original = megatron._build
    monkeypatch.setattr(megatron, "_build", lambda *a, **k: built.append(1) or original(*a, **k))
    engines = engine.ENGINES_CREATED
    started = start(argv, capsys)

    assert verdict == started, f"validate {verdict} but the run {started}"
    if first is None:
        assert started == (0, []), started
        assert engine.ENGINES_CREATED == engines + 1
        assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                       .splitlines()) if "loss" in r] == [1]
    else:
        code, problems = started
        assert code == 2 and problems and first in problems[0], started
        # refused before any work: no engine, no dataset index, no run directory left
        assert engine.ENGINES_CREATED == engines and not built and not run.exists()


@pytest.mark.parametrize("row", ["bad value", "causal_lm on bert_tiny",
                                 "bert_pretraining on gpt2_tiny", "best metric, no evaluation"])
def test_plan_and_a_dry_run_refuse_what_the_config_refuses(row, tmp_path, capsys,
                                                           pretraining_data):
    """`rapidformer plan` and trainer.dry_run=true settle through the same pass (its config
    part: a plan may be for another machine), so they refuse the config's problems alike."""
    from rapidformer.cli.verbs import run_verb

    command, first = CASES[row]
    argv = [*command(SimpleNamespace(data=pretraining_data)), *SHORT,
            f"trainer.output_dir={tmp_path / 'run'}"]
    planned = run_verb("plan", argv), problems_of(capsys.readouterr().err)
    assert planned == start([*argv, "trainer.dry_run=true"], capsys)
    assert planned[0] == 2 and first in planned[1][0], planned
    assert not (tmp_path / "run").exists()
