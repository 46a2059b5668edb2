"""Real training runs through the real CLI (`python -m rapidformer`), on tiny models and data."""
from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import (FAST, assert_ok, read_metrics, run_cli, run_here, run_in_process,
                            train_losses)

pytestmark = pytest.mark.slow


def test_quickstart_default_command(tmp_path):
    """`python -m rapidformer` with nothing else but half its epochs (2 of 4, measured:
    validation accuracy 0.89 after the first, 0.94 after both; 0.9975 after all 4): accuracy
    >= 0.9 and every artifact on disk."""
    run = tmp_path / "run"
    assert_ok(run_cli([f"trainer.output_dir={run}", "trainer.progress_bar=false",
                       "trainer.epochs=2"], cwd=tmp_path))
    metrics = read_metrics(run)
    evals = [m for m in metrics if "validation/accuracy" in m]
    assert evals[-1]["validation/accuracy"] >= 0.9, evals
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s",
            "tflops_per_device"} <= set(metrics[0])
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert (run / "config.yaml").is_file() and (run / "data" / "train.jsonl").is_file()
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert checkpoints and (checkpoints[-1] / "COMPLETE.json").is_file()
    environment = json.loads((run / "environment.json").read_text())  # what reproduces it
    assert environment["versions"]["torch"] == torch.__version__
    assert environment["seed"] == 42 and environment["deterministic"] is False
    head = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert environment["git"]["commit"] == (head or None)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    batch = tokenizer(["the doctor bought a car yesterday ."], ["the physician bought a car "
                      "yesterday ."], return_tensors="pt")
    assert model(**batch).logits.shape == (1, 2)


def test_loss_falls_in_every_precision(tmp_path, capsys, monkeypatch):
    """fp32, bf16 and fp16 (dynamic loss scaling) each memorize a small set."""
    small = [*FAST, "data.synthetic_train_size=32", "trainer.epochs=25", "trainer.lr=1e-3",
             "scheduler=constant", "trainer.save_interval=1000", "trainer.export_hf=false"]
    finals = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = tmp_path / precision
        code, printed = run_here([*small, f"precision={precision}", f"trainer.output_dir={run}"],
                                capsys, monkeypatch, tmp_path)
        assert code == 0, printed[-3000:]
        losses = train_losses(run)
        assert losses[25] < 0.5 * losses[1], (precision, losses)
        finals[precision] = losses
    records = read_metrics(tmp_path / "fp16")
    assert all("loss_scale" in r and "skipped_steps" in r for r in records if "loss" in r)
    # the first steps agree with fp32 within reduced-precision tolerance
    for precision in ("bf16", "fp16"):
        assert abs(finals[precision][1] - finals["fp32"][1]) < 2e-2


def test_resume_continues_with_the_same_losses(tmp_path, capsys, monkeypatch):
    """A run stopped at step 5 and resumed gives the uninterrupted run's per-step losses (in
    this process: the CLI's resume across processes is tests/test_preemption.py's)."""
    args = [*FAST, "trainer.epochs=2", "trainer.export_hf=false", "model.hidden_dropout=0.1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    outputs = {}
    for name, extra in {"whole": [f"trainer.output_dir={whole}"],
                        "first": [f"trainer.output_dir={parts}", "trainer.exit_interval=5"],
                        "second": [f"trainer.output_dir={parts}", "trainer.resume=auto"]}.items():
        code, outputs[name] = run_here([*args, *extra], capsys, monkeypatch, tmp_path)
        assert code == 0, outputs[name][-3000:]
        if name == "first":
            assert max(train_losses(parts)) == 5
    assert "trainer.exit_interval=5 reached at step 5" in outputs["first"]
    assert "resumed from" in outputs["second"]
    expected, got = train_losses(whole), train_losses(parts)
    assert sorted(got) == sorted(expected) == list(range(1, 17))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-6), step


def test_design_card_command_stops_with_one_clear_sentence(tmp_path):
    result = run_cli(["+recipe=bert_mrpc", "precision=fp16", "memory=zero3"], cwd=tmp_path)
    assert result.returncode == 2
    # on a CPU machine, offline: DeepSpeed has no fp16, and the hub's model and dataset are out
    # of reach; every problem at once, one line each (validate says the same)
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("rapidformer: the Hugging Face hub")]  # the offline note
    assert lines == [
        "rapidformer: recipe: bert_mrpc",
        "rapidformer: error: invalid config (3 problems):",
        "  - precision=fp16 with memory=zero3: DeepSpeed has no fp16 on a CPU; use precision=bf16 "
        "or fp32, or run on a GPU", lines[3], lines[4]]
    assert lines[3].startswith("  - cannot load the model 'bert-base-cased' (model.name_or_path)")
    assert lines[4].startswith("  - cannot load the dataset 'glue/mrpc' (data.path, data.subset)")
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "outputs").exists()  # refused before a run directory was made

    printed = assert_ok(run_cli(["+recipe=bert_mrpc", "precision=fp16", "memory=zero3", "--cfg", "job",
                           "--resolve"], cwd=tmp_path))
    assert "name: zero3" in printed.stdout and "dtype: fp16" in printed.stdout
    assert "name_or_path: bert-base-cased" in printed.stdout


def test_hub_names_offline_give_one_clear_sentence(tmp_path, monkeypatch, capsys):
    from tests.test_bad_input import call

    monkeypatch.chdir(tmp_path)
    code, err = call("rapidformer", ["+recipe=bert_mrpc"], capsys)
    # the model is looked up in the cache before the run starts (runtime/hub.py)
    assert code == 2 and "cannot load the model 'bert-base-cased'" in err
    assert "model=bert_tiny" in err and "Traceback" not in err
    assert not (tmp_path / "outputs").exists()
    # with a local model the hub dataset is what is missing: refused, and no directory left
    code, err = call("rapidformer", ["+recipe=bert_mrpc", "model=bert_tiny"], capsys)
    assert code == 2 and "cannot load the dataset 'glue/mrpc'" in err
    assert "data=pairs_local" in err and "Traceback" not in err
    assert not (tmp_path / "outputs").exists()


def test_bert_mrpc_recipe_on_local_data_and_config_model(tmp_path, pairs_dir):
    run = tmp_path / "run"  # in this process: the recipe is the subject, not the CLI's process
    run_in_process(["+recipe=bert_mrpc", "model=bert_tiny", "data=pairs_local",
                    f"data.path={pairs_dir}", "precision=bf16", "trainer.epochs=1",
                    "trainer.progress_bar=false", f"trainer.output_dir={run}"], cwd=tmp_path)
    assert (run / "hf_model" / "config.json").is_file()
    assert json.loads((run / "hf_model" / "config.json").read_text())["num_hidden_layers"] == 2


def test_missing_data_and_missing_column_fail_clearly(tmp_path, pairs_dir, capsys,
                                                       monkeypatch):
    """In this process, as tests/test_bad_input.py's cases: the refusal is the subject."""
    from tests.test_bad_input import call

    monkeypatch.chdir(tmp_path)
    code, stderr = call("rapidformer", ["data=pairs_local", f"data.path={tmp_path / 'nowhere'}"],
                        capsys)
    assert code == 2
    assert "data directory not found" in stderr and "Traceback" not in stderr
    code, stderr = call("rapidformer", ["data=pairs_local", f"data.path={pairs_dir}",
                                        "data.label_column=target"], capsys)
    assert code == 2
    assert "no column 'target' (data.label_column)" in stderr


COMPILE_ARGS = [*FAST, "trainer.train_iters=3", "trainer.export_hf=false"]


# in this process: the subject is what graph=compile computes, not the CLI's process (a
# subprocess per run paid the imports again)
@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("eager")
    run_in_process([*COMPILE_ARGS, f"trainer.output_dir={run}"], cwd=run)
    return train_losses(run)


@pytest.mark.parametrize("scope,log", [("blocks", "2 transformer blocks compiled (regional)"),
                                       ("auto", "the whole model compiled")])
def test_compile_gives_the_eager_losses(tmp_path, scope, log, eager_losses, capsys,
                                        monkeypatch):
    torch._dynamo.reset()  # a fresh compile, as in a process of its own: no graphs of others
    try:
        code, printed = run_here([*COMPILE_ARGS, "graph=compile", f"graph.scope={scope}",
                                  f"trainer.output_dir={tmp_path / 'compiled'}"], capsys,
                                 monkeypatch, tmp_path)
    finally:
        torch._dynamo.reset()  # and none left to the next tests of this process
    assert code == 0, printed[-3000:]
    assert f"graph=compile: {log}" in printed
    eager, compiled = eager_losses, train_losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], abs=1e-4)


REPO = Path(__file__).resolve().parents[1]
USER_SCRIPT = (REPO / "examples" / "finetuner_user_script.py").read_text()


def test_white_box_user_script(tmp_path, pairs_dir, tiny_pretrained):
    script = tmp_path / "my_finetuner.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    run = tmp_path / "run"  # in this process: the script's use of the engine is the subject
    run_in_process([f"user_script={script}", "model=hf", f"model.name_or_path={tiny_pretrained}",
                    "data=pairs_local", f"data.path={pairs_dir}", "data.max_seq_length=64",
                    *FAST, f"trainer.output_dir={run}"], cwd=tmp_path)
    evals = [m for m in read_metrics(run) if "validation/accuracy" in m]
    assert evals and evals[-1]["validation/seen"] == 64
    assert (run / "hf_model" / "config.json").is_file()
    assert train_losses(run)


def test_user_script_that_builds_no_engine(tmp_path, capsys, monkeypatch):
    """In this process, as tests/test_bad_input.py's cases: the refusal is the subject."""
    from tests.test_bad_input import call

    script = tmp_path / "empty.py"
    script.write_text("print('hello')\n")
    monkeypatch.chdir(tmp_path)
    code, stderr = call("rapidformer", [f"user_script={script}", *FAST], capsys)
    assert code == 2
    assert "finished without creating a RapidformerEngine" in stderr
    code, stderr = call("rapidformer", [f"user_script={tmp_path / 'nope.py'}", *FAST], capsys)
    assert code == 2 and "no such file" in stderr


def test_console_script_forwards_hydra_arguments(tmp_path):
    printed = assert_ok(run_cli(["+recipe=bert_mrpc", "--cfg", "job"], cwd=tmp_path,
                          module="rapidformer.cli.console"))
    assert "recipe: bert_mrpc" in printed.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_a_gpu(tmp_path, precision):
    run = tmp_path / precision
    assert_ok(run_cli([*FAST, "trainer.device=cuda", f"precision={precision}", "trainer.epochs=2",
                 f"trainer.output_dir={run}"], cwd=tmp_path))
    losses = train_losses(run)
    assert all(loss == loss for loss in losses.values())  # no NaN


def test_multirun_runs_every_job_and_summarizes(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "+recipe=quickstart", "precision=fp32,bf16", "trainer.lr=1e-3,-1",
                      *FAST, "trainer.train_iters=3", "trainer.export_hf=false",
                      f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]  # every job ran; two failed
    assert "rapidformer: sweep: 2 of 4 jobs did not succeed" in result.stderr
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(ok) == 2 and all(r["final_loss"] and r["samples_per_s"] for r in ok)
    assert len(failed) == 2 and all("trainer.lr=-1.0 must not be negative" in r["error"]
                                    for r in failed)
    assert "sweep summary (4 jobs, 2 failed)" in result.stderr  # where a run's summary is
    assert (sweep / "summary.md").read_text().startswith("| job | overrides | status")


def test_length_grouping_cuts_the_padding_that_is_computed(tmp_path, capsys, monkeypatch):
    args = [*FAST, "trainer.export_hf=false", "data.synthetic_train_size=512"]
    padding = {}
    for grouped in ("false", "true"):
        out = tmp_path / grouped
        code, printed = run_here([*args, f"data.group_by_length={grouped}",
                                  f"trainer.output_dir={out}"], capsys, monkeypatch, tmp_path)
        assert code == 0, printed[-3000:]
        records = [r for r in read_metrics(out) if "padding_frac" in r]
        padding[grouped] = sum(r["padding_frac"] for r in records) / len(records)
    assert padding["true"] < padding["false"] / 3, padding


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")])])
def test_deterministic_runs_repeat_their_losses_exactly(tmp_path, device):
    # on a GPU: bf16, and a model big enough for cuBLAS/atomic reductions to matter
    gpu = ["precision=bf16", "model.hidden_size=256", "model.num_layers=4",
           "model.num_attention_heads=4", "model.intermediate_size=1024"] if device == "cuda" \
        else []
    losses = []
    for attempt in ("a", "b"):
        run = tmp_path / attempt
        assert_ok(run_cli([*FAST, *gpu, f"trainer.device={device}", "trainer.deterministic=true",
                           "trainer.train_iters=6", "trainer.export_hf=false",
                           "trainer.save_last=false", f"trainer.output_dir={run}"], cwd=tmp_path))
        losses.append(train_losses(run))
        environment = json.loads((run / "environment.json").read_text())
        assert environment["deterministic"] is True and environment["seed"] == 42
    assert sorted(losses[0]) == list(range(1, 7))
    assert losses[0] == losses[1]  # bit for bit, dropout included
