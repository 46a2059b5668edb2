"""Several processes (2 gloo workers on CPU): the launcher, DDP, and failures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
import textwrap
import time

import pytest
import yaml

from tests.conftest import (FAST, OFFLINE_ENV, assert_ok, free_port, run_cli, run_in_process,
                            train_losses)

pytestmark = pytest.mark.slow

SMALL = [*FAST, "trainer.micro_batch_size=8", "trainer.global_batch_size=32", "trainer.epochs=2",
         "trainer.export_hf=false"]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    """The reference: one process, same global batch (every strategy against one process, in
    every precision, on 2 ranks started in-process: tests/test_strategies.py). In this process:
    the launchers' processes are the subject, not this one's."""
    run = tmp_path_factory.mktemp("single_fp32")
    run_in_process([*SMALL, "precision=fp32", f"trainer.output_dir={run}"], cwd=run)
    return {"fp32": train_losses(run)}


def test_ddp_two_processes_give_the_single_process_losses(tmp_path, single_process_losses):
    two = tmp_path / "two"
    result = assert_ok(run_cli([*SMALL, "launcher.nproc_per_node=2", f"trainer.output_dir={two}"],
                         cwd=tmp_path))
    single, ddp = single_process_losses["fp32"], train_losses(two)
    assert sorted(ddp) == sorted(single) == list(range(1, 17))
    for step, loss in single.items():
        assert ddp[step] == pytest.approx(loss, abs=1e-4), step
    # one run directory, one metrics file written by rank 0, a log per rank
    logs = sorted(p.parent.name for p in (two / "logs").glob("node0/*/attempt_0/*/stdout.log"))
    assert logs == ["0", "1"]
    assert "starting 2 worker(s)" in result.stdout + result.stderr


def test_torchrun_runs_in_place(tmp_path, single_process_losses):
    """Started by torchrun (RANK/WORLD_SIZE set), rapidformer joins that job instead of
    launching its own workers."""
    run = tmp_path / "torchrun"
    result = assert_ok(run_cli(["--nproc_per_node", "2", "-m", "rapidformer", *SMALL,
                          f"trainer.output_dir={run}"], cwd=tmp_path,
                         module="torch.distributed.run"))
    assert "starting 2 worker(s)" not in result.stdout + result.stderr
    single, got = single_process_losses["fp32"], train_losses(run)
    assert sorted(got) == sorted(single)
    for step, loss in single.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), step


# Resume on 2 processes through the CLI: tests/test_kill_resume.py (bitwise equal weights after
# SIGKILLs) and tests/test_preemption.py (per-step losses after SIGTERM), DDP; every strategy's
# own resume from its sharded checkpoint, and `rapidformer export` of it offline:
# tests/test_strategies.py, on 2 ranks in-process.


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


def test_two_nodes_of_one_process_each(tmp_path, single_process_losses):
    """Two launcher invocations on this machine, node_rank 0 and 1, one master address, one
    run directory (a shared file system); the later node starts first."""
    port = free_port()
    run = tmp_path / "run"
    common = [*SMALL, "launcher.nnodes=2", "launcher.master_addr=127.0.0.1",
              "launcher.collective_timeout=60",
              f"launcher.master_port={port}", f"trainer.output_dir={run}"]
    # output to files, not pipes: a full pipe would block one node while the other waits for it
    outputs = [tmp_path / f"node{rank}.out" for rank in (0, 1)]

    def start(rank):
        return subprocess.Popen([sys.executable, "-m", "rapidformer", *common,
                                 f"launcher.node_rank={rank}"], cwd=tmp_path,
                                env={**os.environ, **OFFLINE_ENV}, stdout=open(outputs[rank], "w"),
                                stderr=subprocess.STDOUT)

    # the later node first, in its rendezvous before the first node starts: on this shared
    # file system it must have written nothing into the run directory the first node claims
    second = start(1)
    procs = [second]
    try:
        deadline = time.monotonic() + 120
        while "starting 1 worker(s) on node 1" not in outputs[1].read_text():
            assert second.poll() is None and time.monotonic() < deadline, outputs[1].read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        assert not run.exists() or not any(run.iterdir()), sorted(p.name for p in run.iterdir())
        first = start(0)
        procs.append(first)
        codes = [first.wait(timeout=300)]
        if codes[0] != 0:  # the second would wait for it until its rendezvous times out
            second.kill()
        codes.append(second.wait(timeout=300))
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], outputs[0].read_text()[-2000:] + outputs[1].read_text()[-2000:]
    two_nodes, one = train_losses(run), single_process_losses["fp32"]
    for step, loss in one.items():
        assert two_nodes[step] == pytest.approx(loss, abs=1e-4), step
    assert (run / "logs" / "node0").is_dir() and (run / "logs" / "node1").is_dir()
    # the job's status and summary are the first node's; the later node says so
    assert json.loads((run / "status.json").read_text())["status"] == "ok"
    assert "the first node prints the job's summary" in outputs[1].read_text()


def test_a_failed_worker_s_log_tail_is_its_own_node_s(tmp_path):
    """On a shared file system both nodes' workers of local rank 0 write their logs side by
    side: the failure message shows the failed rank's own."""
    from rapidformer.runtime.launch import _log_tail

    for node in (0, 1):
        log = tmp_path / "logs" / f"node{node}" / "job_x" / "attempt_0" / "0" / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(f"Traceback of node {node}\n")
    assert "node 1" in _log_tail(tmp_path, 1, 0) and "node 0" in _log_tail(tmp_path, 0, 0)


def test_a_later_node_s_launcher_gives_its_workers_a_config_outside_the_run_directory(tmp_path):
    from rapidformer.runtime.launch import workers_config

    resolved = {"trainer": {"lr": 0.5}, "launcher": {"node_rank": 1}}
    with workers_config(tmp_path, resolved, holder=False) as config_file:
        assert tmp_path not in config_file.parents
        assert yaml.safe_load(config_file.read_text()) == resolved
    assert not config_file.exists() and list(tmp_path.iterdir()) == []
    with workers_config(tmp_path, resolved, holder=True) as config_file:
        assert config_file == tmp_path / "config.yaml"  # the holder wrote it (run records)


def test_the_workers_log_folder_is_made_when_they_start(tmp_path):
    """Not when the launcher is configured (before the rendezvous): torch elastic's own log
    specs make the folder in their constructor."""
    from torch.distributed.elastic.multiprocessing import Std

    from rapidformer.runtime.launch import logs_at_start

    folder = tmp_path / "run" / "logs" / "node1"
    specs = logs_at_start(folder, redirects=Std.ALL, tee={0: Std.ALL})
    assert not (tmp_path / "run").exists()
    destinations = specs.reify({0: {"TORCHELASTIC_RUN_ID": "job",
                                    "TORCHELASTIC_RESTART_COUNT": "0"}})
    assert folder.is_dir() and str(folder) in destinations.stdouts[0]


REPO = Path(__file__).resolve().parents[1]
OWN_LOOP = (REPO / "examples" / "own_loop.py").read_text()


def test_the_seeds_own_loop_on_two_processes(tmp_path, pairs_dir, tiny_pretrained):
    import json

    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP)
    run = tmp_path / "run"
    assert_ok(run_cli([*SMALL, "launcher.nproc_per_node=2", f"user_script={script}", "model=hf",
                 f"model.name_or_path={tiny_pretrained}", "data=pairs_local",
                 f"data.path={pairs_dir}", f"trainer.output_dir={run}"], cwd=tmp_path))
    result = json.loads((run / "own_loop.json").read_text())
    assert result["world_size"] == 2
    assert result["scored"] == 64  # every validation example scored once across both ranks
    assert result["batches"] == 256 // 2 // 8  # each rank reads its half of the data
    assert all(loss == loss for loss in result["losses"]) and 0 <= result["accuracy"] <= 1


@pytest.mark.parametrize("env, held, writes", [
    ({"RANK": "1"}, False, False),  # torchrun's or srun's other ranks: started at once
    ({"RANK": "0"}, True, True),
    ({}, False, False),  # a later node's launcher: its workers read a copy of its own
    ({}, True, True),
])
def test_only_the_holder_or_a_launcher_writes_the_run_records(tmp_path, monkeypatch, env, held,
                                                              writes):
    """Under torchrun every rank starts at once: a rank other than 0 that wrote config.yaml
    and environment.json before rank 0 claimed the directory made rank 0 refuse it as holding
    files no rapidformer run wrote (seen as an intermittent failure of
    test_torchrun_runs_in_place)."""
    from rapidformer.cli.hydra_main import write_run_records
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    monkeypatch.delenv("RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    resolved, cfg = settle(compose(["trainer.device=cpu"]), str(tmp_path))
    write_run_records(str(tmp_path), resolved, cfg, held)
    assert (tmp_path / "config.yaml").is_file() == writes
    assert (tmp_path / "environment.json").is_file() == writes
