"""Trust in the data readers: the rows a local file is read as account for its lines, every
refusal names the file and the line (counted from 1) and says what is wrong with a split's file,
and the libraries' own error lines stay out of the one message.

Each table row is a variation of one class of fault; every one of them failed on release 0.1
(loaded silently with rows swallowed or split, named the wrong line or none, or let the library's
log line through). The last tests are the guards: what must still load, as it did.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rapidformer.config.schema import DataConfig
from rapidformer.data.text_classification import load_classification_data, load_splits
from rapidformer.errors import InputError

PAIRS = "sentence1,sentence2,label\n"
PAIRS_TSV = "sentence1\tsentence2\tlabel\n"


def rows(n: int, sep: str = ",", start: int = 0) -> str:
    return "".join(f"a cat sat {i}{sep}a dog ran {i}{sep}{i % 2}\n"
                   for i in range(start, start + n))


def write(folder: Path, files: dict) -> Path:
    for name, text in files.items():
        (folder / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return folder


def config(folder: Path, **data) -> DataConfig:
    return DataConfig(source="local", path=str(folder), **data)


def jsonl(*objects) -> str:
    return "".join(json.dumps(o) + "\n" for o in objects)


PAIR = {"sentence1": "a cat", "sentence2": "a dog", "label": 1}


# --- 1. a tsv is unquoted: every line is a row, `"` is text ----------------------------------
# (file text, the row to look at, the sentence1 it must hold, the rows the file holds)
MRPC_RUNAWAY = (PAIRS_TSV + rows(3, "\t") + '"Quoted start of a sentence .\tb\t1\n'
                + rows(54, "\t", 10) + 'it ends with a quote . "\tb\t0\n' + rows(37, "\t", 70))
UNQUOTED_TSV = [
    ("a quote opens in sentence1 and closes 55 lines later (the issue's file)", MRPC_RUNAWAY, 3,
     '"Quoted start of a sentence .', 96),
    ("a quote that never closes", PAIRS_TSV + rows(2, "\t") + '"never closed\tb\t1\n'
     + rows(4, "\t", 5), 2, '"never closed', 7),
    ("a field quoted whole", PAIRS_TSV + '"the whole field"\tb\t1\n' + rows(2, "\t"), 0,
     '"the whole field"', 3),
    ("an empty pair of quotes", PAIRS_TSV + rows(1, "\t") + '""\tb\t0\n', 1, '""', 2),
    ("a lone quote as the field", PAIRS_TSV + '"\tb\t1\n' + rows(3, "\t") + '"\tc\t0\n', 4,
     '"', 5),
    ("quotes and CRLF line ends", (PAIRS_TSV + '"He said\tb\t1\n' + rows(3, "\t")
                                   + 'so "\tb\t0\n').replace("\n", "\r\n"), 4, 'so "', 5),
    ("a doubled quote inside a quoted field", PAIRS_TSV + '"say ""hi"""\tb\t1\n' + rows(1, "\t"),
     0, '"say ""hi"""', 2),
    ("quotes and old Mac line ends (CR only)", (PAIRS_TSV + '"q\tb\t1\n' + rows(3, "\t")
                                               + 'r "\tc\t0\n').replace("\n", "\r"), 4, 'r "', 5),
]


@pytest.mark.parametrize("text, row, sentence, count", [c[1:] for c in UNQUOTED_TSV],
                         ids=[c[0] for c in UNQUOTED_TSV])
def test_a_tsv_reads_every_line_as_a_row_and_quotes_as_text(tmp_path, text, row, sentence, count):
    write(tmp_path, {"train.tsv": text})
    train = load_splits(config(tmp_path), tmp_path)["train"]
    assert len(train) == count
    assert train[row]["sentence1"] == sentence
    assert not any("\n" in s or "\t" in s for s in train["sentence1"])


# --- 1. rows that do not account for the lines are refused, at the line ------------------------
# (files, data.* settings, the message's fragment)
RUNAWAY = [
    ("csv: a quote swallowing 10 rows and closing before a comma",
     {"train.csv": PAIRS + rows(3) + '"open quote,b,1\n' + rows(10, start=3) + 'ends",b,0\n'},
     {}, "train.csv line 5: a quote opens a field there and runs on to line 16, so lines 5-16 "
         "would be read as one field, but each of them reads as a row of its own (3 fields)"),
    ("csv: a quote swallowing one row",
     {"train.csv": PAIRS + rows(3) + '"open,b,1\nok,y,0\nok2",z,1\n' + rows(3, start=3)},
     {}, "train.csv line 5: a quote opens a field there and runs on to line 7"),
    ("csv: a quote swallowing the next line only",
     {"train.csv": PAIRS + rows(3) + '"open,b,1\nok2",z,1\n' + rows(3, start=3)},
     {}, "train.csv line 5: a quote opens a field there and runs on to line 6"),
    ("csv: closed by the next quoted field's quote",
     {"train.csv": PAIRS + rows(3) + '"open,b,1\n' + rows(5, start=3) + 'x,"quoted" y,1\n'},
     {}, "train.csv line 5: a quote opens a field there and is closed only on line 11, by a "
         "quote followed by more text ('quoted\" y')"),
    ("csv: a quote that never closes",
     {"train.csv": PAIRS + rows(3) + '"open,b,1\n' + rows(5, start=3)},
     {}, "train.csv line 5: a quote opens a field there and never closes (the file ends inside "
         "it)"),
    ("csv: a quote in the second column, leaving a row too wide",
     {"train.csv": PAIRS + rows(3) + 'x,"open,1\n' + rows(5, start=3) + 'end",b,0\n'},
     {}, "train.csv line 5: a quote opens a field there and runs on to line 11, leaving a row "
         "of 4 fields where the header (line 1) has 3"),
    ("csv: a validation file, after blank lines",
     {"train.csv": PAIRS + rows(4), "validation.csv": PAIRS + "\n\n" + '"open,b,1\n'
      + rows(6) + 'ends",b,0\n'},
     {}, "validation.csv line 4: a quote opens a field there and runs on to line 11"),
    ("csv: the rows it swallows hold quoted fields and a blank line",
     {"train.csv": PAIRS + rows(5) + '"open,b,1\n"x, y",b,1\n\n"p, q",c,0\nend",b,0\n'},
     {}, "train.csv line 7: a quote opens a field there and is closed only on line 8"),
    ("csv: text and string labels, 30 rows before the quote",
     {"train.csv": "text,label\n" + "".join(f"row {i},{'pos' if i % 2 else 'neg'}\n"
                                            for i in range(30))
      + '"open,pos\nswallowed a,neg\nswallowed b,pos\nend",neg\n' + "row 9,pos\n"},
     {}, "train.csv line 32: a quote opens a field there and runs on to line 35"),
    ("quoted tsv (data.quoting=csv): the issue's file",
     {"train.tsv": MRPC_RUNAWAY}, {"quoting": "csv"},
     "train.tsv line 5: a quote opens a field there and runs on to line 60"),
    ("quoted tsv: a quote that never closes",
     {"train.tsv": PAIRS_TSV + rows(2, "\t") + '"open\tb\t1\n' + rows(3, "\t", 2)},
     {"quoting": "csv"}, "train.tsv line 4: a quote opens a field there and never closes"),
]


@pytest.mark.parametrize("files, data, message", [c[1:] for c in RUNAWAY],
                         ids=[c[0] for c in RUNAWAY])
def test_a_runaway_quote_is_refused_where_it_opens(tmp_path, files, data, message):
    write(tmp_path, files)
    with pytest.raises(InputError) as info:
        load_splits(config(tmp_path, **data), tmp_path)
    assert message in str(info.value)
    assert str(tmp_path) in str(info.value)
    assert "data.quoting=none" in str(info.value)  # the way to read its quotes as text


FIELDS = [
    ("csv: an extra field on the first row (pandas made column 1 the index)",
     {"train.csv": PAIRS + "a,b,c,1\n" + rows(3)}, {},
     "train.csv line 2 has 4 comma-separated fields, the header (line 1) has 3; a field that "
     "holds a comma must be quoted"),
    ("csv: an extra field further down",
     {"train.csv": PAIRS + rows(3) + "a,b,c,1\n"}, {},
     "train.csv line 5 has 4 comma-separated fields, the header (line 1) has 3"),
    ("csv: a field missing (read as empty)",
     {"train.csv": PAIRS + rows(3) + "a,1\n"}, {},
     "train.csv line 5 has 2 comma-separated fields, the header (line 1) has 3"),
    ("tsv: a row broken over two lines",
     {"train.tsv": PAIRS_TSV + rows(2, "\t") + "first half\n\tb\t1\n"}, {},
     "train.tsv line 4 has 1 tab-separated fields, the header (line 1) has 3"),
    ("tsv: a quoted field holding a tab, read unquoted",
     {"train.tsv": PAIRS_TSV + rows(2, "\t") + '"has\ttab"\tc\t0\n'}, {},
     "train.tsv line 4 has 4 tab-separated fields, the header (line 1) has 3; if this file "
     "quotes its fields (a field in \"...\" holding tabs or line breaks), read it with "
     "data.quoting=csv"),
    ("tsv: a quoted field over two lines, read unquoted",
     {"train.tsv": PAIRS_TSV + rows(2, "\t") + '"two\nlines"\tb\t1\n'}, {},
     "train.tsv line 4 has 1 tab-separated fields, the header (line 1) has 3; if this file "
     "quotes its fields"),
]


@pytest.mark.parametrize("files, data, message", [c[1:] for c in FIELDS],
                         ids=[c[0] for c in FIELDS])
def test_a_row_of_another_width_than_the_header_is_refused(tmp_path, files, data, message):
    write(tmp_path, files)
    with pytest.raises(InputError) as info:
        load_splits(config(tmp_path, **data), tmp_path)
    assert message in str(info.value)


JSON_LINES = [
    ("an object over two lines",
     {"train.jsonl": jsonl(PAIR) + '{"sentence1": "a",\n "sentence2": "b", "label": 0}\n'},
     "train.jsonl line 2 starts a JSON object that ends on line 3; a .jsonl file holds one JSON "
     "object per line"),
    ("two objects on one line",
     {"train.jsonl": jsonl(PAIR) + json.dumps(PAIR) + " " + json.dumps(PAIR) + "\n"},
     "train.jsonl line 2 holds more than one JSON value (the second starts at column 58)"),
    ("one JSON array in a .jsonl file",
     {"train.jsonl": "[" + json.dumps(PAIR) + ",\n" + json.dumps(PAIR) + "]\n"},
     "train.jsonl line 1 starts a JSON array that ends on line 2"),
    ("an array cut into lines, its commas left",
     {"train.jsonl": json.dumps(PAIR) + ",\n" + json.dumps(PAIR) + "\n"},
     "train.jsonl line 1 has ',' after its object"),
    ("a line that is a string",
     {"train.jsonl": jsonl(PAIR) + '"a cat"\n' + jsonl(PAIR)},
     "train.jsonl line 2 holds a string, not a JSON object"),
    ("a line that is an array, after a blank line",
     {"train.jsonl": jsonl(PAIR) + "\n" + json.dumps(list(PAIR.values())) + "\n"},
     "train.jsonl line 3 holds an array, not a JSON object"),
    ("a key given twice",
     {"train.jsonl": jsonl(PAIR) + '{"sentence1": "a", "sentence1": "b", "label": 1}\n'},
     "train.jsonl line 2 gives the key 'sentence1' twice in one object"),
    ("a .json file of pretty-printed objects",
     {"train.json": jsonl(PAIR) + json.dumps(PAIR, indent=1) + "\n"},
     "train.json line 2 starts a JSON object that ends on line 6"),
    ("a validation .jsonl with an object cut short",
     {"train.jsonl": jsonl(PAIR, PAIR), "validation.jsonl": jsonl(PAIR) + '{"sentence1": "a"\n'},
     "validation.jsonl line 2 starts a JSON object that does not end on it"),
]


@pytest.mark.parametrize("files, message", [c[1:] for c in JSON_LINES],
                         ids=[c[0] for c in JSON_LINES])
def test_a_json_line_that_is_not_one_row_is_refused_with_its_line(tmp_path, files, message):
    write(tmp_path, files)
    with pytest.raises(InputError) as info:
        load_splits(config(tmp_path), tmp_path)
    assert message in str(info.value)


def test_rows_the_builder_reads_otherwise_than_the_lines_are_refused(tmp_path, monkeypatch):
    """The last guard: the builder's rows are counted against the lines' (here it drops one)."""
    import datasets

    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: (lambda ds: ds.select(range(len(ds) - 1)))(real(*a, **k)))
    write(tmp_path, {"train.csv": PAIRS + rows(5)})
    with pytest.raises(InputError, match=r"train\.csv line 6: the file's lines hold 5 rows, but "
                                         r"it was read as 4"):
        load_splits(config(tmp_path), tmp_path)


# --- 1. later errors count lines as the reader does ---------------------------------------------
LINES = [
    ("tsv: a quote in an earlier row", {"train.tsv": PAIRS_TSV + '"quoted\tb\t1\n' + rows(3, "\t")
                                        + "x\ty\t0.5\n"}, "train.tsv line 6 has the label 0.5"),
    ("tsv: a bad label on a line that a quote would swallow",
     {"train.tsv": PAIRS_TSV + '"q\tb\t1\n\nr\tb\t\ns "\tc\t0\n'},
     "train.tsv line 4 has an empty label"),
]


@pytest.mark.parametrize("files, message", [c[1:] for c in LINES], ids=[c[0] for c in LINES])
def test_a_bad_label_after_quotes_names_its_line(tmp_path, files, message):
    write(tmp_path, files)
    with pytest.raises(InputError) as info:
        load_classification_data(config(tmp_path), tmp_path, None)
    assert message in str(info.value)


# --- 2. sft rows: the file and its line, from 1 -------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "where does anna live ?"},
                     {"role": "assistant", "content": "paris"}]}


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from rapidformer.data.tokenizers import train_wordpiece
    from rapidformer.tasks.sft import ready_for_chat

    tok = train_wordpiece(["where does anna live paris ? < | > : ."],
                          tmp_path_factory.mktemp("tok"), 120, True, 64)
    ready_for_chat(tok, "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                        "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return tok


def encode(splits, d, tokenizer, split="train"):
    from rapidformer.data.chat import EncodeCounts, encode_rows

    return encode_rows(splits[split], tokenizer, d, "response", split, EncodeCounts())


def texts(splits, d, tokenizer):
    from rapidformer.data.tokenizers import training_texts

    return list(training_texts("sft", d, splits["train"]))


def prompts(splits, d, tokenizer):
    from rapidformer.data.chat import generation_prompts

    return generation_prompts(splits["validation"], tokenizer, d, 4)


SFT = [
    ("encoding: a conversation that is no list, on line 4", encode,
     {"train.jsonl": jsonl(CHAT, CHAT, CHAT, {"messages": "hello"})},
     "train.jsonl line 4: messages must be a non-empty list"),
    ("encoding: a role that is none, after a blank line", encode,
     {"train.jsonl": jsonl(CHAT) + "\n" + jsonl({"messages": [{"role": "bot", "content": "x"}]})},
     "train.jsonl line 3: message 1 must be {\"role\": one of"),
    ("encoding: a prompt that is a number, in a csv", encode,
     {"train.csv": "prompt,response\n\n1,paris\n3,paris\n"},
     "train.csv line 3: data.prompt_column holds int, not text"),
    ("the vocabulary's texts: the third row", texts,
     {"train.jsonl": jsonl(CHAT, CHAT, {"messages": []})},
     "train.jsonl line 3: messages must be a non-empty list"),
    ("the generation prompts: a validation row", prompts,
     {"train.jsonl": jsonl(CHAT),
      "validation.jsonl": jsonl(CHAT, {"messages": [{"role": "user"}]})},
     "validation.jsonl line 2: message 1 must be"),
]


@pytest.mark.parametrize("step, files, message", [c[1:] for c in SFT], ids=[c[0] for c in SFT])
def test_sft_rows_are_named_by_file_and_line(tmp_path, chat_tokenizer, step, files, message):
    write(tmp_path, files)
    d = config(tmp_path)
    splits = load_splits(d, tmp_path)
    with pytest.raises(InputError) as info:
        step(splits, d, chat_tokenizer)
    assert str(info.value).startswith(str(tmp_path))
    assert message in str(info.value)


# --- 2. a split's file that exists but cannot be read: what is wrong with it ---------------------
GOOD = PAIRS + rows(4)


def self_loop(folder: Path) -> dict:
    os.symlink(folder / "train.csv", folder / "train.csv")
    return {}


def two_link_loop(folder: Path) -> dict:
    os.symlink(folder / "other.csv", folder / "train.csv")
    os.symlink(folder / "train.csv", folder / "other.csv")
    return {}


def data_path_loop(folder: Path) -> dict:
    os.symlink(folder / "data", folder / "data")
    return {"path": str(folder / "data")}


FILES = [
    ("train.csv is a directory", lambda f: (f / "train.csv").mkdir() or {},
     "train.csv is a directory, not a data file: it cannot be read as the train split"),
    ("train.csv links to itself", self_loop, "train.csv is a symbolic link that loops"),
    ("train.csv is a loop of two links", two_link_loop, "train.csv is a symbolic link that loops"),
    ("train.csv links to nothing", lambda f: os.symlink(f / "gone.csv", f / "train.csv") or {},
     "train.csv is a symbolic link to"),
    ("train.tsv is a FIFO", lambda f: os.mkfifo(f / "train.tsv") or {},
     "train.tsv is a FIFO (named pipe), not a regular file"),
    ("validation.csv is a directory (the split was skipped)",
     lambda f: write(f, {"train.csv": GOOD}) and (f / "validation.csv").mkdir() or {},
     "validation.csv is a directory, not a data file: it cannot be read as the validation split"),
    ("dev.jsonl links to itself", lambda f: write(f, {"train.csv": GOOD}) and os.symlink(
        f / "dev.jsonl", f / "dev.jsonl") or {}, "dev.jsonl is a symbolic link that loops"),
    ("data.train_file names a directory", lambda f: (f / "mine.csv").mkdir() or
     {"train_file": "mine.csv"}, "mine.csv (data.train_file=mine.csv) is a directory"),
    ("data.path is a symbolic link loop", data_path_loop,
     "is a symbolic link that loops (following it never reaches a file)"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_a_split_file_that_cannot_be_read_says_why(tmp_path, make, message):
    settings = make(tmp_path)
    path = settings.pop("path", str(tmp_path))
    with pytest.raises(InputError) as info:
        load_splits(DataConfig(source="local", path=path, **settings), tmp_path)
    assert message in str(info.value)
    assert "no training file" not in str(info.value)


# --- 2. the library's own error lines stay out of the one message ------------------------------
# a run in a process of its own: the libraries' log handlers write where that process's Hydra
# and the handlers made at import put them, as a user sees it
RUN = """
import sys
if sys.argv[1] == "break-pandas":
    import pandas

    class Broken:  # fails as pandas does, while the builder reads the rows
        def __iter__(self):
            raise ValueError("Error tokenizing data. C error: out of memory")

        def close(self):
            pass
    pandas.read_csv = lambda *args, **kwargs: Broken()
from rapidformer.__main__ import main
main(sys.argv[2:])
"""

BROKEN_TSV = ("train.tsv", PAIRS_TSV + rows(4, "\t"), "break-pandas",
              "train.tsv as tsv: Error tokenizing data. C error: out of memory")
LEAKS = [
    ("a jsonl the builder cannot read (a key twice)", "train.jsonl",
     jsonl(PAIR) + '{"sentence1": "a", "sentence1": "b", "sentence2": "c", "label": 1}\n', "",
     "train.jsonl line 2 gives the key 'sentence1' twice", False),
    ("a tsv the builder fails on", *BROKEN_TSV, False),
    ("the same under RAPIDFORMER_DEBUG=1 (a guard: the lines are shown)", *BROKEN_TSV, True),
]


@pytest.mark.parametrize("name, text, breaks, message, debug", [c[1:] for c in LEAKS],
                         ids=[c[0] for c in LEAKS])
def test_the_librarys_error_lines_stay_out_of_the_message(tmp_path, name, text, breaks, message,
                                                          debug):
    import subprocess
    import sys

    from tests.conftest import OFFLINE_ENV

    write(tmp_path, {name: text})
    env = {**os.environ, **OFFLINE_ENV, "RAPIDFORMER_DEBUG": "1" if debug else "0"}
    result = subprocess.run(
        [sys.executable, "-c", RUN, breaks or "-", "data=pairs_local", f"data.path={tmp_path}",
         "trainer.progress_bar=false", "trainer.tensorboard=false",
         f"trainer.output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    library = [line for line in out.splitlines()
               if "[datasets" in line or "Generating data split" in line]
    assert message in out
    if debug:  # shown under RAPIDFORMER_DEBUG=1, with the traceback
        assert library, out[-2000:]
        return
    assert result.returncode == 2, out[-2000:]
    assert len([line for line in out.splitlines() if "rapidformer: error" in line]) == 1, out
    assert not library, out[-2000:]


# --- guards: what must still load as it did ------------------------------------------------------
STILL_LOADS = [
    ("csv: a quoted field over two lines",
     {"train.csv": PAIRS + '"a\nsecond line",b,pos\nc,d,neg\n'}, {}, 2),
    ("csv: prose over three lines, a comma on each",
     {"train.csv": "text,label\n" + '"Dear John,\nI am fine, thanks\nbye",1\n'
      + "".join(f"t{i},{i % 2}\n" for i in range(6))}, {}, 7),
    ("csv: prose with commas, string labels",
     {"train.csv": "text,label\n" + '"Dear John,\nI am fine, thanks\nbye",pos\n'
      + "".join(f"t{i},{'pos' if i % 2 else 'neg'}\n" for i in range(30))}, {}, 31),
    ("csv: a quote inside a field is text", {"train.csv": PAIRS + '5" screen,b,1\n' + rows(2)},
     {}, 3),
    ("csv: data.quoting=none", {"train.csv": PAIRS + '"open,b,1\n' + rows(3)}, {"quoting": "none"},
     4),
    ("quoted tsv: a field with a tab and a line break",
     {"train.tsv": PAIRS_TSV + '"multi\nline"\tb\t1\n"has\ttab"\tc\t0\n'}, {"quoting": "csv"}, 2),
    ("tsv: blank lines and a byte-order mark", {"train.tsv": "\ufeff" + PAIRS_TSV + "\n"
                                                + rows(3, "\t") + "\n  \n"}, {}, 3),
    ("json: one array over several lines", {"train.json": json.dumps([PAIR, PAIR], indent=1)}, {},
     2),
    ("json: one object per line, blank lines between",
     {"train.json": jsonl(PAIR) + "\n" + jsonl(PAIR)}, {}, 2),
]


@pytest.mark.parametrize("files, data, count", [c[1:] for c in STILL_LOADS],
                         ids=[c[0] for c in STILL_LOADS])
def test_files_whose_rows_account_for_their_lines_still_load(tmp_path, files, data, count):
    write(tmp_path, files)
    assert len(load_splits(config(tmp_path, **data), tmp_path)["train"]) == count


def test_data_quoting_is_a_checked_key():
    from rapidformer.config.read_keys import USED_ONLY_WITH

    assert USED_ONLY_WITH["data.quoting"] == ("data.source", ("local", "synthetic"))
    assert DataConfig().quoting == "auto"
