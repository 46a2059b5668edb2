"""Bad configs fail before any work, every problem listed at once, each with a fix."""
from __future__ import annotations

import pytest

from rapidformer.config.compose import compose, resolve
from rapidformer.errors import ConfigError
from tests.conftest import run_cli

BAD = [
    (["trainer.lrr=0.1"], ["trainer.lrr: unknown key; did you mean 'trainer.lr'?"]),
    (["+trainer.micro_bach_size=8"], ["did you mean 'trainer.micro_batch_size'?"]),
    (["traner.lr=0.1"], ["traner: unknown key; did you mean 'trainer'?"]),
    (["precision=fp17"], ["precision=fp17: no such option; did you mean 'precision=fp16'?",
                          "fp32"]),
    (["+recipe=bert_mrcp"], ["did you mean 'recipe=bert_mrpc'?"]),
    (["trainer.lr.value=1"], ["'trainer.lr' is a value, not a group of keys"]),
    (["trainer.micro_batch_size=abc"], ["trainer.micro_batch_size: expected an integer, got 'abc'"]),
    (["trainer.deterministic=maybe"], ["trainer.deterministic: expected true or false"]),
    (["trainer.lr=-0.1"], ["trainer.lr=-0.1 must not be negative"]),
    (["trainer.global_batch_size=60", "trainer.micro_batch_size=16"],
     ["trainer.global_batch_size=60 is not a multiple of trainer.micro_batch_size (16)",
      "e.g. trainer.global_batch_size=64"]),
    (["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=0 must be a positive integer"]),
    (["trainer.epochs=null", "trainer.train_iters=null"], ["set one of them"]),
    (["scheduler.warmup_fraction=1.5"], ["scheduler.warmup_fraction=1.5 must be in [0, 1)"]),
    (["scheduler.min_lr=1.0"], ["scheduler.min_lr=1.0 is above trainer.lr"]),
    (["model.hidden_size=65"], ["model.hidden_size=65 is not divisible by model.num_attention_heads=4"]),
    (["data.max_seq_length=512"], ["data.max_seq_length=512 is above model.max_position_embeddings=128"]),
    (["model=hf"], ["model.name_or_path must be set"]),
    (["data=pairs_local"], ["data.path must be set"]),
    (["optim.fused=yes"], ["optim.fused: expected one of 'auto', 'on', 'off'"]),
    (["parallelism.tensor_model_parallel_size=2"],
     ["needs a Megatron model, but model=bert_tiny is a Hugging Face model"]),
    (["task.num_labels=1"], ["task.num_labels=1 must be at least 2"]),
    (["graph=compile", "graph.options=3"], ["graph.options: expected a mapping, got 3"]),
    (["graph=compile", "graph.mode=max-autotune", "graph.options.coordinate_descent_tuning=true"],
     ["torch.compile takes a mode or inductor options, not both"]),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_refused_with_a_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        resolve(compose(overrides), output_dir="out")
    for text in expected:
        assert text in str(info.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        compose(["trainer.lrr=1", "trainer.epocs=2", "precision=fp17"])
    assert len(info.value.problems) == 3
    assert "3 problems" in str(info.value)


def test_value_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        resolve(compose(["trainer.lr=-1", "trainer.micro_batch_size=0", "model.hidden_size=65"]),
                output_dir="out")
    assert len(info.value.problems) == 3


def test_cli_refuses_bad_config_without_traceback(tmp_path):
    result = run_cli(["trainer.lrr=0.1", "trainer.micro_batch_size=abc"], cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown key; did you mean 'trainer.lr'?" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "outputs").exists()  # nothing was started


def test_cli_refuses_a_type_error_found_after_composition(tmp_path):
    result = run_cli(["trainer.micro_batch_size=abc"], cwd=tmp_path)
    assert result.returncode == 2
    assert "trainer.micro_batch_size: expected an integer, got 'abc'" in result.stderr
    assert "Traceback" not in result.stderr
