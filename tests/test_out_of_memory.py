"""A run whose device runs out of memory mid-run: one message with torch's words, the memory
plan's command and what lowers a run's memory, exit code 5, status.json "failed", and no
traceback (RAPIDFORMER_DEBUG=1 keeps it)."""
from __future__ import annotations

import json

import pytest
import torch

from rapidformer.errors import out_of_memory
from tests.conftest import FAST
from tests.test_bad_input import call

TORCH_WORDS = ("CUDA out of memory. Tried to allocate 15.66 GiB. GPU 0 has a total capacity of "
               "79.19 GiB of which 3.12 GiB is free. Including non-PyTorch memory, this process "
               "has 76.06 GiB memory in use. Of the allocated memory 74.1 GiB is allocated by "
               "PyTorch")


@pytest.mark.parametrize("exc, found", [
    (torch.OutOfMemoryError(TORCH_WORDS), True),
    (RuntimeError(TORCH_WORDS), True),  # older paths raise a RuntimeError with torch's words
    (RuntimeError("shape mismatch"), False),
    (ValueError(""), False),
])
def test_what_is_taken_for_out_of_memory(exc, found):
    error = out_of_memory(exc)
    assert (error is not None) == found
    if found:
        said = str(error)
        assert said.startswith("out of GPU memory (CUDA out of memory. Tried to allocate "
                               "15.66 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                               "3.12 GiB is free)")
        assert "rapidformer plan" in said and "memory=auto" in said
        assert "trainer.checkpoint_activations=true" in said and error.exit_code == 5


def test_a_run_out_of_memory_ends_with_one_message_and_exit_code_5(tmp_path, capsys,
                                                                     monkeypatch):
    from rapidformer.templates.finetuner import Finetuner

    calls = []
    step = Finetuner._forward_step

    def runs_out(self, batches, model):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError(TORCH_WORDS)
        return step(self, batches, model)

    monkeypatch.setattr(Finetuner, "_forward_step", runs_out)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code, stderr = call("rapidformer", [*FAST, f"trainer.output_dir={run}"], capsys)
    assert code == 5, stderr
    assert "rapidformer: error: out of GPU memory (CUDA out of memory. Tried to allocate" in stderr
    assert "Traceback" not in stderr and "HYDRA_FULL_ERROR" not in stderr
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "out of GPU memory" in status["error"]


@pytest.mark.parametrize("memory_gb, warned", [(1.6, True), (80.0, False), (None, False)])
def test_a_run_whose_mode_the_plan_says_does_not_fit_is_warned_at_its_start(memory_gb, warned):
    """1.6 GB less the reserve leaves about 20 MB, under the tiny BERT's estimate at a micro
    batch of 32 x 128 tokens; without a GPU or memory.device_memory_gb nothing is known."""
    from rapidformer.config.compose import compose
    from rapidformer.planning.memory_plan import over_device
    from rapidformer.preflight import settle

    given = [] if memory_gb is None else [f"memory.device_memory_gb={memory_gb}"]
    cfg = settle(compose(["trainer.device=cpu", "data.max_seq_length=128",
                          "trainer.micro_batch_size=32", *given]), "out")[1]
    said = over_device(cfg)
    assert bool(said) == warned
    if warned:
        assert said.startswith("the memory plan estimates 0.0") and "memory mode none" in said
        assert "over the 0.020 GB usable of 1.6 GB (memory.device_memory_gb)" in said
        assert "longest batches may not fit; no memory mode fits this device" in said
        assert "out of memory" not in said  # what a search reads as a child's failure


def test_the_start_s_warning_never_stops_a_run(monkeypatch):
    """Nothing for a user_script (its own model and data), and a plan that cannot be made
    (a model the planner cannot build) says nothing instead of failing the run."""
    from dataclasses import replace

    from rapidformer.config.compose import compose
    from rapidformer.planning import memory_plan
    from rapidformer.preflight import settle

    cfg = settle(compose(["trainer.device=cpu", "data.max_seq_length=128",
                          "trainer.micro_batch_size=32", "memory.device_memory_gb=1.6"]),
                 "out")[1]
    assert memory_plan.over_device(cfg)
    assert memory_plan.over_device(replace(cfg, user_script="train.py")) == ""

    def unplannable(_cfg):
        raise ValueError("Column 'sentence1' doesn't exist.")

    monkeypatch.setattr(memory_plan, "model_shape", unplannable)
    assert memory_plan.over_device(cfg) == ""


@pytest.mark.parametrize("given, warned", [
    (["memory.device_memory_gb=1.6"], True),
    # memory=auto's mode was held to the plan (at 1.619 GB the plan's mode fits): no warning
    (["memory=auto", "memory.device_memory_gb=1.619"], False),
])
def test_the_start_warns_once_about_a_mode_given_by_hand(tmp_path, capsys, monkeypatch, given,
                                                         warned):
    monkeypatch.chdir(tmp_path)
    code, stderr = call("rapidformer", [*FAST, "trainer.epochs=null", "trainer.train_iters=1",
                                        "data.max_seq_length=128", "trainer.micro_batch_size=32",
                                        *given,
                                        f"trainer.output_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, stderr
    logged = (tmp_path / "run" / "rapidformer.log").read_text()
    assert logged.count("longest batches may not fit") == (1 if warned else 0)
