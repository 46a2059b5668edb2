"""graph=ort: refused with the working versions named where torch is too new (the main
environment); in the ORT environment of the README (torch 2.6, onnxruntime-training 1.19.2),
real runs whose losses equal eager ones. There RAPIDFORMER_REQUIRE_ORT=1 turns a missing
onnxruntime into a failure instead of a skip, so CI cannot pass these tests by skipping them."""
from __future__ import annotations

import os

import pytest

from rapidformer.accelerators.ort import TORCH_RANGE, torch_version
from tests.conftest import FAST, assert_ok, run_cli, train_losses

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
def test_graph_ort_names_the_torch_versions_it_works_with(tmp_path):
    result = run_cli(["graph=ort"], cwd=tmp_path)
    assert result.returncode == 3
    assert "trains only with torch 2.4-2.6 (this environment: torch" in result.stderr
    assert "pip install torch==2.6.0" in result.stderr and "Traceback" not in result.stderr


def test_graph_ort_refuses_mixed_precision_and_sharding_before_work(tmp_path):
    result = run_cli(["graph=ort", "precision=bf16", "memory=zero2"], cwd=tmp_path)
    assert result.returncode == 2
    assert "graph=ort with precision=bf16" in result.stderr
    assert "graph=ort with memory=zero2" in result.stderr


@needs_ort
def test_ort_trains_like_eager_and_exports(tmp_path):
    assert ORT_TORCH and have_ort(), "RAPIDFORMER_REQUIRE_ORT=1 but no usable onnxruntime"
    assert_ok(run_cli([*ARGS, f"trainer.output_dir={tmp_path / 'eager'}"], cwd=tmp_path))
    ort = assert_ok(run_cli([*ARGS, "graph=ort", f"trainer.output_dir={tmp_path / 'ort'}"],
                            cwd=tmp_path, timeout=900))
    log = ort.stdout + ort.stderr
    assert "graph=ort: ORTModule wraps the model" in log
    assert "[orttraining]" in log and "[export]" in log  # ONNX Runtime exported the model
    expected, got = train_losses(tmp_path / "eager"), train_losses(tmp_path / "ort")
    assert sorted(got) == sorted(expected) and len(got) >= 4
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), step
    assert (tmp_path / "ort" / "hf_model" / "config.json").is_file()


@needs_ort
def test_ort_on_two_processes_gives_the_one_process_losses(tmp_path):
    """DDP around ORTModule (gloo): the gradients are averaged as in eager DDP."""
    args = [*ARGS, "graph=ort", "trainer.export_hf=false"]
    assert_ok(run_cli([*args, f"trainer.output_dir={tmp_path / 'one'}"], cwd=tmp_path,
                      timeout=900))
    assert_ok(run_cli([*args, "launcher.nproc_per_node=2", f"trainer.output_dir={tmp_path / 'two'}"],
                      cwd=tmp_path, timeout=900))
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(one) == sorted(two)
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, abs=1e-4), step
