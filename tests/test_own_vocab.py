"""`rapidformer-train-vocab`: a WordPiece or GPT-2 BPE vocabulary trained on one's own text, the
same bytes on every run, refused input that writes nothing, and the whole way from one's own
files to a pretraining run with nothing downloaded (train-vocab -> rapidformer-preprocess-data
-> +recipe=bert_pretrain / gpt_pretrain)."""
from __future__ import annotations

import json
import math

import pytest

from rapidformer.data.corpus import iter_documents
from rapidformer.data.train_vocab import main as train_vocab

from tests.conftest import read_metrics


def vocab(argv: list[str]) -> int:
    """train-vocab's exit code (0 when it returns)."""
    try:
        train_vocab(argv)
    except SystemExit as exc:
        return exc.code
    return 0


@pytest.fixture(scope="module")
def own_text(tmp_path_factory):
    """One's own corpus in two shapes: plain text files (a document a line) and JSON lines."""
    root = tmp_path_factory.mktemp("own_text")
    docs = list(iter_documents(400, seed=11))
    (root / "texts").mkdir()
    (root / "texts" / "a.txt").write_text("\n".join(docs[:100]) + "\n", encoding="utf-8")
    (root / "texts" / "b.txt").write_text("\n\n".join(docs[100:200]) + "\n", encoding="utf-8")
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs[200:]):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    return root


@pytest.mark.parametrize("kind, names, extra", [
    ("wordpiece", ["vocab.txt"], ["--lowercase"]),
    ("gpt2-bpe", ["vocab.json", "merges.txt"], []),
])
def test_the_same_files_give_the_same_vocabulary(own_text, tmp_path, kind, names, extra):
    # tokenizers' WordPiece trainer alone numbers its alphabet in hash-map order: three runs in
    # one process gave three vocabularies before train_vocab fixed the order
    made = []
    for run in range(3):
        out = tmp_path / f"run{run}"
        assert vocab(["--input", str(own_text / "texts" / "*.txt"), str(own_text / "corpus.jsonl"),
                      "--type", kind, "--vocab-size", "600", "--output-dir", str(out),
                      *extra]) == 0
        made.append([(out / name).read_bytes() for name in names])
        assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary folder
    assert made[0] == made[1] == made[2]
    if kind == "wordpiece":
        lines = made[0][0].decode().splitlines()
        assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        assert "the" in lines and len(lines) == len(set(lines))
    else:
        table = json.loads(made[0][0])
        assert "<|endoftext|>" in table and len(table) <= 600


def _bad_utf8(root):
    (root / "bad.txt").write_bytes(b"good line\nsecond \xff line\n")
    return ["--input", "bad.txt"], "bad.txt line 2, byte column 8: byte 0xff is not valid UTF-8"


def _array_line(root):
    (root / "rows.jsonl").write_text('{"text": "a b c"}\n\n[1, 2]\n', encoding="utf-8")
    return ["--input", "rows.jsonl"], "rows.jsonl line 3: an array, not a JSON object"


def _missing_key(root):
    (root / "rows.jsonl").write_text('{"body": "a b c"}\n', encoding="utf-8")
    return ["--input", "rows.jsonl"], "rows.jsonl line 1: no key 'text' (its keys: body)"


def _missing(root):
    return ["--input", "nope.txt"], "--input nope.txt: no such file"


def _no_match(root):
    return ["--input", "texts/*.md"], "--input texts/*.md: no file matches the pattern"


def _empty(root):
    (root / "blank.txt").write_text("\n   \n\n", encoding="utf-8")
    return ["--input", "blank.txt"], "blank.txt: no text to train on: no non-blank line"


def _empty_texts(root):
    (root / "rows.jsonl").write_text('{"text": ""}\n{"text": " "}\n', encoding="utf-8")
    return ["--input", "rows.jsonl"], "no text to train on (the JSON lines' 'text' fields): " \
                                      "2 texts, all blank"


def _existing_output(root):
    (root / "out").mkdir()
    (root / "out" / "vocab.txt").write_text("[PAD]\n", encoding="utf-8")
    (root / "a.txt").write_text("some text of mine\n", encoding="utf-8")
    return ["--input", "a.txt"], "--output-dir out holds a vocabulary already (out/vocab.txt)"


def _output_is_input(root):
    (root / "out").mkdir()
    (root / "out" / "vocab.txt").write_text("my own notes, not a vocabulary\n", encoding="utf-8")
    return ["--input", "out/vocab.txt", "--overwrite"], \
        "--input out/vocab.txt is also an output of this run"


def _output_is_input_by_link(root):
    (root / "out").mkdir()
    (root / "notes.txt").write_text("my own notes\n", encoding="utf-8")
    (root / "out" / "vocab.txt").symlink_to(root / "notes.txt")
    return ["--input", "notes.txt", "--overwrite"], "through a symbolic link"


@pytest.mark.parametrize("case", [_bad_utf8, _array_line, _missing_key, _missing, _no_match,
                                  _empty, _empty_texts, _existing_output, _output_is_input,
                                  _output_is_input_by_link])
def test_refused_input_exits_2_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    args, message = case(tmp_path)
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    assert vocab([*args, "--type", "wordpiece", "--output-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    after = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    assert after == before  # no output directory made, no file touched


def test_overwrite_replaces_a_vocabulary(own_text, tmp_path, capsys):
    out = tmp_path / "wp"
    args = ["--input", str(own_text / "corpus.jsonl"), "--type", "wordpiece", "--output-dir",
            str(out)]
    assert vocab([*args, "--vocab-size", "200"]) == 0
    small = (out / "vocab.txt").read_text().splitlines()
    assert vocab([*args, "--vocab-size", "400", "--overwrite"]) == 0
    assert len((out / "vocab.txt").read_text().splitlines()) > len(small)
    # Case: no --lowercase keeps capitals (BertWordPieceCase)
    assert "The" in (out / "vocab.txt").read_text().splitlines()
    assert "--tokenizer-type BertWordPieceCase" in capsys.readouterr().out


def _trained(run_dir) -> list[float]:
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    return losses


@pytest.mark.parametrize("kind, extra, tokenizer_type, recipe, model, level", [
    ("wordpiece", ["--lowercase"], "BertWordPieceLowerCase", "bert_pretrain", "bert_tiny",
     "sentence"),
    ("gpt2-bpe", [], "GPT2BPETokenizer", "gpt_pretrain", "gpt2_tiny", "document"),
])
def test_own_text_to_a_pretraining_run(own_text, tmp_path, monkeypatch, capsys, kind, extra,
                                       tokenizer_type, recipe, model, level):
    from rapidformer import __main__ as module_main
    from rapidformer.data.preprocess_data import main as preprocess

    monkeypatch.chdir(tmp_path)
    assert vocab(["--input", str(own_text / "texts" / "*.txt"), str(own_text / "corpus.jsonl"),
                  "--type", kind, "--vocab-size", "500", "--output-dir", "vocab", *extra]) == 0
    # the options it prints are the ones preprocess_data takes, as printed
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.startswith("for rapidformer-preprocess-data: --vocab-file vocab/")
    options = printed.split(": ", 1)[1].split()
    assert options[-2:] == ["--tokenizer-type", tokenizer_type]
    split = ["--split-sentences"] if level == "sentence" else ["--append-eod"]
    preprocess(["--input", str(own_text / "corpus.jsonl"), "--output-prefix", "data/own",
                *options, *split, "--workers", "1"])
    files = dict(zip(options[0::2], options[1::2]))
    run = tmp_path / "run"
    argv = [f"+recipe={recipe}", f"data.path=data/own_text_{level}",
            f"model.tokenizer={files['--vocab-file']}", f"model={model}",
            "data.max_seq_length=64", "trainer.micro_batch_size=8",
            "trainer.global_batch_size=8", "trainer.train_iters=24", "trainer.log_interval=4",
            "trainer.lr=2e-3", "scheduler.warmup_fraction=0", "data.num_workers=0",
            "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.export_hf=false", f"trainer.output_dir={run}"]
    if "--merge-file" in files:
        argv.append(f"model.merge_file={files['--merge-file']}")
    try:
        module_main.main(argv)
    except SystemExit as exc:
        pytest.fail(f"the pretraining run exited {exc.code}: {capsys.readouterr().err[-2000:]}")
    losses = _trained(run)
    assert losses[-1] < losses[0] - 0.5, losses  # it learns one's own text


@pytest.mark.parametrize("inputs, says_json_lines", [
    (["texts/a.txt"], True), (["corpus.jsonl"], False), (["corpus.jsonl", "texts/*.txt"], True)])
def test_plain_text_input_is_told_that_preprocessing_reads_json_lines(own_text, tmp_path, capsys,
                                                                     inputs, says_json_lines):
    code = vocab(["--input", *[str(own_text / i) for i in inputs], "--type", "wordpiece",
                  "--vocab-size", "300", "--output-dir", str(tmp_path / "v")])
    out = capsys.readouterr().out
    assert code == 0 and "for rapidformer-preprocess-data: --vocab-file" in out
    assert ("rapidformer-preprocess-data reads JSON lines" in out) == says_json_lines
