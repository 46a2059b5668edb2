"""Held-out cases of issue 34's classes, found by a review after its fixes: each is a table of
variations through the real entry point (in-process CLI), the files before and after compared.

- a file named like the run's own `.lock` that is not a lock a claim left (the user's text, a
  directory, a symbolic link to a file elsewhere) is the user's: the run refuses the folder and
  writes nothing, through the link least of all;
- data that would be read as other rows than written: a csv/tsv header naming a column twice
  (the builders rename one, `label.1`, and a task reads the other), a .json array whose object
  gives a key twice (the last one kept), two files for one split (train.csv beside
  train.jsonl, validation.csv beside dev.csv: one was read, the other left out) are refused
  naming the file, the line and the fix;
- another Hydra application's folders given as Hydra's own directories: hydra.run.dir (its
  `.hydra/` and log) and hydra.sweep.dir (its multirun.yaml and job directories) are refused
  before Hydra writes into them (the refusal came after Hydra had rewritten `.hydra/` and
  multirun.yaml, and the run had added status.json and its log);
- `rapidformer export --to` a place a run manages (its checkpoints/ directory: a step-named
  export was taken for a damaged checkpoint, and trainer.overwrite=true removed it; a name of
  its outputs such as hf_model), a link leading nowhere, or a path under a file: one message,
  exit 2, nothing written (a traceback, exit 1, for the last two).
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


# --- Hydra's own directories, given on the command line --------------------------------------

def _other_apps_run(root: Path) -> Path:
    run = root / "other_run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("lr: 1\n")
    (run / "main.log").write_text("the other app's log\n")
    return run


def _other_apps_sweep(root: Path) -> Path:
    sweep = root / "other_sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / "checkpoints").mkdir()
    (sweep / "0" / ".hydra" / "config.yaml").write_text("lr: 1\n")
    (sweep / "0" / "checkpoints" / "model.pt").write_text("weights")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def _a_project(root: Path) -> Path:
    folder = root / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    return folder


@pytest.mark.parametrize("make,argv,message", [
    (_other_apps_run, lambda d: [f"hydra.run.dir={d}"],
     "hydra.run.dir={d} holds files that no rapidformer run wrote (.hydra, main.log)"),
    (_other_apps_run, lambda d: [f"hydra.run.dir={d}", "trainer.overwrite=true"],
     "hydra.run.dir={d} holds files that no rapidformer run wrote (.hydra, main.log)"),
    (_other_apps_sweep, lambda d: ["-m", f"hydra.sweep.dir={d}"],
     "hydra.sweep.dir={d} holds files that no rapidformer sweep wrote (0)"),
    (_a_project, lambda d: ["-m", f"hydra.sweep.dir={d}", "trainer.lr=1e-3,2e-3"],
     "hydra.sweep.dir={d} holds files that no rapidformer sweep wrote (notes.txt)"),
])
def test_hydra_directories_of_another_app_are_refused_untouched(make, argv, message, tmp_path,
                                                                 capsys):
    folder = make(tmp_path)
    before = tree(tmp_path)
    code, err = call("rapidformer", [*argv(folder), *ONE_STEP], capsys)
    assert code == 2, err[-2000:]
    assert message.format(d=folder) in err, err[-2000:]
    assert "Traceback" not in err
    assert tree(tmp_path) == before


def test_a_sweep_directory_of_rapidformer_is_taken(tmp_path):
    from rapidformer.checkpoint.run_dir import RUN_MARKER, sweep_problems

    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    (tmp_path / "summary.md").write_text("| job |\n")
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / RUN_MARKER).write_text('{"rapidformer_run": 1}\n')
    (tmp_path / "0" / "checkpoints").mkdir()
    (tmp_path / "1" / ".hydra").mkdir(parents=True)  # a job refused before it ran
    (tmp_path / "1" / "rapidformer.log").write_text("")
    (tmp_path / "1" / "status.json").write_text('{"status": "failed"}')
    assert sweep_problems(tmp_path, "rapidformer") == []
    (tmp_path / "1" / "weights.pt").write_text("not ours")
    assert sweep_problems(tmp_path, "rapidformer") != []


# --- export --to a place it must not write ---------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from rapidformer import __main__ as module_main

    run = tmp_path_factory.mktemp("export") / "run"
    try:
        module_main.main([*ONE_STEP, "data.synthetic_train_size=64",
                          "data.synthetic_eval_size=16", f"trainer.output_dir={run}"])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    assert (run / "checkpoints").is_dir()
    return run


@pytest.mark.parametrize("to,message", [
    ("{run}/checkpoints/step_00000099", "is inside the run directory {run}, at "
     "checkpoints/step_00000099, which the run manages"),
    ("{run}/checkpoints/exports/v1", "at checkpoints/exports/v1, which the run manages"),
    ("{run}/hf_model", "is inside the run directory {run}, at hf_model, which the run manages"),
    ("{tmp}/dangling", "--to {tmp}/dangling is a symbolic link (to {tmp}/nowhere)"),
    ("{tmp}/dangling/model", "--to {tmp}/dangling/model cannot be created: {tmp}/dangling is a "
     "symbolic link that leads nowhere"),
    ("{tmp}/a_file/model", "--to {tmp}/a_file/model cannot be created: {tmp}/a_file is a file, "
     "not a directory"),
])
def test_export_to_a_place_it_must_not_write_is_refused(to, message, finished_run, tmp_path,
                                                        capsys):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "a_file").write_text("mine\n")
    where = {"run": finished_run, "tmp": tmp_path}
    before = tree(finished_run, tmp_path)
    code, err = call("cli", ["export", str(finished_run), "--to", to.format(**where)], capsys)
    assert code == 2, err[-2000:]
    assert message.format(**where) in err, err[-2000:]
    assert "Traceback" not in err
    assert tree(finished_run, tmp_path) == before
    assert not (tmp_path / "nowhere").exists()


def test_export_into_a_new_folder_of_the_run_directory_is_written(finished_run, tmp_path,
                                                                  capsys):
    code, err = call("cli", ["export", str(finished_run), "--to", str(finished_run / "v1")],
                     capsys)
    assert code == 0, err[-2000:]
    assert (finished_run / "v1" / "config.json").is_file()
