"""Several processes (2 gloo workers on CPU): the launcher, DDP, and failures."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import FAST, OFFLINE_ENV, run_cli, train_losses

pytestmark = pytest.mark.slow

SMALL = [*FAST, "trainer.micro_batch_size=8", "trainer.global_batch_size=32", "trainer.epochs=2",
         "trainer.export_hf=false"]


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_ddp_two_processes_give_the_single_process_losses(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _ok(run_cli([*SMALL, f"trainer.output_dir={one}"], cwd=tmp_path))
    result = _ok(run_cli([*SMALL, "launcher.nproc_per_node=2", f"trainer.output_dir={two}"],
                         cwd=tmp_path))
    single, ddp = train_losses(one), train_losses(two)
    assert sorted(ddp) == sorted(single) == list(range(1, 17))
    for step, loss in single.items():
        assert ddp[step] == pytest.approx(loss, abs=1e-4), step
    # one run directory, one metrics file written by rank 0, a log per rank
    logs = sorted(p.parent.name for p in (two / "logs").glob("node0/*/attempt_0/*/stdout.log"))
    assert logs == ["0", "1"]
    assert "starting 2 worker(s)" in result.stdout + result.stderr


def test_ddp_resume_continues_with_the_same_losses(tmp_path):
    args = [*SMALL, "launcher.nproc_per_node=2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _ok(run_cli([*args, f"trainer.output_dir={whole}"], cwd=tmp_path))
    _ok(run_cli([*args, f"trainer.output_dir={parts}", "trainer.exit_interval=6"], cwd=tmp_path))
    _ok(run_cli([*args, f"trainer.output_dir={parts}", "trainer.resume=auto"], cwd=tmp_path))
    expected, got = train_losses(whole), train_losses(parts)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_a_dead_worker_stops_the_job_naming_its_rank(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from rapidformer import RapidformerEngine
        engine = RapidformerEngine()
        if engine.rank == 1:
            sys.exit(7)
        import torch.distributed as dist
        dist.barrier()  # rank 0 would wait here forever if the launcher did not stop it
    """))
    result = run_cli([*SMALL, "launcher.nproc_per_node=2", f"user_script={script}",
                      f"trainer.output_dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 7
    assert "worker rank 1 failed with exit code 7" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_process_each(tmp_path):
    """Two launcher invocations on this machine, node_rank 0 and 1, one master address."""
    port = _free_port()
    run = tmp_path / "run"
    common = [*SMALL, "launcher.nnodes=2", "launcher.master_addr=127.0.0.1",
              f"launcher.master_port={port}", f"trainer.output_dir={run}"]
    env = {**OFFLINE_ENV}
    import os

    procs = [subprocess.Popen([sys.executable, "-m", "rapidformer", *common,
                               f"launcher.node_rank={rank}"], cwd=tmp_path,
                              env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    single = tmp_path / "single"
    _ok(run_cli([*SMALL, f"trainer.output_dir={single}"], cwd=tmp_path))
    two_nodes, one = train_losses(run), train_losses(single)
    for step, loss in one.items():
        assert two_nodes[step] == pytest.approx(loss, abs=1e-4), step
    assert (run / "logs" / "node0").is_dir() and (run / "logs" / "node1").is_dir()
