"""Faults of real use, each reproduced: a resume whose epochs became shorter, a checkpoint byte
changed on disk, a write that the file system refuses, an evaluation that fails, a fresh run
into an earlier run's directory. The entry points run in this process (tests/test_bad_input.py's
`call`) where the CLI is not itself the subject."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rapidformer.checkpoint import store as checkpoint
from rapidformer.checkpoint.state import read_state
from rapidformer.cli.verbs.verify import verify_command
from rapidformer.templates.finetuner import TrainState, continue_epoch
from tests.conftest import FAST, OFFLINE_ENV, run_in_process, train_losses
from tests.test_bad_input import call

QUICK = [*FAST, "trainer.export_hf=false"]
SAVED = [*QUICK, "model.hidden_size=128"]


@pytest.fixture
def deadline():
    """Fail a test that would otherwise hang (the fault it guards against is a hang)."""
    def expired(signum, frame):
        raise TimeoutError("the run did not finish in time: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(300)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_the_resumed_position_is_counted_in_the_new_epochs():
    same = continue_epoch(TrainState(10, 0, 4, 20, 32), 20, 32)
    assert (same.epoch, same.step_in_epoch) == (0, 4)
    # a larger batch: 4 x 32 samples taken = 2 steps of 64
    bigger = continue_epoch(TrainState(10, 0, 4, 20, 32), 10, 64)
    assert (bigger.epoch, bigger.step_in_epoch, bigger.global_batch_size) == (0, 2, 64)
    # rounded up: 3 x 32 = 96 samples are 1.5 steps of 64; none is seen twice
    assert continue_epoch(TrainState(10, 0, 3, 20, 32), 10, 64).step_in_epoch == 2
    # a smaller training set: the epoch is already over in the new terms
    over = continue_epoch(TrainState(10, 1, 10, 20, 32), 10, 32)
    assert (over.epoch, over.step_in_epoch, over.step) == (2, 0, 10)
    # a checkpoint from before the layout was recorded
    old = continue_epoch(TrainState(10, 0, 12, 0, 0), 10, 32)
    assert (old.epoch, old.step_in_epoch) == (1, 0)


def test_resume_with_fewer_steps_per_epoch_finishes(tmp_path, capsys, deadline):
    """The issue's reproduction: the saved step in the epoch (10) is past the resumed run's
    epoch length (10 steps of a smaller training set); the run used to spin forever."""
    run = tmp_path / "run"
    first = [*QUICK, "trainer.epochs=null", "trainer.train_iters=16", "trainer.save_interval=5",
             f"trainer.output_dir={run}"]
    code, err = call("rapidformer", [*first, "data.synthetic_train_size=640",
                                     f"data.path={tmp_path}/data640",
                                     "trainer.exit_interval=10"], capsys)
    assert code == 0, err[-2000:]
    assert read_state(run / "checkpoints" / "step_00000010").train_state[
        "step_in_epoch"] == 10
    code, err = call("rapidformer", [*first, "data.synthetic_train_size=320",
                                     f"data.path={tmp_path}/data320", "trainer.resume=auto"],
                     capsys)
    assert code == 0, err[-2000:]
    assert max(train_losses(run)) == 16
    saved = read_state(run / "checkpoints" / "step_00000016").train_state
    assert (saved["epoch"], saved["step_in_epoch"], saved["steps_per_epoch"]) == (1, 6, 10)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 3 (a model whose optimizer state is over
    1 MiB, the size above which files used to go unhashed). Trained in this process: what is
    found in its files is the subject."""
    run = tmp_path_factory.mktemp("saved") / "run"
    run_in_process([*SAVED, "trainer.train_iters=3", "trainer.save_interval=1",
                    f"trainer.output_dir={run}"], cwd=run.parent)
    return run


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_changed_byte_in_a_large_file_is_found_before_loading(saved_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = run / "checkpoints" / "step_00000003"
    largest = max(newest.iterdir(), key=lambda p: p.stat().st_size)
    assert largest.stat().st_size > 1 << 20  # the size the old manifest skipped
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    assert verify_command([str(run)]) == 0
    flip_a_byte(largest)

    assert verify_command([str(run)]) == 2
    out = capsys.readouterr().out
    assert "DAMAGED  " + str(newest) in out
    assert f"{largest.name}: its bytes changed since it was written (sha256 differs)" in out
    assert verify_command([str(newest)]) == 2

    # resume=auto skips it and takes the newest intact one; naming it is refused
    code, err = call("rapidformer", [*SAVED, "trainer.train_iters=4", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-2000:]
    log = (run / "rapidformer.log").read_text()
    assert f"ignoring damaged checkpoint {newest}: {largest.name}: its bytes changed" in log
    assert "resumed from " + str(run / "checkpoints" / "step_00000002") in log
    other = tmp_path / "other"
    code, err = call("rapidformer", [*SAVED, "trainer.train_iters=4",
                                     f"trainer.resume={newest}", f"trainer.output_dir={other}"],
                     capsys)
    assert code == 2 and f"is damaged: {largest.name}: its bytes changed" in err, err[-2000:]
    assert "Traceback" not in err


def test_a_write_the_file_system_refuses_ends_with_one_message(tmp_path):
    """A real refused write inside torch's own file writer (a file-size limit makes write(2)
    fail with EFBIG, as a full disk fails with ENOSPC): exit 74, one message, the partial
    checkpoint removed, status.json written."""
    run = tmp_path / "run"

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal, reports it
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, 512 << 10))

    result = subprocess.run(
        [sys.executable, "-m", "rapidformer", *QUICK, "trainer.train_iters=2",
         "trainer.save_interval=1", f"trainer.output_dir={run}"],
        env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=600,
        preexec_fn=limit_file_size)
    assert result.returncode == 74, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("rapidformer:") and not line.startswith("rapidformer: recipe:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"could not write checkpoint {run}/checkpoints/step_00000001: File too large" in lines[0]
    assert "no complete checkpoint was written before" in lines[0]
    assert os.listdir(run / "checkpoints") == []
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "could not write checkpoint" in status["error"]


FAILING_METRICS = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class MyFinetuner(SequenceClassificationFinetuner):
    def run_compute_metrics(self, model, eval_dataloader):
        raise ValueError("a metric with a bug")


MyFinetuner(engine=RapidformerEngine()).train()
'''


@pytest.mark.parametrize("when", ["interval", "final"])
def test_an_evaluation_error_keeps_the_steps_taken(tmp_path, capsys, when):
    script = tmp_path / "script.py"
    script.write_text(FAILING_METRICS)
    run = tmp_path / "run"
    interval = ["trainer.eval_interval=2"] if when == "interval" else []
    code, err = call("rapidformer", [*QUICK, f"user_script={script}", "trainer.train_iters=3",
                                     *interval, f"trainer.output_dir={run}"], capsys)
    assert code == 1 and "a metric with a bug" in err, err[-2000:]  # the user's bug: traceback
    complete, _ = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000002" if when == "interval"
                                          else "step_00000003"]


def test_overwrite_discards_the_earlier_run(saved_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (run / "notes.txt").write_text("the user's note in the run directory\n")
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=1", "trainer.overwrite=true",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-2000:]
    complete, _ = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000001"]  # none of the earlier run's
    assert sorted(train_losses(run)) == [1]
    assert (run / "notes.txt").is_file()  # files rapidformer did not write stay
