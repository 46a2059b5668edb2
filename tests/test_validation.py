"""Bad configs fail before any work, every problem listed at once, each with a fix."""
from __future__ import annotations

import pytest

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
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
        settle(compose(overrides), output_dir="out")
    for text in expected:
        assert text in str(info.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        compose(["trainer.lrr=1", "trainer.epocs=2", "precision=fp17"])
    assert len(info.value.problems) == 3
    assert "3 problems" in str(info.value)


def test_value_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        settle(compose(["trainer.lr=-1", "trainer.micro_batch_size=0", "model.hidden_size=65"]),
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


# --- numbers out of range: every key, its value, its range and a fix, all at once ---------------

def test_out_of_range_numbers_are_all_reported_with_range_and_fix():
    with pytest.raises(ConfigError) as info:
        settle(compose(["optim.beta1=1.5", "optim.eps=-1", "model.initializer_range=-1"]),
                output_dir="out")
    assert sorted(info.value.problems) == [
        "model.initializer_range=-1.0 must be positive (the standard deviation of the initial "
        "weights); set e.g. model.initializer_range=0.02",
        "optim.beta1=1.5 must be in [0, 1) (AdamW's decay rate of the gradient average); set e.g. "
        "optim.beta1=0.9",
        "optim.eps=-1.0 must be positive (added to AdamW's denominator); set e.g. optim.eps=1e-8"]


def _numeric_keys() -> list[str]:
    import dataclasses
    import typing

    from rapidformer.config.schema import GROUPS, RunConfig

    keys = []
    for group in GROUPS:
        cls = typing.get_type_hints(RunConfig)[group]
        for name, tp in typing.get_type_hints(cls).items():
            if {int, float} & {tp, *typing.get_args(tp)} and \
                    name in {f.name for f in dataclasses.fields(cls)}:
                keys.append(f"{group}.{name}")
    return keys


def test_every_number_of_the_schema_has_its_range_checked():
    from rapidformer.config.bounds import BOUNDS

    # checked against other keys: the shortest sample and the positions (max_seq_length), the
    # nodes (node_rank); any integer seeds Python's random (synthetic_seed)
    elsewhere = {"data.max_seq_length", "launcher.node_rank", "data.synthetic_seed"}
    assert set(_numeric_keys()) - elsewhere == set(BOUNDS)


def _outside(bound, integer: bool) -> list:
    values = []
    if bound.low is not None:
        values.append(bound.low if bound.low_open else bound.low - 1)
    if bound.high is not None:
        values.append(bound.high if bound.high_open else bound.high + 1)
    return [int(v) if integer else float(v) for v in values]


def test_each_bound_refuses_the_values_beyond_its_ends_and_suggests_a_value_inside():
    """In-process over every key of BOUNDS: each end of each range, one key at a time."""
    import dataclasses
    import typing

    from rapidformer.config.bounds import BOUNDS
    from rapidformer.config.validate import check_values

    _, good = settle(compose([]), output_dir="out")
    assert check_values(good) == []
    for key, bound in BOUNDS.items():
        group, name = key.split(".")
        tp = typing.get_type_hints(type(getattr(good, group)))[name]
        integer = int in (tp, *typing.get_args(tp))
        example = (int if integer else float)(bound.example)
        assert bound.holds(example), key
        for value in _outside(bound, integer):
            bad = dataclasses.replace(good, **{group: dataclasses.replace(
                getattr(good, group), **{name: value})})
            mine = [p for p in check_values(bad) if p.startswith(f"{key}={value} must ")]
            assert len(mine) == 1, (key, value, check_values(bad))
            assert mine[0].endswith(f"; set e.g. {key}={bound.example}"), mine[0]


def test_ranges_that_allow_null_say_what_null_does():
    with pytest.raises(ConfigError) as info:
        settle(compose(["memory=auto", "memory.device_memory_gb=0", "trainer.keep_last=-1"]),
                output_dir="out")
    assert sorted(info.value.problems) == [
        "memory.device_memory_gb=0.0 must be positive or null (the detected GPU's memory); set "
        "e.g. memory.device_memory_gb=80",
        "trainer.keep_last=-1 must not be negative (0 keeps every checkpoint); set e.g. "
        "trainer.keep_last=2"]
    _, cfg = settle(compose(["trainer.keep_last=0"]), output_dir="out")  # 0: keep them all
    assert cfg.trainer.keep_last == 0


def test_an_unknown_compile_mode_is_refused_with_the_modes_torch_has(monkeypatch):
    from rapidformer.config import validate

    # the installed torch's list (its import takes seconds): one with a mode of a newer torch
    monkeypatch.setattr(validate, "compile_modes", lambda: [*validate.COMPILE_MODES, "lite"])
    _, cfg = settle(compose(["graph=compile", "graph.mode=lite"]), output_dir="out")
    assert cfg.graph.mode == "lite"
    with pytest.raises(ConfigError) as info:
        settle(compose(["graph=compile", "graph.mode=max-autotun"]), output_dir="out")
    text = str(info.value)
    assert "graph.mode=max-autotun is not a torch.compile mode; did you mean " \
           "graph.mode=max-autotune" in text
    assert "reduce-overhead" in text and "or graph.mode=null" in text


# --- data.max_seq_length: room for a sample's special tokens and text ---------------------------

@pytest.mark.parametrize("length", [1, 2])
def test_a_sequence_too_short_for_the_special_tokens_is_refused(length):
    """The tokenizer does not cut a pair to 1 or 2 tokens: it leaves it whole (27 tokens a
    sample), and longer texts then overflow the position embeddings."""
    with pytest.raises(ConfigError) as info:
        settle(compose([f"data.max_seq_length={length}"]), output_dir="out")
    assert info.value.problems == [
        f"data.max_seq_length={length} must be at least 8: a task=sequence_classification "
        f"sample is [CLS] text_a [SEP] text_b [SEP], and a limit with no room for its special "
        f"tokens and some text of each part is not applied (the tokenizer leaves the text whole, "
        f"longer than the limit); set e.g. data.max_seq_length=128"]
    _, cfg = settle(compose(["data.max_seq_length=8"]), output_dir="out")
    assert cfg.data.max_seq_length == 8


def test_a_question_answering_window_keeps_room_for_question_and_new_context():
    squad = ["+recipe=bert_squad", "model=bert_tiny", "data=synthetic", "data.max_seq_length=64"]
    with pytest.raises(ConfigError) as info:
        settle(compose([*squad, "task.doc_stride=60"]), output_dir="out")
    assert "task.doc_stride=60 must be positive and below data.max_seq_length=64 - 4 = 60" \
        in str(info.value)
    assert "set e.g. task.doc_stride=16" in str(info.value)
    _, cfg = settle(compose([*squad, "task.doc_stride=59"]), output_dir="out")
    assert cfg.task.doc_stride == 59
