"""Sweeps and clusters through Hydra's plugins: an Optuna search (3 trials on CPU) and the
Slurm launcher (composed with a job's Slurm environment; run through submitit's local
executor, the same code path a Slurm job takes minus sbatch)."""
from __future__ import annotations

import json

import pytest
import yaml

TINY = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=2",
        "data.synthetic_train_size=192", "data.synthetic_eval_size=64", "trainer.epochs=1",
        "trainer.export_hf=false"]


def multirun(argv):
    from rapidformer import __main__ as module_main

    module_main.main(argv)


def test_optuna_sweep_runs_three_trials_and_records_the_best(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    multirun(["+recipe=quickstart_optuna", "-m", "hydra.sweeper.n_trials=3", *TINY,
              f"hydra.sweep.dir={tmp_path}"])
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok"] * 3
    values = [r["value"] for r in rows]
    assert all(0 <= v <= 1 for v in values) and rows[0]["metric"] == "validation/accuracy"
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(values))
    assert 1e-4 <= best["best_params"]["trainer.lr"] <= 3e-3
    assert 0 <= best["best_params"]["scheduler.warmup_fraction"] <= 0.2
    lrs = {yaml.safe_load((tmp_path / r["job"] / ".hydra" / "overrides.yaml").read_text())[0]
           for r in rows}
    assert len(lrs) == 3  # three different learning rates were tried
    summary = (tmp_path / "summary.md").read_text()
    assert "![loss](plots/loss.png)" in summary and (tmp_path / "plots" / "loss.png").is_file()


def test_slurm_launcher_composes_one_task_per_node_and_reads_slurm_env(monkeypatch, capsys):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_module

    from rapidformer.config.compose import check_overrides, resolve

    overrides = check_overrides(["+recipe=quickstart", "launcher=slurm", "launcher.nnodes=4",
                                 "launcher.nproc_per_node=8", "trainer.global_batch_size=1024",
                                 "hydra.launcher.partition=gpu"])
    with initialize_config_module("rapidformer.conf", version_base="1.3"):
        composed = compose("config", overrides, return_hydra_config=True)
    launcher = composed.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 1, 8)
    assert launcher.partition == "gpu"
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09,12]")
    monkeypatch.setenv("SLURM_NODEID", "2")
    _, cfg = resolve(composed)
    assert (cfg.launcher.node_rank, cfg.launcher.master_addr) == (2, "gpu07")


def test_slurm_job_runs_through_submitit(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    # `-m` is added by rapidformer; submitit's local executor stands in for sbatch
    multirun(["launcher=slurm", "launcher.nproc_per_node=1", "hydra/launcher=submitit_local",
              *TINY, f"hydra.sweep.dir={tmp_path}"])
    (row,) = json.loads((tmp_path / "summary.json").read_text())
    assert row["status"] == "ok" and row["final_loss"] > 0
    assert list((tmp_path / ".submitit").glob("*/*_result.pkl"))


def test_a_sweep_of_deepspeed_jobs_runs_every_job_in_one_process(tmp_path):
    """Hydra runs a sweep's jobs one after another in this process: each job's DeepSpeed must
    find a live process group, not the one the previous job destroyed."""
    multirun(["-m", "memory=zero2", "precision=bf16,fp32", *TINY,
              "trainer.micro_batch_size=16", "trainer.global_batch_size=16",
              f"hydra.sweep.dir={tmp_path}"])
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok"], rows


def test_a_sweep_with_a_failed_job_runs_every_job_and_exits_non_zero(tmp_path, capsys):
    from rapidformer.cli.multirun import EXIT_SWEEP_FAILED

    with pytest.raises(SystemExit) as exited:  # the failing job first: the sweep goes on
        multirun(["-m", "trainer.lr=-1,1e-3", *TINY, "trainer.train_iters=2",
                  f"hydra.sweep.dir={tmp_path}"])
    assert exited.value.code == EXIT_SWEEP_FAILED != 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["failed", "ok"], rows
    assert rows[1]["final_loss"] > 0
    error = rows[0]["error"]
    assert "trainer.lr=-1" in error and "must not be negative" in error and "\n" not in error
    summary = (tmp_path / "summary.md").read_text()
    assert f"| FAILED: {error} |" in summary
    out, err = capsys.readouterr()
    assert f"| FAILED: {error} |" in err  # the table beside the sweep's own lines (stderr)
    assert "rapidformer: sweep: 1 of 2 jobs did not succeed (job 0: failed)" in err
