"""accelerate=auto (rapidformer/tuning/): the candidates and their refusals, the choice by time
to result on given measurements, the loss check, and real searches on the CPU through the CLI
(a crashing, a hanging and a diverging candidate each cost themselves only; a search that
writes tuning.json and trains with its choice; the cache on a second run)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from rapidformer.config.compose import check_overrides, compose, with_default_recipe
from rapidformer.errors import ConfigError, InputError
from rapidformer.preflight import settle
from rapidformer.tuning import cache
from rapidformer.tuning.enumerate import candidates
from rapidformer.tuning.measure import Measurement, child_overrides, summarize
from rapidformer.tuning.pick import choose, judge, loss_check, time_to_result
from rapidformer.tuning.space import REFERENCE, Candidate, hand_picked

from tests.conftest import assert_ok, run_cli

CPU = torch.device("cpu")


def settled(*overrides: str):
    composed = compose(check_overrides(with_default_recipe(list(overrides))),
                       default_recipe=False)
    plain, cfg = settle(composed)
    return composed, plain, cfg


def search_space(*overrides: str):
    _, _, cfg = settled(*overrides)
    admitted, left_out, _ = candidates(cfg, CPU, memory_auto=False)
    return cfg, [a.candidate for a in admitted], {r["label"]: r["why"] for r in left_out}


# (overrides, labels that must be admitted, label -> words of its refusal)
TABLE = [
    (["accelerate=auto", "accelerate.max_candidates=40"],
     ["unpad", "bf16", "mbs=16", "compile", "unpad mbs=16"],
     {"packing": "task=sft", "fp8": "float8 tensor cores",
      "compile(reduce-overhead)": "not tried on a cpu", "liger": "not tried on a cpu"}),
    # packing trains other examples a step, in a run of steps as in one of epochs (tests/
    # test_tuning_review.py): listed, not measured
    (["+recipe=llama_sft", "trainer.train_iters=50", "accelerate=auto",
      "accelerate.max_candidates=40"],
     ["bf16"],
     {"unpad": "trainer.unpad=true with task=sft", "fp8": "float8 tensor cores",
      "packing": "the examples each of trainer.train_iters=50 steps trains on",
      # kernels=auto is liger for sft on a GPU: its other side, the model's own layers, is
      # the reference itself on a CPU
      "no kernels": "not tried on a cpu"}),
    (["+recipe=t5_summarize", "model=t5_tiny", "accelerate=auto", "accelerate.max_candidates=40"],
     ["bf16", "compile"],
     {"unpad": "trainer.unpad=true with task=seq2seq_lm", "packing": "task=seq2seq_lm"}),
]


@pytest.mark.parametrize("overrides,admitted,refused", TABLE)
def test_candidates_leave_out_what_the_refusal_pass_refuses(overrides, admitted, refused):
    cfg, found, left_out = search_space(*overrides)
    labels = [c.label for c in found]
    for label in admitted:
        assert label in labels, (label, labels)
    for label, words in refused.items():
        assert label not in labels
        assert words in left_out[label], (label, left_out.get(label))
    # nothing refused is tried: every admitted candidate settles as its run would
    for candidate in found:
        settle(compose(check_overrides(with_default_recipe(
            [*overrides, *candidate.override_list()])), default_recipe=False))
    # the global batch is kept whatever the micro batch
    global_batch = cfg.trainer.global_batch_size or cfg.trainer.micro_batch_size
    for candidate in found:
        given = dict(candidate.overrides)
        if "trainer.micro_batch_size" in given:
            assert given["trainer.global_batch_size"] == str(global_batch)


def test_candidates_are_ordered_by_prior_and_pruned():
    _, found, _ = search_space("accelerate=auto", "accelerate.max_candidates=3")
    # on a CPU unpadding (1.3) and a larger/smaller micro batch come before bf16 autocast (0.7)
    assert len(found) == 3
    assert found[0].label == "compile unpad"  # 1.3 x 1.1, the best prior
    assert all("bf16" not in c.label and "fp16" not in c.label for c in found)


@pytest.mark.parametrize("run_s, measured", [
    # length unknown, or a long run: the priors' order (CPU: unpad 1.3, compile 1.1, mbs x2 1.05)
    (None, ["compile unpad", "compile unpad mbs=16", "unpad", "unpad mbs=16", "compile",
            "compile unpad ckpt=true"]),
    (1e6, ["compile unpad", "compile unpad mbs=16", "unpad", "unpad mbs=16", "compile",
           "compile unpad ckpt=true"]),
    # 5 or 60 s of training cannot pay 25 s of compilation (25 + 60 / 1.43 > 60), and what the
    # priors call slower than the config as given (bf16 on a CPU, recompute) is not measured
    (5.0, ["unpad", "unpad mbs=16"]),
    (60.0, ["unpad", "unpad mbs=16"]),
    # 300 s: compiled and eager interleave by expected time (unpad 231 s, compile unpad 235 s;
    # compile unpad ckpt=true, 25 + 300 / 1.073 = 305 s, is out)
    (300.0, ["unpad", "compile unpad", "unpad mbs=16", "compile unpad mbs=16", "compile"]),
])
def test_with_the_run_s_length_known_candidates_are_ordered_by_expected_time(run_s, measured):
    _, _, cfg = settled("accelerate=auto", "accelerate.max_candidates=6")
    admitted, _, priors = candidates(cfg, CPU, memory_auto=False, run_s=run_s)
    assert [a.candidate.label for a in admitted] == measured
    assert set(priors) == set(measured)


@pytest.mark.parametrize("given, axes, run_s, measured", [
    # against a compiled config eager is the change to try (1 / 1.1 on a CPU, and none of
    # compile's 25 s once-cost): on a short run it is measured; on a long one compile pays
    (["graph=compile"], "[graph]", None, ["eager"]),
    (["graph=compile"], "[graph]", 5.0, ["eager"]),
    (["graph=compile"], "[graph]", 1e6, []),
    # against bf16 on a CPU (0.7), fp32 is faster (1 / 0.7) at any length
    (["precision=bf16"], "[precision]", 5.0, ["fp32"]),
    (["precision=bf16"], "[precision]", 1e6, ["fp32"]),
])
def test_priors_are_against_the_config_s_own_value(given, axes, run_s, measured):
    _, _, cfg = settled("accelerate=auto", *given, f"accelerate.axes={axes}")
    admitted, left_out, priors = candidates(cfg, CPU, memory_auto=False, run_s=run_s)
    assert [a.candidate.label for a in admitted] == measured, left_out
    relative = {"eager": round(1 / 1.1, 3), "fp32": round(1 / 0.7, 3)}
    assert priors == {label: relative[label] for label in measured}


def test_what_the_priors_expect_no_sooner_is_listed_not_measured():
    _, _, cfg = settled("accelerate=auto", "accelerate.max_candidates=6")
    admitted, left_out, _ = candidates(cfg, CPU, memory_auto=False, run_s=5.0)
    rows = {r["label"]: r["why"] for r in left_out}
    # bf16 on a CPU: 5 / 0.7 = 7.1 s against the config's 5 s
    assert rows["bf16"] == ("not measured: the priors expect 7.1 s to the result, the config "
                            "as given 5.0 s")
    assert sum("not measured" in why for why in rows.values()) == 12  # the 12 soonest listed
    assert not {a.candidate.label for a in admitted} & set(rows)


def fake_measure(rates: dict[str, float], wall_s: float = 5.0, tokens_per_step: float = 1000.0,
                 fixed_s: float = 4.0):
    """measure() without a child: each label's rate (the reference's second take, unless
    given, the reference's); 8 steps of steady windows."""
    def measure(run_overrides, candidate, steps, warmup, limit, work):
        label = candidate.label
        rate = rates[label if label in rates or not label.startswith("reference (")
                     else "reference"]
        window = tokens_per_step / rate
        rows = [{"loss": 1.0 - 0.01 * i, "window_s": window, "tokens_per_s": rate}
                for i in range(steps)]
        m = summarize(candidate, rows, warmup, fixed_s + steps * window, 0,
                      "training 40 iterations (20 per epoch, 1 micro-batches")
        return m
    return measure


def test_a_run_too_short_for_a_second_measurement_lists_hand_picked_candidates(monkeypatch,
                                                                               tmp_path):
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "measure", fake_measure({"reference": 10_000}))
    monkeypatch.setattr(search_module, "candidates", lambda *a, **k: pytest.fail("enumerated"))
    overrides = ["accelerate=auto", "accelerate.max_fraction=0.1", "accelerate.cache=false",
                 "accelerate.extra_candidates=['trainer.unpad=true']"]
    _, _, cfg = settled(*overrides)
    record = search_module.search(overrides, cfg, memory_auto=False)
    rows = {r["label"]: r for r in record["rows"]}
    assert record["choice"]["label"] == "reference"
    assert rows["trainer.unpad=true"]["why"].startswith("not measured: ")
    assert "left after the reference's measurement" in rows["trainer.unpad=true"]["why"]
    assert rows["every other candidate"]["why"].startswith("not enumerated: the run is estimated")
    # a reference that took longer than the whole budget: said so, not as a negative time left
    clock = iter([0.0] + [10_000.0] * 100)
    monkeypatch.setattr(search_module.time, "monotonic", lambda: next(clock))
    record = search_module.search(overrides, cfg, memory_auto=False)
    why = {r["label"]: r for r in record["rows"]}["trainer.unpad=true"]["why"]
    assert "the reference's measurement alone took" in why and "-" not in why.split("took")[1]


def test_batches_that_count_no_tokens_stop_the_search_with_one_message(monkeypatch):
    # a user_script whose collate returns tuples: the loop counts no tokens, the rate is 0
    from rapidformer.tuning import search as search_module

    def measure(run_overrides, candidate, steps, warmup, limit, work):
        rows = [{"loss": 1.0, "window_s": 0.1, "tokens_per_s": 0.0}] * steps
        return summarize(candidate, rows, warmup, 5.0, 0, "")

    monkeypatch.setattr(search_module, "measure", measure)
    overrides = ["accelerate=auto", "accelerate.cache=false"]
    _, _, cfg = settled(*overrides)
    with pytest.raises(InputError, match="counted no real tokens .* a dict with input_ids"):
        search_module.search(overrides, cfg, memory_auto=False)


def refused_before_measuring(monkeypatch, extra_candidates: str) -> ConfigError:
    """The error a search given these hand-picked candidates stops with, before measuring."""
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "measure", lambda *a, **k: pytest.fail("measured"))
    overrides = ["accelerate=auto", "accelerate.cache=false",
                 f"accelerate.extra_candidates={extra_candidates}"]
    _, _, cfg = settled(*overrides)
    with pytest.raises(ConfigError) as info:
        search_module.search(overrides, cfg, memory_auto=False)
    return info.value


@pytest.mark.parametrize("extra, words", [
    ("trainer.lr=1e-3,2e-3", "a comma (or a range) makes a list of values"),
    ("trainer.lr=abc", "trainer.lr: expected a number, got 'abc'"),
    ("trainer.micro_batch_size=2.5", "trainer.micro_batch_size: expected an integer, got 2.5"),
    ("data.max_seq_length=sixteen", "data.max_seq_length: expected an integer"),
    ("precision=bf17", "precision=bf17: no such option; did you mean 'precision=bf16'?"),
    ("trainer.nokey=2", "trainer.nokey: unknown key"),
    ("graph.options={a:1}x", "cannot parse override"),
])
def test_an_extra_candidate_no_run_could_take_stops_before_any_measurement(monkeypatch, extra,
                                                                          words):
    refused = refused_before_measuring(monkeypatch, f"['precision=bf16','{extra}']")
    assert refused.problems == [p for p in refused.problems
                                if p.startswith(f"accelerate.extra_candidates '{extra}': ")]
    assert words in str(refused)


@pytest.mark.parametrize("extra", [
    "optim.fused=off",  # Hydra reads off as a string (YAML 1.1 would read False)
    "trainer.tf32=null graph.mode=null",  # null (the measurement's own keys are refused)
    "graph=compile +graph.options.max_autotune=true", "graph.options={max_autotune:true}",
    "data.pad_to=[16,32]", "trainer.deterministic=true", "kernels=none", "precision=bf16",
    # (a Megatron split, data.split=98,1,1, is the run's data: refused, by its key and not as a
    # sweep, in tests/test_tuning_review.py)
])
def test_a_candidate_the_cli_takes_is_admitted(extra):
    from rapidformer.tuning.search import check_extra_candidates

    _, _, cfg = settled("accelerate=auto", "trainer.best_metric=validation/accuracy",
                        "trainer.early_stopping_patience=2", "data.max_seq_length=64",
                        f"accelerate.extra_candidates=[\"{extra}\"]")
    check_extra_candidates(cfg)  # nothing refused up front
    admitted, left_out, _ = candidates(cfg, CPU, memory_auto=False)
    assert extra in [a.candidate.label for a in admitted], left_out


def test_a_candidate_s_values_are_typed_as_the_cli_types_them():
    from rapidformer.tuning.space import apply

    _, _, cfg = settled()
    got = apply(cfg, Candidate("x", (("data.path", "123"), ("trainer.lr", "1e-3"),
                                     ("trainer.micro_batch_size", "16"))))
    assert (got.data.path, got.trainer.lr, got.trainer.micro_batch_size) == ("123", 1e-3, 16)
    with pytest.raises(ConfigError, match="trainer.lr: expected a number, got 'abc'"):
        apply(cfg, Candidate("x", (("trainer.lr", "abc"),)))
    with pytest.raises(ConfigError, match="a candidate sets one value"):
        apply(cfg, Candidate("x", (("trainer.lr", "1e-3,2e-3"),)))
    # what Hydra reads: off a string, null None, a list, a mapping
    got = apply(cfg, Candidate("x", (("optim.fused", "off"), ("graph.mode", "null"),
                                     ("data.pad_to", "[16,32]"),
                                     ("graph.options", "{max_autotune:true}"))))
    assert (got.optim.fused, got.graph.mode, got.data.pad_to, got.graph.options) == \
        ("off", None, [16, 32], {"max_autotune": True})


def test_a_packed_run_of_train_iters_is_its_steps_not_the_reference_s_tokens():
    ref = measured("reference", rate=1000, warmup_s=2.0)  # 1000 real tokens a step
    packed = measured("packing", rate=1000, warmup_s=2.0)
    packed.tokens_per_step = 1300.0  # a packed step holds more real tokens at the same rate
    assert time_to_result(packed, 10_000, 2) == pytest.approx(10)  # an epoch's tokens
    assert time_to_result(packed, 10_000, 2, run_steps=10) == pytest.approx(13)  # 10 steps
    assert time_to_result(ref, 10_000, 2, run_steps=10) == pytest.approx(10)


@pytest.mark.parametrize("rate, chosen", [(1020, "reference"), (1025, "reference"),
                                          (1100, "unpad")])
def test_a_candidate_replaces_the_config_only_when_clearly_sooner(rate, chosen):
    ref = measured("reference", rate=1000, warmup_s=2.0)
    other = measured("unpad", rate=rate, warmup_s=2.0)
    assert choose(judge(ref, [other], 100_000, 2, 0.1)).label == chosen


def test_the_memory_plan_leaves_out_what_does_not_fit():
    # 1.6 GB minus the 5 % and 1.5 GB reserve leaves ~20 MB: the reference's micro batch of 32
    # fits the tiny BERT, four times it at full length does not
    _, found, left_out = search_space(
        "accelerate=auto", "accelerate.max_candidates=40", "memory.device_memory_gb=1.6",
        "data.max_seq_length=128", "trainer.micro_batch_size=8", "trainer.global_batch_size=32",
        "accelerate.axes=[micro_batch_size]")
    labels = [c.label for c in found]
    assert "mbs=16" in labels
    assert "the memory plan estimates" in left_out["mbs=32"]


def test_axes_and_hand_picked_candidates_are_checked():
    with pytest.raises(ConfigError, match="no axis 'precison' \\(did you mean 'precision'\\?\\)"):
        settled("accelerate=auto", "accelerate.axes=[precison]")
    with pytest.raises(ConfigError, match="leaves no step"):
        settled("accelerate=auto", "accelerate.steps=3", "accelerate.warmup_steps=3")
    with pytest.raises(ConfigError, match="not an override"):
        hand_picked("precision")
    _, found, left_out = search_space(
        "accelerate=auto", "accelerate.max_candidates=0",
        "accelerate.extra_candidates=['trainer.micro_batch_size=3','precision=bf16 trainer.lr=1e-4']")
    assert [c.label for c in found] == ["precision=bf16 trainer.lr=1e-4"]
    assert "trainer.micro_batch_size=3" in left_out  # 32 is no multiple of 3: refused


def test_the_child_measures_the_run_as_given_with_the_candidate():
    run = ["+recipe=quickstart", "accelerate=auto", "accelerate.budget_s=10",
           "trainer.output_dir=/somewhere", "trainer.epochs=3", "hydra.run.dir=x", "precision=fp16",
           "precision.initial_scale=1024", "graph=compile", "graph.mode=max-autotune"]
    got = child_overrides(run, Candidate("bf16", (("precision", "bf16"),)), 5, "/tmp/c")
    # the candidate's group replaces the user's, sub-keys included (as the check applied it);
    # the other groups' keys stay
    assert got[:4] == ["+recipe=quickstart", "graph=compile", "graph.mode=max-autotune",
                       "precision=bf16"]
    assert not any(o.startswith(("precision=fp16", "precision.initial")) for o in got)
    assert "accelerate=none" in got and "trainer.train_iters=5" in got
    assert not any(o.startswith(("accelerate.", "hydra.run", "trainer.epochs")) for o in got)
    # and the same in the reproducing command, and the run that trains with the choice
    from rapidformer.tuning.search import command

    assert command(run, ["precision=bf16"]).endswith(
        "trainer.epochs=3 hydra.run.dir=x graph=compile graph.mode=max-autotune precision=bf16")
    unpad = child_overrides(run, Candidate("unpad", (("trainer.unpad", "true"),)), 5, "/tmp/c")
    assert "precision.initial_scale=1024" in unpad and "precision=fp16" in unpad
    # a measurement is no run of the user's MLflow experiment or W&B project
    logged = child_overrides([*run, "logger=mlflow", "logger.tracking_uri=sqlite:///m.db",
                              "+logger.extra=1"], Candidate("bf16", (("precision", "bf16"),)),
                             5, "/tmp/c")
    assert not any(o.lstrip("+").startswith(("logger.", "logger=mlflow")) for o in logged)
    assert logged.count("logger=tensorboard") == 1 and "trainer.tensorboard=false" in logged
    composed = compose(check_overrides([o for o in logged if not o.startswith("hydra.")]),
                       default_recipe=False)
    assert composed.logger.name == "tensorboard"


@pytest.mark.parametrize("where", ["cache_dir", "env"])
def test_a_cache_inside_the_run_s_folder_is_refused_before_the_search(tmp_path, monkeypatch,
                                                                       where):
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "measure", lambda *a, **k: pytest.fail("measured"))
    run = tmp_path / "run"
    overrides = ["accelerate=auto", f"trainer.output_dir={run}"]
    if where == "env":
        monkeypatch.setenv("RAPIDFORMER_TUNING_CACHE", str(run / "cache"))
    else:
        overrides.append(f"accelerate.cache_dir={run}/./tcache")
    _, _, cfg = settled(*overrides)
    with pytest.raises(ConfigError, match="is inside trainer.output_dir=.*accelerate.cache_dir "
                                          "to a folder outside it"):
        search_module.search(overrides, cfg, memory_auto=False)
    assert not run.exists()


def measured(label: str, rate: float, warmup_s: float, losses=(1.0, 0.9, 0.8, 0.7),
             status: str = "ok", fixed_s: float = 0.0) -> Measurement:
    # 2 warm-up steps of `warmup_s` in all, then 1000 real tokens a step at `rate`; the child
    # spent `fixed_s` outside its steps (start-up, evaluation)
    steps = [{"loss": loss, "window_s": warmup_s / 2 if i < 2 else 1000 / rate,
              "tokens_per_s": 1000 / (warmup_s / 2) if i < 2 else rate}
             for i, loss in enumerate(losses)]
    wall = fixed_s + sum(r["window_s"] for r in steps)
    m = summarize(Candidate(label), steps, 2, wall, 0, "")
    m.status = status
    return m


def test_the_choice_is_by_time_to_result_for_the_run_length():
    eager = measured("reference", rate=1000, warmup_s=2.2)  # steps of 1 s, warm-up 0.2 s extra
    compiled = measured("compile", rate=2000, warmup_s=60.5)  # twice as fast, 60 s to compile
    assert time_to_result(eager, 10_000, 2) == pytest.approx(0.2 + 10)
    assert time_to_result(compiled, 10_000, 2) == pytest.approx(59.5 + 5)
    short = judge(eager, [compiled], run_tokens=10_000, warmup_steps=2, tolerance=0.1)
    assert choose(short).label == "reference"  # 10 s of training does not pay 60 s
    long = judge(eager, [compiled], run_tokens=1_000_000, warmup_steps=2, tolerance=0.1)
    assert choose(long).label == "compile"  # 1000 s vs 560 s


@pytest.mark.parametrize("run_tokens, chosen", [(10_000, "reference"), (100_000, "reference"),
                                                (1_000_000, "cuda graphs")])
def test_what_a_child_spends_outside_its_steps_is_in_its_time_to_result(run_tokens, chosen):
    # both children start in 5 s; the graphed one's evaluation compiles and records its own
    # graphs: 80 s more after training, as a small encoder's compiled evaluation does
    eager = measured("reference", rate=1000, warmup_s=2.0, fixed_s=5.0)
    graphed = measured("cuda graphs", rate=3000, warmup_s=10.0, fixed_s=85.0)
    assert graphed.fixed_s == pytest.approx(85.0) and eager.fixed_s == pytest.approx(5.0)
    assert time_to_result(graphed, 30_000, 2) == pytest.approx(85 + (10 - 2 / 3) + 10)
    verdicts = judge(eager, [graphed], run_tokens=run_tokens, warmup_steps=2, tolerance=0.1)
    assert choose(verdicts).label == chosen  # eager: 5 + run/1000; graphed: 94.3 + run/3000


def test_the_loss_check_rejects_a_fast_candidate_that_trains_otherwise():
    ref = measured("reference", rate=1000, warmup_s=2)
    diverged = measured("fp16", rate=9000, warmup_s=2, losses=(1.0, 3.0, 9.0, 30.0))
    nan = measured("unpad", rate=9000, warmup_s=2, losses=(1.0, math.nan, 0.8, 0.7))
    close = measured("bf16", rate=1500, warmup_s=2, losses=(1.01, 0.92, 0.79, 0.71))
    crashed = Measurement(Candidate("mbs=64"), "out_of_memory", 3.0, reason="CUDA out of memory")
    verdicts = {v.label: v for v in judge(ref, [diverged, nan, close, crashed], 1e6, 2, 0.1)}
    assert not verdicts["fp16"].passed and "differs" in verdicts["fp16"].loss_check
    assert not verdicts["unpad"].passed and verdicts["unpad"].loss_check == "not finite"
    assert not verdicts["mbs=64"].passed and "out_of_memory" in verdicts["mbs=64"].why
    assert verdicts["bf16"].passed
    assert choose(list(verdicts.values())).label == "bf16"
    assert loss_check([1.0, 1.0], [1.05, 1.05], 0.1)[0]
    assert not loss_check([1.0, 1.0], [1.2, 1.2], 0.1)[0]


def test_the_cache_key_follows_model_data_hardware_and_versions(monkeypatch):
    _, plain, cfg = settled("accelerate=auto")
    key = cache.key_of(cache.key_fields(cfg, "cpu"))
    assert key == cache.key_of(cache.key_fields(cfg, "cpu"))
    _, plain2, cfg2 = settled("accelerate=auto", "data.max_seq_length=32")
    assert cache.key_of(cache.key_fields(cfg2, "cpu")) != key
    _, plain3, cfg3 = settled("accelerate=auto", "accelerate.budget_s=20")  # not in the key
    assert cache.key_of(cache.key_fields(cfg3, "cpu")) == key
    for longer in ("trainer.epochs=200", "trainer.train_iters=5000"):  # another time to result
        _, plain4, cfg4 = settled("accelerate=auto", longer)
        assert cache.key_of(cache.key_fields(cfg4, "cpu")) != key, longer
    # what trains otherwise is in the key (a cached fp16 choice is not reused at another
    # learning rate); where the run writes and what it logs are not
    for other in ("trainer.lr=50", "trainer.seed=7", "trainer.clip_grad=0",
                  "trainer.weight_decay=0.3", "optim.beta2=0.9", "scheduler=constant",
                  "precision=fp16", "precision=fp16 precision.initial_scale=1024",
                  "trainer.eval_interval=7"):
        _, plain5, cfg5 = settled("accelerate=auto", *other.split())
        assert cache.key_of(cache.key_fields(cfg5, "cpu")) != key, other
    for same in ("trainer.output_dir=elsewhere", "trainer.log_interval=1",
                 "trainer.progress_bar=false", "accelerate.cache_dir=/elsewhere"):
        _, plain6, cfg6 = settled("accelerate=auto", same)
        assert cache.key_of(cache.key_fields(cfg6, "cpu")) == key, same
    monkeypatch.setattr(cache, "versions", lambda: {"torch": "0.0"})
    assert cache.key_of(cache.key_fields(cfg, "cpu")) != key


def test_new_data_or_weights_at_the_same_path_search_again(tmp_path):
    data = tmp_path / "pairs"
    data.mkdir()
    (data / "train.jsonl").write_text('{"a": 1}\n')
    prefix = tmp_path / "corpus_text_sentence"
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"0" * 8)
    states = [cache.local_state(str(data)), cache.local_state(str(prefix))]
    assert [len(s) for s in states] == [1, 2]  # a folder's files; a Megatron prefix's two
    (data / "train.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    prefix.with_suffix(".bin").write_bytes(b"0" * 16)
    assert [cache.local_state(str(data)), cache.local_state(str(prefix))] != states
    assert cache.local_state("org/hub-model") == [] and cache.local_state(None) == []
    assert isinstance(cache.local_state("."), list) and isinstance(cache.local_state("/"), list)


def test_every_file_a_setting_names_is_in_the_key_and_what_runs_write_is_not(tmp_path):
    data, elsewhere = tmp_path / "pairs", tmp_path / "elsewhere"
    (data / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    train, valid = data / "sub" / "train.jsonl", elsewhere / "valid.jsonl"
    template = tmp_path / "chat.jinja"
    for path in (train, valid, template):
        path.write_text('{"sentence1": "a", "sentence2": "b", "label": 1}\n')
    run, store = data / "runs" / "one", data / "cache"
    _, _, cfg = settled("accelerate=auto", "data=pairs_local", f"data.path={data}",
                        "data.train_file=sub/train.jsonl", f"data.validation_file={valid}",
                        f"data.chat_template={template}", f"trainer.output_dir={run}",
                        f"accelerate.cache_dir={store}")
    key = cache.key_of(cache.key_fields(cfg, "cpu"))
    # the run's own output and the cache, inside the data folder, do not change the key
    for folder in (run, store, data / ".hidden"):
        folder.mkdir(parents=True)
        (folder / "written.json").write_text("{}")
    assert cache.key_of(cache.key_fields(cfg, "cpu")) == key
    # a file in a subfolder, one outside data.path, a chat template file: each changes it
    for path in (train, valid, template):
        before = path.read_text()
        path.write_text(before * 4)
        assert cache.key_of(cache.key_fields(cfg, "cpu")) != key, path
        path.write_text(before)
        os.utime(path, ns=(0, 0))
        key = cache.key_of(cache.key_fields(cfg, "cpu"))
    # the user script is a named file too
    script = tmp_path / "script.py"
    script.write_text("x = 1\n")
    _, _, with_script = settled("accelerate=auto", f"user_script={script}")
    key = cache.key_of(cache.key_fields(with_script, "cpu"))
    script.write_text("x = 2  # longer\n")
    assert cache.key_of(cache.key_fields(with_script, "cpu")) != key


def test_the_key_stays_when_runs_write_beside_the_data_or_a_folder_shares_a_setting_s_name(
        tmp_path, monkeypatch):
    from rapidformer.checkpoint.run_dir import RUN_MARKER

    monkeypatch.chdir(tmp_path)
    for name in ("train", "validation"):
        (tmp_path / f"{name}.jsonl").write_text('{"sentence1": "a", "sentence2": "b", '
                                                 '"label": 1}\n')
    _, _, cfg = settled("accelerate=auto", "data=pairs_local", "data.path=.",
                        "trainer.output_dir=outputs/one")
    key = cache.key_of(cache.key_fields(cfg, "cpu"))
    # earlier runs' folders (their marker), MLflow's and W&B's stores, a folder named as a
    # setting's value (recipe=quickstart, model.arch=bert): none is data
    for folder in ("outputs/old", "mlruns/0", "wandb/run-1", "quickstart", "bert"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "metrics.jsonl").write_text("{}\n")
    for run in ("outputs/old", "quickstart", "bert"):
        (tmp_path / run / RUN_MARKER).write_text("")
    assert cache.key_of(cache.key_fields(cfg, "cpu")) == key
    # a linked folder of shards is data: a changed shard searches again
    shards = tmp_path.parent / f"{tmp_path.name}-shards"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text("{}\n")
    (tmp_path / "more").symlink_to(shards)
    (tmp_path / "loop").symlink_to(tmp_path)  # a link to a parent is walked once
    key = cache.key_of(cache.key_fields(cfg, "cpu"))
    (shards / "part-0.jsonl").write_text("{}\n{}\n")
    assert cache.key_of(cache.key_fields(cfg, "cpu")) != key


def test_every_path_setting_of_the_schema_is_in_the_key():
    import dataclasses

    from rapidformer.config.schema import RunConfig

    not_read = {"trainer.output_dir", "trainer.resume", "accelerate.cache_dir",
                "logger.tracking_uri"}  # where the run writes, what it resumes, its logging
    found = []
    for section in dataclasses.fields(RunConfig):
        kind = section.default_factory if section.default_factory is not dataclasses.MISSING \
            else None
        names = [f"{section.name}.{f.name}" for f in dataclasses.fields(kind)] \
            if kind and dataclasses.is_dataclass(kind) else [section.name]
        found += [n for n in names if n.endswith(("path", "_file", "template", "tokenizer",
                                                  "script", "_dir", "init_from_hf"))]
    assert set(found) - not_read == set(cache.PATH_KEYS)


def test_a_cache_that_cannot_be_read_or_written_costs_a_search_not_the_run(tmp_path):
    record = {"key": "k", "choice": {"label": "bf16", "overrides": ["precision=bf16"]}}
    where = tmp_path / "cache"
    assert cache.store(where, "k", record)[0] == where / "k.json"
    assert cache.load(where, "k") == (record, "")
    assert cache.load(where, "other") == (None, "")  # nothing there: no complaint
    for text in ("[]", "null", '{"key": "k"}', "{not json", '{"key": "k", "choice": "bf16"}'):
        (where / "k.json").write_text(text)
        hit, why = cache.load(where, "k")
        assert hit is None and str(where / "k.json") in why, text
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for directory in (blocked, blocked / "below"):
        stored, why = cache.store(directory, "k", record)
        assert stored is None and str(directory) in why
    assert blocked.read_text() == ""  # nothing written over it


@pytest.mark.parametrize("text", ["precision", "=bf16", "", "precision=bf16 graph"])
def test_a_malformed_hand_picked_candidate_is_refused_before_any_measurement(text):
    with pytest.raises(ConfigError) as refused:
        settled("accelerate=auto", f"accelerate.extra_candidates=['{text}']")
    assert "accelerate.extra_candidates" in str(refused.value)


@pytest.mark.parametrize("logged, words", [(2, "after 2 of 4 steps"),
                                           (4, "its steps were trained; the evaluation")])
def test_a_child_past_its_time_says_whether_it_was_training_or_evaluating(
        monkeypatch, tmp_path, logged, words):
    from rapidformer.tuning import measure as measuring

    def hung(overrides, label, limit, log_path):
        out = next(o for o in overrides if o.startswith("trainer.output_dir="))
        out = tmp_path / out.split("=", 1)[1].strip("'")
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "loss": 1.0, "window_s": 0.1, "tokens_per_s": 10.0}) + "\n"
            for i in range(logged)))
        log_path.write_text("")
        return None, limit, 0

    monkeypatch.setattr(measuring, "run_child", hung)
    m = measuring.measure(["+recipe=quickstart"], REFERENCE, 4, 1, 30.0, tmp_path)
    assert m.status == "timeout" and words in m.reason and "still running after 30 s" in m.reason


def test_a_search_is_refused_where_each_node_would_search_alone():
    from rapidformer.tuning.run import refusals

    _, _, cfg = settled("accelerate=auto", "launcher.nnodes=2", "launcher.nproc_per_node=1")
    found = refusals(cfg, multirun=False)
    assert len(found) == 1 and "launcher.nnodes=2" in found[0] and "rapidformer tune" in found[0]
    _, _, one = settled("accelerate=auto", "launcher.nproc_per_node=2")
    assert not refusals(one, multirun=False)


def test_a_search_is_refused_under_an_outside_launcher(monkeypatch):
    from rapidformer.tuning.run import refusals

    _, _, cfg = settled("accelerate=auto")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    found = refusals(cfg, multirun=False)
    assert len(found) == 1 and "outside launcher" in found[0] and "rapidformer tune" in found[0]


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_is_not_taken_for_a_candidate_s_failure_and_an_ignored_one_stays_so(
        signum):
    import os
    import signal

    from rapidformer.tuning.measure import Stopped, check_stop
    from rapidformer.tuning.search import _stop_signals_recorded

    sent = getattr(signal, signum)
    # a shell without job control starts its `&` jobs with SIGINT ignored, and pytest then
    # inherits it so: the first half needs the signal handled, as a terminal's shell leaves it
    inherited = signal.signal(sent, signal.default_int_handler)
    try:
        before = signal.getsignal(sent)
        with pytest.raises(Stopped):
            with _stop_signals_recorded():
                os.kill(os.getpid(), sent)  # recorded, not raised inside whatever runs
                try:
                    check_stop()
                except Exception:  # noqa: BLE001 - a candidate's broad except
                    pytest.fail("a stop signal was taken for a failure")
        assert signal.getsignal(sent) is before  # put back
    finally:
        signal.signal(sent, inherited)
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup ignores SIGHUP
    try:
        with _stop_signals_recorded():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, interrupt)


# a search on a CPU: the quickstart's tiny BERT on 800 pairs, 5 steps a candidate
SEARCH = ["data.synthetic_train_size=800", "data.synthetic_eval_size=64", "trainer.epochs=1",
          "trainer.progress_bar=false", "accelerate.steps=5", "accelerate.warmup_steps=2",
          "accelerate.max_fraction=100"]


@pytest.mark.slow
def test_a_crashing_a_hanging_and_a_diverging_candidate_cost_themselves_only(tmp_path):
    faults = {"trainer.tf32=true": "crash", "trainer.deterministic=true": "hang",
              "data.num_workers=0": "diverge"}
    result = assert_ok(run_cli(
        ["tune", "--json", *SEARCH, "accelerate.max_candidates=0",
         "accelerate.candidate_timeout_s=25", f"accelerate.cache_dir={tmp_path / 'cache'}",
         # the budget, not the run's length, bounds this search (a loaded machine's 25 s hang
         # would otherwise spend a budget of max_fraction x a run of seconds)
         "accelerate.max_fraction=100000", "accelerate.budget_s=600",
         "accelerate.extra_candidates=['data.num_workers=0','trainer.tf32=true',"
         "'trainer.deterministic=true']"],
        tmp_path, module="rapidformer.cli",
        env={"RAPIDFORMER_TUNING_FAULTS": json.dumps(faults)}))
    record = json.loads(result.stdout)
    rows = {r["label"]: r for r in record["rows"]}
    assert rows["trainer.tf32=true"]["status"] == "crashed"
    assert "injected crash" in rows["trainer.tf32=true"]["reason"]
    assert rows["trainer.deterministic=true"]["status"] == "timeout"
    diverging = rows["data.num_workers=0"]  # trained at trainer.lr=1000
    assert not diverging["passed"]
    assert diverging["status"] == "diverged" or "differs" in diverging["loss_check"]
    assert record["choice"]["label"] == "reference" and record["choice"]["overrides"] == []
    assert rows["reference"]["passed"] and rows["reference"]["tokens_per_s"] > 0


def _processes_naming(text: str) -> list[int]:
    from pathlib import Path

    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_search_stopped_by_a_signal_kills_its_child_and_removes_its_folder(tmp_path, signum):
    # SIGHUP: a closed terminal (the child, in a session of its own, does not get it); SIGKILL:
    # nothing runs in the search, the child dies with it (its parent-death signal). SIGINT takes
    # SIGTERM's path (_stop_signals_recorded, tested above with each of them)
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import OFFLINE_ENV

    env = {**os.environ, **OFFLINE_ENV, "TMPDIR": str(tmp_path),
           "RAPIDFORMER_TUNING_FAULTS": json.dumps({"reference": "hang"})}
    parent = subprocess.Popen(
        [sys.executable, "-m", "rapidformer.cli", "tune", *SEARCH,
         f"accelerate.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("rapidformer-tuning-*/candidate-*/child.log")):
        assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
        time.sleep(0.2)
    time.sleep(1.0)  # the child is started (it hangs: the reference's measurement never ends)
    children = [pid for pid in _processes_naming(str(tmp_path / "rapidformer-tuning-"))
                if pid != parent.pid]
    assert children
    parent.send_signal(getattr(signal, signum))
    try:
        _, err = parent.communicate(timeout=60)
        time.sleep(0.5)
        left = _processes_naming(str(tmp_path / "rapidformer-tuning-"))
    finally:  # a failing run leaves no hanging child behind
        for pid in _processes_naming(str(tmp_path / "rapidformer-tuning-")):
            os.kill(pid, signal.SIGKILL)
    assert not left  # the child is gone
    assert not (tmp_path / "cache").exists()  # nothing cached
    if signum == "SIGKILL":
        assert parent.returncode == -signal.SIGKILL
        return
    assert parent.returncode == 75, err[-2000:]
    assert f"the search was stopped by {signum}" in err and "Traceback" not in err
    assert not list(tmp_path.glob("rapidformer-tuning-*"))  # and its folder


@pytest.mark.slow
def test_a_search_trains_with_its_choice_and_a_second_run_uses_the_cache(tmp_path):
    store = tmp_path / "cache"
    # the other test worker's load changes under this search: its takes of the config as given
    # may differ by any factor, which tests/test_tuning_review.py's fake clock tests apart
    args = ["accelerate=auto", *SEARCH, "accelerate.max_candidates=1",
            "accelerate.axes=[sequences,micro_batch_size]", "accelerate.load_tolerance=1000"]
    first = assert_ok(run_cli([*args, f"trainer.output_dir={tmp_path / 'run1'}"], tmp_path,
                              env={"RAPIDFORMER_TUNING_CACHE": str(store)}))
    record = json.loads((tmp_path / "run1" / "tuning.json").read_text())
    assert not record["cached"] and record["search_s"] > 0
    measured_rows = [r for r in record["rows"] if "status" in r]
    chosen = record["choice"]
    # a candidate that would replace the config has the config measured again first
    again = ["reference (measured again)"] if chosen["label"] != "reference" else []
    assert [r["label"] for r in measured_rows] in (
        ["reference", "unpad", *again], ["reference", "unpad", "reference (first)"])
    assert all(r["status"] == "ok" and r.get("passed", True) for r in measured_rows), \
        record["table"]
    # the run trained with the choice, and its config records it
    import yaml

    trainer = yaml.safe_load((tmp_path / "run1" / "config.yaml").read_text())["trainer"]
    given = dict(o.split("=", 1) for o in chosen["overrides"])
    assert trainer.get("unpad", False) == (given.get("trainer.unpad") == "true")
    assert trainer["micro_batch_size"] == int(given.get("trainer.micro_batch_size", 32))
    assert "chose" in first.stderr and "accelerate=auto" in \
        (tmp_path / "run1" / "rapidformer.log").read_text()
    assert chosen["label"] in record["table"] and record["command"].startswith("python -m")
    assert len(list(store.glob("*.json"))) == 1
    second = assert_ok(run_cli([*args, f"trainer.output_dir={tmp_path / 'run2'}"], tmp_path,
                               env={"RAPIDFORMER_TUNING_CACHE": str(store)}))
    again = json.loads((tmp_path / "run2" / "tuning.json").read_text())
    assert again["cached"] and again["choice"] == chosen
    assert "measuring" not in second.stderr and "cached result" in second.stderr


def test_the_reproducing_command_sets_each_key_once():
    from rapidformer.tuning.search import command

    got = command(["+recipe=quickstart", "graph=compile", "accelerate=auto",
                   "accelerate.budget_s=60", "trainer.micro_batch_size=8"],
                  ["graph=eager", "trainer.micro_batch_size=16",
                   "trainer.global_batch_size=32"])
    assert got == ("python -m rapidformer +recipe=quickstart graph=eager "
                   "trainer.micro_batch_size=16 trainer.global_batch_size=32")
