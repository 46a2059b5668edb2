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
  exit 2, nothing written (a traceback, exit 1, for the last two);
- a run that early stopping ended, resumed with the same settings (the command its summary
  printed, or trainer.resume=PATH), trained one more step, stopped again and replaced its best
  and export, and its summary said "run finished": now the summary and status.json say
  "stopped early at step N of M (why)", the resume is refused with every byte left as it was,
  and a larger patience, or none, trains on;
- `rapidformer predict --output` an existing file (the training data, the run's own records, a
  link to the input) replaced it silently: an existing file is refused unless --overwrite, and
  the input, the run's data files and its records are refused even with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from tests.test_bad_input import ERROR_LINE, Case, call, record

ONE_STEP = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.train_iters=1",
            "trainer.epochs=null", "trainer.export_hf=false", "trainer.micro_batch_size=16"]


def recorded(request, what: str, code: int, err: str) -> None:
    """The case's message into docs/reliability.md's bad-input table (tools/bad_input_table.py
    runs this file too), named `what` and the case's id."""
    lines = [line for line in err.splitlines() if ERROR_LINE.match(line)]
    message = err[err.index(lines[0]):] if lines else err
    case = re.sub(r"(?<=\w)-(?=\w)", ", ", request.node.callspec.id)  # pytest joins ids by -
    record(Case(f"{what}: {case}", lambda p: [], ""), code, message)


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


@pytest.mark.parametrize("plant", [_user_text, _link_outside, _dangling_link, _directory],
                         ids=["the user's text", "a link to a file elsewhere",
                              "a link leading nowhere", "a directory"])
def test_a_lock_file_not_ours_is_refused_and_left_alone(plant, tmp_path, capsys, request):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("the user's file\n")
    plant(folder, outside)
    before = tree(folder, outside)
    code, err = call("rapidformer", [*ONE_STEP, f"trainer.output_dir={folder}"], capsys)
    recorded(request, "a .lock in the output folder that is not a claim's", code, err)
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
], ids=["a csv header naming a column twice", "a csv header with a BOM naming one twice",
        "a tsv header after blank lines naming one twice", "a json object giving a key twice",
        "train.csv beside train.jsonl", "validation.csv beside dev.csv"])
def test_data_read_as_other_rows_than_written_is_refused(files, message, tmp_path, capsys,
                                                         request):
    data = tmp_path / "data"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_bytes(text.encode())
    before = tree(data)
    run = tmp_path / "run"
    code, err = call("rapidformer", [*ONE_STEP, "data=pairs_local", f"data.path={data}",
                                     "trainer.micro_batch_size=4", f"trainer.output_dir={run}"],
                     capsys)
    recorded(request, "local data read as other rows than written", code, err)
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
], ids=["hydra.run.dir", "hydra.run.dir with trainer.overwrite=true", "hydra.sweep.dir",
        "hydra.sweep.dir of a project folder"])
def test_hydra_directories_of_another_app_are_refused_untouched(make, argv, message, tmp_path,
                                                                 capsys, request):
    folder = make(tmp_path)
    before = tree(tmp_path)
    code, err = call("rapidformer", [*argv(folder), *ONE_STEP], capsys)
    recorded(request, "another Hydra application's folder given as", code, err)
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
], ids=["a step name in checkpoints/", "a folder in checkpoints/", "hf_model",
        "a link leading nowhere", "under a link leading nowhere", "under a file"])
def test_export_to_a_place_it_must_not_write_is_refused(to, message, finished_run, tmp_path,
                                                        capsys, request):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "a_file").write_text("mine\n")
    where = {"run": finished_run, "tmp": tmp_path}
    before = tree(finished_run, tmp_path)
    code, err = call("cli", ["export", str(finished_run), "--to", to.format(**where)], capsys)
    recorded(request, "rapidformer export --to", code, err)
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


# --- a run that early stopping ended ---------------------------------------------------------

EARLY = ["data=pairs_local", "trainer.epochs=null", "trainer.train_iters=6",
         "trainer.eval_interval=1", "trainer.best_metric=validation/loss",
         "trainer.early_stopping_patience=1", "trainer.early_stopping_min_delta=0.5",
         "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.micro_batch_size=16",
         "trainer.log_interval=1"]
# the loss falls by far less than 0.5 a step: the second evaluation ends the run at step 2.
# best_mode=max on a falling loss: step 2 is no best, so trainer.save_last=false leaves it no
# checkpoint, and only the best marker knows of the stop
ORIGINS = {"default": [], "no checkpoint of the stop": ["trainer.best_mode=max",
                                                        "trainer.save_last=false"]}


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory):
    """{origin: (data dir, run dir, stderr of its run)}: runs that early stopping ended."""
    from rapidformer.data.synthetic import write_dataset

    root = tmp_path_factory.mktemp("early")
    data = write_dataset(root / "data", train_size=64, eval_size=16, seed=3)
    runs = {}
    for name, extra in ORIGINS.items():
        run = root / name.replace(" ", "_")
        code, err = _main([*EARLY, *extra, f"data.path={data}", f"trainer.output_dir={run}"])
        assert code == 0, err[-2000:]
        runs[name] = (data, run, err)
    return runs


def _main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from rapidformer import __main__ as module_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            module_main.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


STOPPED_AT_2 = ("stopped early at step 2 of 6 (no improvement of more than 0.5 in "
                "validation/loss for 1 evaluation, trainer.early_stopping_patience=1)")


@pytest.mark.parametrize("origin", ORIGINS)
def test_an_early_stop_is_reported_as_one(origin, early_stopped):
    from rapidformer.observability.records import read_metrics

    _, run, err = early_stopped[origin]
    assert f"rapidformer: run {STOPPED_AT_2}: {run}" in err, err[-2000:]
    assert "run finished" not in err
    assert json.loads((run / "status.json").read_text()) == {"status": "stopped_early",
                                                             "error": STOPPED_AT_2}
    assert max(r["step"] for r in read_metrics(run) if "loss" in r) == 2
    # the summary's way on trains without early stopping; a plain resume would be refused
    train_on = next(line for line in err.splitlines() if line.strip().startswith("train on"))
    assert "trainer.early_stopping_patience=null trainer.early_stopping_min_delta=0" in train_on
    assert "early_stopping_patience=1" not in train_on


def _newest(run: Path) -> str:
    return str(sorted((run / "checkpoints").glob("step_*"))[-1])


@pytest.mark.parametrize("origin", ORIGINS)
@pytest.mark.parametrize("resume,trains_to", [
    (["trainer.resume=auto"], None),
    (["trainer.resume={newest}"], None),
    (["trainer.resume=auto", "trainer.early_stopping_min_delta=0.4"], None),
    (["trainer.resume=auto", "trainer.early_stopping_patience=2"], 3),
    (["trainer.resume=auto", "trainer.early_stopping_patience=null",
      "trainer.early_stopping_min_delta=0"], 6),
], ids=["same settings", "resume=PATH", "another min_delta", "a larger patience",
        "no early stopping"])
def test_a_resumed_early_stop_trains_only_when_asked_to(origin, resume, trains_to,
                                                        early_stopped, tmp_path, request):
    import shutil

    from rapidformer.observability.records import read_metrics

    data, first, _ = early_stopped[origin]
    run = tmp_path / "run"
    shutil.copytree(first, run, symlinks=True)
    argv = [*EARLY, *ORIGINS[origin], f"data.path={data}", f"trainer.output_dir={run}",
            *(r.format(newest=_newest(run)) for r in resume)]
    before = {k: v for k, v in tree(run, data).items() if not k.endswith("/.lock")}
    code, err = _main(argv)
    if trains_to is None:
        recorded(request, "resume of a run that early stopping ended", code, err)
        assert code == 2, err[-2000:]
        assert "is of a run that already stopped early at step 2 of 6 (no improvement of " \
               "more than" in err, err[-2000:]
        assert "trainer.early_stopping_patience=2 or more" in err
        assert "trainer.early_stopping_patience=null trainer.early_stopping_min_delta=0" in err
        assert "Traceback" not in err
        after = {k: v for k, v in tree(run, data).items() if not k.endswith("/.lock")}
        assert after == before
        return
    assert code == 0, err[-2000:]
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert max(steps) == trains_to and 3 in steps, steps
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == ("ok" if trains_to == 6 else "stopped_early"), status
    assert tree(data) == {k: v for k, v in before.items() if k.startswith(str(data))}


def test_an_early_stop_is_read_from_the_checkpoint_or_the_marker():
    """The record of this run's metric and mode whose patience is over; the marker's only
    when it knows of evaluations from the checkpoint on."""
    from types import SimpleNamespace

    from rapidformer.checkpoint.early_stop import early_stop_of

    t = SimpleNamespace(best_metric="validation/loss", best_mode=None,
                        early_stopping_patience=2)
    record = {"metric": "validation/loss", "mode": "min", "step": 3, "value": 0.5,
              "evaluated_at": 5, "evaluations_without_improvement": 2}
    assert early_stop_of(t, record, None, 5) == record
    assert early_stop_of(t, None, record, 3) == record  # the stop came after the checkpoint
    assert early_stop_of(t, None, record, 6) is None  # a checkpoint after it: not that run's
    assert early_stop_of(t, {**record, "mode": "max"}, None, 5) is None  # another mode
    assert early_stop_of(SimpleNamespace(**{**vars(t), "early_stopping_patience": 3}), record,
                         None, 5) is None
    assert early_stop_of(SimpleNamespace(**{**vars(t), "early_stopping_patience": None}),
                         record, None, 5) is None


# --- predict --output over a file that exists ------------------------------------------------

def _link_to_input(tmp: Path, data: Path, run: Path) -> Path:
    os.symlink(tmp / "input.jsonl", tmp / "link.jsonl")
    return tmp / "link.jsonl"


def _relative_data_file(tmp: Path, data: Path, run: Path) -> Path:
    os.symlink(data, tmp / "mydata")
    return tmp / "mydata" / ".." / data.name / "train.jsonl"


@pytest.mark.parametrize("output,overwrite,message", [
    ("{data}/train.jsonl", False, "--output {data}/train.jsonl is one of the run's data files "
     "(data.path={data}"),
    ("{data}/train.jsonl", True, "predict never writes over the data a run read, not even "
     "with --overwrite; nothing was written: give --output another path"),
    ("{data}/test.jsonl", True, "--output {data}/test.jsonl is one of the run's data files"),
    (_relative_data_file, True, "is one of the run's data files"),
    ("{data}/new.jsonl", True, "--output {data}/new.jsonl is one of the run's data files"),
    ("{run}/metrics.jsonl", True, "is metrics.jsonl of the run {run}, which the run keeps"),
    ("{run}/checkpoints/best.jsonl", True, "is inside checkpoints/ of the run {run}, which the run keeps: "
     "predict never writes there, not even with --overwrite"),
    ("{tmp}/input.jsonl", True, "--output {tmp}/input.jsonl is the input file; nothing was "
     "written"),
    (_link_to_input, True, "is the input file; nothing was written"),
    ("{tmp}/mine.jsonl", False, "--output {tmp}/mine.jsonl exists; nothing was written: give "
     "--output another path, or add --overwrite to replace it"),
], ids=["training data", "training data, --overwrite", "test data, --overwrite",
        "data by another path", "a new file in the data folder", "the run's metrics",
        "in checkpoints/", "the input", "a link to the input", "an existing file"])
def test_predict_never_replaces_a_file_it_was_not_asked_to(output, overwrite, message,
                                                           early_stopped, tmp_path, capsys,
                                                           request):
    data, run, _ = early_stopped["default"]
    (tmp_path / "input.jsonl").write_bytes((data / "validation.jsonl").read_bytes())
    (tmp_path / "mine.jsonl").write_text("my own rows\n")
    where = {"data": data, "run": run, "tmp": tmp_path}
    out = output(tmp_path, data, run) if callable(output) else Path(output.format(**where))
    before = tree(data, run, tmp_path)
    code, err = call("cli", ["predict", str(run), "--input", str(tmp_path / "input.jsonl"),
                             "--output", str(out), *(["--overwrite"] if overwrite else [])],
                     capsys)
    recorded(request, "rapidformer predict --output", code, err)
    assert code == 2, err[-2000:]
    assert message.format(**where) in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert tree(data, run, tmp_path) == before


def test_predict_overwrite_replaces_another_file_whole(early_stopped, tmp_path, capsys):
    data, run, _ = early_stopped["default"]
    (tmp_path / "mine.jsonl").write_text("my own rows\n")
    code, err = call("cli", ["predict", str(run), "--input", str(data / "validation.jsonl"),
                             "--output", str(tmp_path / "mine.jsonl"), "--overwrite"], capsys)
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "mine.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all("prediction" in r and "score" in r for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.jsonl"]  # no temporary file left
