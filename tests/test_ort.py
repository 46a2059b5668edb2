"""graph=ort: refused with the working versions named where torch is too new (the main
environment); in the ORT environment of the README (torch 2.6, onnxruntime-training 1.19.2),
real runs whose losses equal eager ones. There RAPIDFORMER_REQUIRE_ORT=1 turns a missing
onnxruntime into a failure instead of a skip, so CI cannot pass these tests by skipping them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rapidformer.accelerators.ort import TORCH_RANGE, torch_version
from tests.conftest import FAST, assert_ok, run_cli, run_here, train_losses

ORT_TORCH = TORCH_RANGE[0] <= torch_version() <= TORCH_RANGE[1]
REQUIRED = os.environ.get("RAPIDFORMER_REQUIRE_ORT") == "1"


def have_ort() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


needs_ort = pytest.mark.skipif(not REQUIRED and not (ORT_TORCH and have_ort()),
                               reason="graph=ort runs in its own environment (README)")
ARGS = [*FAST, "trainer.device=cpu", "trainer.export_hf=true", "trainer.epochs=1",
        "data.synthetic_train_size=128"]


@pytest.mark.skipif(ORT_TORCH, reason="torch is in onnxruntime-training's range here")
def test_graph_ort_names_the_torch_versions_it_works_with(tmp_path, capsys, monkeypatch):
    code, stderr = run_here(["graph=ort"], capsys, monkeypatch, tmp_path)
    assert code == 3
    assert "trains only with torch 2.4-2.6 (this environment: torch" in stderr
    assert "pip install torch==2.6.0" in stderr and "Traceback" not in stderr


def test_graph_ort_refuses_mixed_precision_and_sharding_before_work(tmp_path, capsys,
                                                                     monkeypatch):
    code, stderr = run_here(["graph=ort", "precision=bf16", "memory=zero2"], capsys, monkeypatch,
                            tmp_path)
    assert code == 2
    assert "graph=ort with precision=bf16" in stderr
    assert "graph=ort with memory=zero2" in stderr
    assert not (tmp_path / "outputs").exists()  # refused before a run directory was made


@pytest.fixture(scope="module")
def ort_one_process(tmp_path_factory) -> tuple[Path, str]:
    """The real CLI with graph=ort on one process: its run directory and its log. The first
    graph=ort run of an environment compiles ORTModule's CPU extensions (most of its time)."""
    assert ORT_TORCH and have_ort(), "RAPIDFORMER_REQUIRE_ORT=1 but no usable onnxruntime"
    cwd = tmp_path_factory.mktemp("ort_one_process")
    result = assert_ok(run_cli([*ARGS, "graph=ort", f"trainer.output_dir={cwd / 'run'}"],
                               cwd=cwd, timeout=900))
    return cwd / "run", result.stdout + result.stderr


@needs_ort
@pytest.mark.slow
def test_ort_trains_like_eager_and_exports(tmp_path, capsys, monkeypatch, ort_one_process):
    run, log = ort_one_process
    assert "graph=ort: ORTModule wraps the model" in log
    assert "[orttraining]" in log and "[export]" in log  # ONNX Runtime exported the model
    # the eager reference needs no CLI of its own: in this process
    eager = tmp_path / "eager"
    code, stderr = run_here([*ARGS, "trainer.export_hf=false", f"trainer.output_dir={eager}"],
                            capsys, monkeypatch, tmp_path)
    assert code == 0, stderr[-3000:]
    expected, got = train_losses(eager), train_losses(run)
    assert sorted(got) == sorted(expected) and len(got) >= 4
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), step
    assert (run / "hf_model" / "config.json").is_file()


@needs_ort
@pytest.mark.slow
def test_ort_on_two_processes_gives_the_one_process_losses(tmp_path, ort_one_process):
    """DDP around ORTModule (gloo): the gradients are averaged as in eager DDP."""
    assert_ok(run_cli([*ARGS, "graph=ort", "trainer.export_hf=false", "launcher.nproc_per_node=2",
                       f"trainer.output_dir={tmp_path / 'two'}"], cwd=tmp_path, timeout=900))
    one, two = train_losses(ort_one_process[0]), train_losses(tmp_path / "two")
    assert sorted(one) == sorted(two) and len(one) >= 4
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, abs=1e-4), step
