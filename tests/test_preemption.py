"""Preemption: SIGTERM stops a run at a step boundary with a complete checkpoint and exit code
75, and `trainer.resume=auto` continues it with the losses an uninterrupted run has."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapidformer.checkpoint import store as checkpoint
from rapidformer.errors import EXIT_PREEMPTED
from rapidformer.runtime.preemption import StopSignals
from tests.conftest import FAST, OFFLINE_ENV, assert_ok, run_cli, train_losses

# timing-sensitive (deadlines, signals at moments): run alone, after the parallel tests
pytestmark = pytest.mark.serial

# constant lr: a run's step-k loss does not depend on how many steps it was asked for
ARGS = [*FAST, "scheduler=constant", "scheduler.warmup_fraction=null", "trainer.export_hf=false",
        "model.hidden_dropout=0.1"]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV}
    return subprocess.Popen([sys.executable, "-m", "rapidformer", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, limit: float = 240):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and max(train_losses(run_dir), default=0) >= step:
            return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the run did not reach step {step} in {limit} s")


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_checkpoints_exits_75_and_resumes_with_the_same_losses(tmp_path, nproc):
    launcher = [f"launcher.nproc_per_node={nproc}"]
    run = tmp_path / "run"
    process = start([*ARGS, *launcher, "trainer.train_iters=100000",
                     f"trainer.output_dir={run}"], tmp_path)
    wait_for_step(run, 3, process)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert time.monotonic() - signalled < 60
    assert "rapidformer: stopped: stopped by" in stderr
    assert f"add trainer.output_dir={run} trainer.resume=auto to the same command" in stderr
    assert "Traceback" not in stderr
    complete, broken = checkpoint.scan(run / "checkpoints")
    assert complete and not broken
    stopped_at = int(complete[-1].name.split("_")[1])
    assert stopped_at >= 3 and max(train_losses(run)) <= stopped_at
    assert json.loads((run / "status.json").read_text())["status"] == "preempted"

    end = stopped_at + 4
    resumed = assert_ok(run_cli([*ARGS, *launcher, f"trainer.train_iters={end}",
                                 "trainer.resume=auto", f"trainer.output_dir={run}"], cwd=tmp_path))
    assert f"step_{stopped_at:08d}" in resumed.stdout + resumed.stderr
    whole = tmp_path / "whole"
    assert_ok(run_cli([*ARGS, *launcher, f"trainer.train_iters={end}",
                       f"trainer.output_dir={whole}"], cwd=tmp_path))
    expected, got = train_losses(whole), train_losses(run)
    assert sorted(expected) == list(range(1, end + 1))
    for step in range(1, end + 1):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_a_second_signal_exits_at_once_and_one_from_the_same_event_does_not(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    times = iter([100.0, 100.5, 104.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(times))
    stop = StopSignals()
    stop._handle(signal.SIGINT, None)  # Ctrl-C reaches the launcher and the workers...
    stop._handle(signal.SIGTERM, None)  # ...and the launcher forwards it: the same request
    assert stop.signum == signal.SIGINT and exits == []
    assert stop.requested()
    stop._handle(signal.SIGTERM, None)  # a later, second request
    assert exits == [128 + signal.SIGTERM]


def test_no_signal_no_stop():
    stop = StopSignals().install()
    try:
        assert not stop.requested()
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) != stop._handle


def test_the_stop_message_names_the_run_directory_to_resume(tmp_path):
    """With the default, timestamped trainer.output_dir, `trainer.resume=auto` alone would
    start a fresh run in a new directory: the advice names the stopped run's."""
    stop = StopSignals()
    stop.signum = signal.SIGTERM
    run = tmp_path / "outputs" / "2026-12-01" / "10-00-00"
    assert str(stop.error(7, run / "checkpoints")) == (
        f"stopped by SIGTERM at step 7: no checkpoint was written; to continue, add "
        f"trainer.output_dir={run} trainer.resume=auto to the same command (exit code 75)")
    spaced = tmp_path / "my runs" / "a"
    assert f"add 'trainer.output_dir={spaced}' trainer.resume=auto to" in \
        str(stop.error(7, spaced / "checkpoints"))
