"""Held-out cases of issue 34's classes, found by a review after its fixes: each is a table of
variations through the real entry point (in-process CLI), the files before and after compared.

- a file named like the run's own `.lock` that is not a lock a claim left (the user's text, a
  directory, a symbolic link to a file elsewhere) is the user's: the run refuses the folder and
  writes nothing, through the link least of all;
- data that would be read as other rows than written: a csv/tsv header naming a column twice
  (the builders rename one, `label.1`, and a task reads the other), a .json array whose object
  gives a key twice (the last one kept), two files for one split (train.csv beside
  train.jsonl, validation.csv beside dev.csv: one was read, the other left out) are refused
  naming the file, the line and the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.test_bad_input import call

ONE_STEP = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.train_iters=1",
            "trainer.epochs=null", "trainer.export_hf=false", "trainer.micro_batch_size=16"]


def tree(*roots: Path) -> dict[str, str]:
    """Every file and link under `roots`: its path, and its bytes' sha256 or its target."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    found[str(p)] = "-> " + os.readlink(p)
                elif p.is_file():
                    found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
                else:
                    found[str(p)] = "dir"
    return found


# --- a `.lock` that is not a claim's is the user's -------------------------------------------

def _user_text(folder: Path, outside: Path) -> None:
    (folder / ".lock").write_text("held by my own tool\n")


def _link_outside(folder: Path, outside: Path) -> None:
    os.symlink(outside / "victim.txt", folder / ".lock")


def _dangling_link(folder: Path, outside: Path) -> None:
    os.symlink(outside / "not_there.txt", folder / ".lock")


def _directory(folder: Path, outside: Path) -> None:
    (folder / ".lock").mkdir()
    (folder / ".lock" / "mine").write_text("x")


@pytest.mark.parametrize("plant", [_user_text, _link_outside, _dangling_link, _directory])
def test_a_lock_file_not_ours_is_refused_and_left_alone(plant, tmp_path, capsys):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("the user's file\n")
    plant(folder, outside)
    before = tree(folder, outside)
    code, err = call("rapidformer", [*ONE_STEP, f"trainer.output_dir={folder}"], capsys)
    assert code == 2, err[-2000:]
    assert "holds files that no rapidformer run wrote (.lock)" in err, err[-2000:]
    assert "Traceback" not in err
    assert tree(folder, outside) == before
    assert not (outside / "not_there.txt").exists()


@pytest.mark.parametrize("text,ours", [
    ("", True),  # a refused claim's
    (json.dumps({"pid": 4242, "host": "node7", "started": "2026-12-01T10:00:00"}), True),
    ("held by my own tool\n", False), ("[1, 2]", False), ('{"pid": 1}', False)])
def test_only_a_claims_lock_is_taken_for_one(text, ours, tmp_path):
    from rapidformer.checkpoint.run_dir import claim_problems

    (tmp_path / ".lock").write_text(text)
    problems = claim_problems(tmp_path, None, False)
    assert (problems == []) == ours, problems


# --- data read as other rows than written ----------------------------------------------------

PAIRS = "".join(f"a{i} b c,d{i} e f,{i % 2}\n" for i in range(8))
HEADER = "sentence1,sentence2,label\n"
JSON_ROWS = [{"sentence1": f"a{i}", "sentence2": f"b{i}", "label": i % 2} for i in range(8)]


@pytest.mark.parametrize("files,message", [
    ({"train.csv": "sentence1,sentence2,label,label\n" +
      "".join(f"a{i} b,d{i} e,{i % 2},{1 - i % 2}\n" for i in range(8)),
      "validation.csv": HEADER + PAIRS},
     "train.csv line 1: the header names the column 'label' twice (columns 3 and 4)"),
    ({"train.csv": "\ufeffsentence1,sentence2,sentence1,label\r\n" +
      "".join(f"a{i} b,d{i} e,x{i},{i % 2}\r\n" for i in range(8)),
      "validation.csv": HEADER + PAIRS},
     "train.csv line 1: the header names the column 'sentence1' twice (columns 1 and 3)"),
    ({"train.csv": HEADER + PAIRS,
      "validation.tsv": "\n\nsentence1\tsentence2\tlabel\tsentence2\n" +
      "".join(f"a{i} b\td{i} e\t{i % 2}\tz\n" for i in range(4))},
     "validation.tsv line 3: the header names the column 'sentence2' twice (columns 2 and 4)"),
    ({"train.json": "[\n" + ",\n".join(json.dumps(r) for r in JSON_ROWS) +
      ',\n{"sentence1": "x", "sentence2": "y", "label": 1, "label": 0}\n]\n',
      "validation.csv": HEADER + PAIRS},
     "train.json line 10: row 9 of its array gives the key 'label' twice in one object"),
    ({"train.csv": HEADER + PAIRS, "train.jsonl": "".join(json.dumps(r) + "\n"
                                                         for r in JSON_ROWS),
      "validation.csv": HEADER + PAIRS},
     "holds 2 files for the train split (train.csv, train.jsonl); a run reads one: keep one "
     "of them there, or name it with data.train_file=NAME"),
    ({"train.csv": HEADER + PAIRS, "validation.csv": HEADER + PAIRS,
      "dev.csv": HEADER + PAIRS[:32]},
     "holds 2 files for the validation split (validation.csv, dev.csv)"),
])
def test_data_read_as_other_rows_than_written_is_refused(files, message, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_bytes(text.encode())
    before = tree(data)
    run = tmp_path / "run"
    code, err = call("rapidformer", [*ONE_STEP, "data=pairs_local", f"data.path={data}",
                                     "trainer.micro_batch_size=4", f"trainer.output_dir={run}"],
                     capsys)
    assert code == 2, err[-2000:]
    assert message in err, err[-2000:]
    assert "Traceback" not in err
    assert tree(data) == before
    assert not (run / "checkpoints").exists()


def test_a_split_file_named_is_read_beside_another(tmp_path, capsys):
    """The way out the message gives: data.train_file names the one to read."""
    from rapidformer.data.local_files import find_split_file

    (tmp_path / "train.csv").write_text(HEADER + PAIRS)
    (tmp_path / "train.jsonl").write_text(json.dumps(JSON_ROWS[0]) + "\n")
    assert find_split_file(tmp_path, "train", "train.jsonl", "auto") == tmp_path / "train.jsonl"
    assert find_split_file(tmp_path, "train", None, "csv") == tmp_path / "train.csv"
