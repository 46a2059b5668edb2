"""A worker that dies or hangs: elastic restarts resume from the newest complete checkpoint,
and a hung rank ends the job within launcher.collective_timeout with an error naming it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rapidformer.checkpoint import store as checkpoint
from tests.conftest import FAST, assert_ok, run_cli, train_losses

# timing-sensitive (deadlines, kills at moments): run alone, after the parallel tests
pytestmark = pytest.mark.serial


# the black-box task, with a fault on rank 1 at its 5th forward pass of the first attempt
FAULTY = '''
import os, signal, time
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class Faulty(SequenceClassificationFinetuner):
    calls = 0

    def run_forward_step(self, batch, model):
        Faulty.calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.engine.rank == 1 and Faulty.calls == 5 and first_attempt:
            {fault}
        return super().run_forward_step(batch, model)


Faulty(engine=RapidformerEngine()).train()
'''
ARGS = [*FAST, "launcher.nproc_per_node=2", "trainer.export_hf=false", "trainer.train_iters=6",
        "trainer.save_interval=2"]


def faulty_script(tmp_path, fault: str):
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY.replace("{fault}", fault))
    return f"user_script={script}"


def test_an_elastic_restart_resumes_from_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    result = assert_ok(run_cli([faulty_script(tmp_path, "os._exit(1)"), *ARGS,
                                "launcher.max_restarts=1", f"trainer.output_dir={run}"],
                               cwd=tmp_path))
    output = result.stdout + result.stderr
    # rank 1 died in step 5 (one micro-batch per rank per step): steps 1-4 were done, 4 saved
    assert "restart 1 of launcher.max_restarts=1: resuming from the newest complete " \
           "checkpoint, step_00000004" in output
    assert "resumed from" in output and "(step 4)" in output
    assert sorted(train_losses(run)) == list(range(1, 7))
    complete, broken = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000004", "step_00000006"] and not broken


def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    run = tmp_path / "run"
    started = time.monotonic()
    # the hang ends at the launcher's SIGTERM, not 30 s later at its SIGKILL (its grace for a
    # worker that is writing a checkpoint): the same detection, half a minute shorter
    hang = "signal.signal(signal.SIGTERM, signal.SIG_DFL); time.sleep(600)"
    result = run_cli([faulty_script(tmp_path, hang), *ARGS, "launcher.collective_timeout=5",
                      f"trainer.output_dir={run}"], cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert time.monotonic() - started < 90
    assert "rank 0 gave up waiting in a collective; rank 1 (at forward pass 4, its last" in \
        result.stderr
    assert "did not: it hung or died first" in result.stderr
    assert "raise launcher.collective_timeout=5" in result.stderr
    assert "did not complete within launcher.collective_timeout=5 s" in result.stderr
    assert "Traceback" not in result.stderr.split("Its last output:")[0]
    complete, _ = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000002", "step_00000004"]


def test_a_worker_whose_launcher_died_while_it_started_exits_at_once(tmp_path):
    """The launcher is gone before the worker could ask to die with it: the worker is then
    already a child of the reaper, and must stop instead of training on beside a restarted
    job in the same run directory."""
    config = tmp_path / "config.yaml"
    config.write_text("not read: the worker stops first\n")
    not_its_parent = str(os.getpid() + 1_000_000)
    result = subprocess.run([sys.executable, "-m", "rapidformer.cli.worker", "--worker", str(config)],
                            env={**os.environ, "RAPIDFORMER_LAUNCHER_PID": not_its_parent},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + 9, result.stderr[-2000:]
    assert result.stderr == ""
