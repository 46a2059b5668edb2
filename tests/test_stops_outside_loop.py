"""A stop outside the training loop: SIGTERM and SIGINT while a `trainer.overwrite=true` run
starts put the earlier run back and say so in one line (exit 128 + the signal); a start killed
outright leaves it aside, and the next run without overwrite puts it back, so that a resume
continues it instead of starting fresh and deleting it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, OFFLINE_ENV, assert_ok, run_cli, train_losses

pytestmark = [pytest.mark.serial, pytest.mark.slow]

ARGS = [*FAST, "trainer.export_hf=false", "trainer.log_interval=1"]
STASH = ".rapidformer-overwritten"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert_ok(run_cli([*ARGS, f"trainer.output_dir={run}"], cwd=run.parent))
    return run


def _overwrite_stopped(run, signum, tmp_path) -> subprocess.CompletedProcess:
    """The overwrite of `run`, sent `signum` once it has moved the earlier run aside."""
    env = {**os.environ, **OFFLINE_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "rapidformer", *ARGS,
                             "trainer.overwrite=true", f"trainer.output_dir={run}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / STASH).is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_overwrite_start_puts_the_earlier_run_back(finished_run, tmp_path, signum):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    losses = train_losses(run)
    result = _overwrite_stopped(run, signum, tmp_path)
    name = signal.Signals(signum).name
    assert result.returncode == 128 + signum, result.stderr[-3000:]
    assert f"rapidformer: stopped by {name} before training: nothing was run; {run} is as it " \
           f"was (exit code {128 + signum})" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (run / STASH).exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert train_losses(run) == losses


def test_a_killed_overwrites_stash_is_put_back_for_a_resume(finished_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    last = sorted(p.name for p in (run / "checkpoints").iterdir())[-1]
    result = _overwrite_stopped(run, signal.SIGKILL, tmp_path)
    assert result.returncode == -signal.SIGKILL
    assert (run / STASH).is_dir()  # a kill leaves it aside: nothing runs to put it back
    resumed = assert_ok(run_cli([*ARGS, "trainer.resume=auto", f"trainer.output_dir={run}"],
                                cwd=tmp_path))
    assert "put back in" in resumed.stderr and f"resumed from {run / 'checkpoints' / last}" in \
        resumed.stderr + resumed.stdout
    assert not (run / STASH).exists()
