"""accelerate=auto's review findings, each in-process and without a child: packing in a run
given in epochs, memory=auto keeping the config's recompute, the command line's pins, a resumed
run's record, a search cut short by its budget, a budget below the reference's measurement, a
noisy rate, a run's flags given to `tune`, hand-picked candidates no measurement sees, and the
cache key's gaps (docs/tuning.md)."""
from __future__ import annotations

import json

import pytest
import torch

from rapidformer.errors import ConfigError, InputError, Preempted
from rapidformer.tuning import cache
from rapidformer.tuning.admit import Admission
from rapidformer.tuning.enumerate import candidates
from rapidformer.tuning.measure import Measurement, summarize
from rapidformer.tuning.pick import choose, judge
from rapidformer.tuning.space import Candidate, hand_picked

from tests.test_tuning import (fake_measure, measured, refused_before_measuring, search_space,
                               settled)

CPU = torch.device("cpu")


# 1. packing (or any candidate) that changes the optimizer steps of a run given in epochs

def test_a_candidate_that_changes_the_steps_of_an_epoch_is_no_candidate():
    _, found, left_out = search_space(
        "+recipe=llama_sft", "accelerate=auto", "accelerate.axes=[sequences]",
        "accelerate.extra_candidates=['trainer.global_batch_size=32','trainer.lr=1e-3']")
    assert [c.label for c in found] == ["trainer.lr=1e-3"]
    assert left_out["packing"] == (
        "refused: packing changes the optimizer steps of a run given in epochs "
        "(trainer.epochs=3): not the config's result sooner; set it by hand if it is the run "
        "you want")
    assert "a global batch of 32 (the config's 16) changes the optimizer steps" in \
        left_out["trainer.global_batch_size=32"]


def test_a_measured_candidate_whose_epoch_has_other_steps_fails_in_an_epoch_run_only():
    ref = measured("reference", rate=1000, warmup_s=2.0)
    packed = measured("data.packing=true", rate=5000, warmup_s=2.0)
    ref.steps_per_epoch, packed.steps_per_epoch = 25, 5
    epochs = {v.label: v for v in judge(ref, [packed], 100_000, 2, 0.1)}
    assert not epochs["data.packing=true"].passed
    assert "(5 per epoch, the config as given 25)" in epochs["data.packing=true"].why
    assert choose(list(epochs.values())).label == "reference"
    steps = judge(ref, [packed], 100_000, 2, 0.1, run_steps=40)  # the same 40 steps either way
    assert choose(steps).label == "data.packing=true"


# 2. memory=auto keeps the config's own activation checkpointing

def test_memory_auto_keeps_the_config_s_recompute_unless_the_candidate_sets_it():
    from rapidformer.tuning.admit import admit

    _, _, cfg = settled("accelerate=auto", "memory=auto", "trainer.checkpoint_activations=true")
    kept = dict(admit(cfg, hand_picked("trainer.seed=42"), CPU, True).candidate.overrides)
    assert kept["trainer.checkpoint_activations"] == "true"
    off = dict(admit(cfg, Candidate("ckpt=false", (("trainer.checkpoint_activations", "false"),)),
                     CPU, True).candidate.overrides)
    assert off["trainer.checkpoint_activations"] == "false"  # the plan needs none here


# 3. what the command line sets is pinned: not searched over, and in the cache key

def test_a_value_given_on_the_command_line_is_not_searched_over_and_keys_the_cache():
    from rapidformer.tuning.space import pinned_changes, pins, touched_pins

    given = ["+recipe=quickstart", "++trainer.unpad=false", "precision=fp32", "accelerate=auto",
             "accelerate.axes=[precision,sequences]", "accelerate.max_candidates=40",
             "hydra.run.dir=x"]
    pinned = pins(given)
    assert pinned == {"trainer.unpad": "false", "precision": "fp32"}
    _, _, cfg = settled(*given)
    admitted, left_out, _ = candidates(cfg, CPU, memory_auto=False, pinned=pinned)
    assert [a.candidate.label for a in admitted] == []
    rows = {r["label"]: r["why"] for r in left_out}
    assert rows["unpad"].startswith("not tried: it changes trainer.unpad=false, which the "
                                    "command line sets")
    assert rows["bf16 / fp16 / fp8"].startswith("not tried: it changes precision=fp32")
    # a group's key given: the candidate that switches the group would drop it
    assert pins(["precision=fp16", "precision.initial_scale=1024"], memory_auto=True) == \
        {"precision": "fp16", "precision.initial_scale": "1024"}
    assert pinned_changes([("precision", "bf16")], {"precision.initial_scale": "1024"}) == \
        ["precision.initial_scale=1024"]
    assert pinned_changes(["trainer.global_batch_size=32.0"],
                          {"trainer.global_batch_size": "32"}) == []  # the same value
    # the default given explicitly keys another cache entry than the default left alone
    touched = touched_pins(cfg, pinned)
    assert touched == ["precision", "trainer.unpad"]
    assert cache.key_of(cache.key_fields(cfg, "cpu", touched)) != \
        cache.key_of(cache.key_fields(cfg, "cpu"))


def test_the_run_keeps_a_pinned_value_and_its_record_reproduces_into_a_new_folder(
        monkeypatch, tmp_path):
    from rapidformer.tuning import run as tuning_run
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "measure",
                        fake_measure({"reference": 1000, "unpad": 5000}))
    base = ["+recipe=quickstart", "accelerate=auto", "accelerate.axes=[sequences]",
            "accelerate.max_fraction=100", f"accelerate.cache_dir={tmp_path / 'cache'}",
            f"trainer.output_dir={tmp_path / 'run'}"]
    commands = []
    for extra, chosen in (([], "unpad"), (["++trainer.unpad=false"], "reference")):
        composed, _, cfg = settled(*base, *extra)
        got = tuning_run.tuned_overrides([*base, *extra], composed, cfg)
        record = dict(tuning_run._pending)
        tuning_run._pending.clear()
        assert record["choice"]["label"] == chosen, record["table"]
        assert set(extra) <= set(got)  # the user's own value stays on the command line
        commands.append(record["command"])
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # two keys
    # the run log's reproducing command trains into a new folder (pasted with this run's own
    # folder, it would be refused as an existing run's)
    assert not any("output_dir" in c for c in commands)


# 4. a resumed accelerate=auto run: its resume line and its tuning.json

def _searched_run(folder, overrides, resolved_accelerate="auto"):
    import yaml

    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / "config.yaml").write_text(yaml.safe_dump(
        {"accelerate": {"name": resolved_accelerate}, "trainer": {"output_dir": str(folder)}}))


def test_the_resume_line_of_a_searched_run_resumes_its_choice_without_searching(tmp_path):
    from rapidformer.cli.summary import resume_command

    run = tmp_path / "run"
    _searched_run(run, ["+recipe=quickstart", "accelerate=auto", "accelerate.budget_s=60",
                        "++trainer.unpad=true", f"++trainer.output_dir='{run}'"])
    line = resume_command(run)
    assert "accelerate" not in line and "++trainer.unpad=true" in line
    assert line.endswith(f"trainer.output_dir={run} trainer.resume=auto")
    # auto from a recipe or a config file, not the command line: set back explicitly
    other = tmp_path / "other"
    _searched_run(other, ["+recipe=mine", "++trainer.unpad=true"])
    assert "accelerate=none trainer.output_dir=" in resume_command(other)
    plain = tmp_path / "plain"
    _searched_run(plain, ["+recipe=quickstart"], resolved_accelerate="none")
    assert "accelerate" not in resume_command(plain)


def cli_settled(*overrides: str):
    """As the CLI settles a run before its folder is claimed (hydra_main._main): a stand-in
    for trainer.output_dir."""
    from rapidformer.config.compose import check_overrides, compose, with_default_recipe
    from rapidformer.preflight import settle

    composed = compose(check_overrides(with_default_recipe(list(overrides))),
                       default_recipe=False)
    return composed, *settle(composed, "(run directory)")


def test_an_auto_run_that_resumes_reuses_its_recorded_choice(monkeypatch, tmp_path, capsys):
    from rapidformer.tuning import run as tuning_run
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "search", lambda *a, **k: pytest.fail("searched"))
    run = tmp_path / "run"
    run.mkdir()
    recorded = {"choice": {"label": "unpad", "overrides": ["trainer.unpad=true"]}, "rows": []}
    (run / "tuning.json").write_text(json.dumps(recorded))
    before = (run / "tuning.json").stat()
    given = ["+recipe=quickstart", "accelerate=auto", f"trainer.output_dir={run}",
             "trainer.resume=auto"]
    composed, _, cfg = cli_settled(*given)
    got = tuning_run.tuned_overrides(given, composed, cfg)
    assert got[-1] == "++trainer.unpad=true" and got[:-1] == given
    assert "training on" not in capsys.readouterr().err  # not before the choice settles
    tuning_run.choice_settled(lambda: cli_settled(*got))
    assert "training on with the choice its tuning.json records, unpad (no search)" in \
        capsys.readouterr().err
    tuning_run.write_record(str(run))  # said in the log, not written again
    assert (run / "tuning.json").stat().st_mtime_ns == before.st_mtime_ns
    # a command line that sets what the choice changes is refused, and nothing said before
    composed, _, pinned = cli_settled(*given, "trainer.unpad=false")
    with pytest.raises(InputError, match="changes trainer.unpad=false, which the command line"):
        tuning_run.tuned_overrides([*given, "trainer.unpad=false"], composed, pinned)
    assert "training on" not in capsys.readouterr().err
    # a setting the choice does not fit (fixed row lengths and unpadding): the problem names
    # where the choice came from, and nothing is said of training on
    with_lengths = [*given, "data.pad_to=[32,64]"]
    composed, _, cfg = cli_settled(*with_lengths)
    got = tuning_run.tuned_overrides(with_lengths, composed, cfg)
    with pytest.raises(ConfigError) as refused:
        tuning_run.choice_settled(lambda: cli_settled(*got))
    assert refused.value.problems[-1] == (
        f"trainer.unpad=true is accelerate=auto's choice unpad, recorded in "
        f"{run / 'tuning.json'}")
    assert "training on" not in capsys.readouterr().err
    # a fresh run into another folder searches
    composed, _, fresh = cli_settled(*given[:2], f"trainer.output_dir={tmp_path / 'new'}",
                                     "trainer.resume=auto")
    with pytest.raises(pytest.fail.Exception, match="searched"):
        tuning_run.tuned_overrides(given[:2], composed, fresh)


def test_a_refusal_of_the_config_as_given_is_not_blamed_on_the_choice():
    from rapidformer.tuning import run as tuning_run

    tuning_run._pending.update({"choice": {"label": "reference", "overrides": []}})
    try:
        with pytest.raises(ConfigError) as refused:
            tuning_run.choice_settled(lambda: (_ for _ in ()).throw(ConfigError(["x is bad"])))
        assert refused.value.problems == ["x is bad"]
    finally:
        tuning_run._pending.clear()


# 5. a search cut short by its budget, cached, and a later run with a larger budget

def _admitted(*labels):
    return [Admission(Candidate(label, (("trainer.seed", str(i)),)))
            for i, label in enumerate(labels)], [], {label: 1.0 for label in labels}


def test_a_search_the_budget_cut_short_searches_again_with_a_larger_budget(monkeypatch,
                                                                             tmp_path):
    from rapidformer.tuning import search as search_module

    now = [0.0]
    clocked = fake_measure({"reference": 1000, "a": 1000, "b": 1000})

    def measure(*args):
        m = clocked(*args)
        now[0] += m.wall_s  # 4 s + 8 steps of 1 s
        return m

    calls = []
    monkeypatch.setattr(search_module, "measure", lambda *a: calls.append(a[1]) or measure(*a))
    monkeypatch.setattr(search_module, "candidates", lambda *a, **k: _admitted("a", "b"))
    monkeypatch.setattr(search_module.time, "monotonic", lambda: now[0])
    base = ["accelerate=auto", "accelerate.max_fraction=100",
            f"accelerate.cache_dir={tmp_path}"]
    for budget, searched in ((30, True), (30, False), (20, False), (100, True), (30, False)):
        overrides = [*base, f"accelerate.budget_s={budget}"]
        _, _, cfg = settled(*overrides)
        calls.clear()
        record = search_module.search(overrides, cfg, memory_auto=False)
        assert bool(calls) == searched, budget
        assert record["cached"] != searched
        if budget == 30 and searched:  # 12 s of the reference, 12 of "a": "b" not measured
            assert record["truncated"]["by"] == "accelerate.budget_s"
    cached = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert cached["truncated"] is None  # the search of 100 s measured both


# 6. a budget below the reference's own measurement

def test_a_budget_below_the_reference_s_measurement_trains_the_config_as_given(
        monkeypatch, tmp_path, capsys):
    from rapidformer.cli.verbs.tune import tune_command
    from rapidformer.tuning import search as search_module

    def timeout(run_overrides, candidate, steps, warmup, limit, work):
        return Measurement(candidate, "timeout", limit,
                           reason=f"still running after {limit:.0f} s (after 2 of {steps} "
                                  f"steps): stopped")

    monkeypatch.setattr(search_module, "measure", timeout)
    overrides = ["accelerate=auto", "accelerate.budget_s=5", f"accelerate.cache_dir={tmp_path}"]
    _, _, cfg = settled(*overrides)
    record = search_module.search(overrides, cfg, memory_auto=False)
    assert record["choice"] == {"label": "reference", "overrides": [], "time_to_result_s": None}
    assert not record["measured"] and not list(tmp_path.glob("*.json"))  # nothing cached
    err = capsys.readouterr().err
    assert err.count("rapidformer: warning:") == 1
    assert "accelerate.budget_s=5 allowed no measurement" in err
    assert tune_command(overrides[1:]) == 0
    out = capsys.readouterr().out
    assert "choice: reference (no measurement: accelerate.budget_s ended" in out
    assert out.rstrip().splitlines()[-1].startswith("python -m rapidformer")


# 7. the rate is robust to a stalled step, and a gain within the spread is noise

def _steps(windows, tokens=1000.0):
    return [{"loss": 1.0, "window_s": w, "tokens_per_s": tokens / w} for w in windows]


def test_a_stalled_step_or_a_gain_within_the_spread_does_not_replace_the_config():
    # identical settings; the reference's fourth timed step stalled (a loaded machine)
    stalled = summarize(Candidate("reference"), _steps([1, 1, 1, 1, 1, 20, 1, 1]), 2, 40, 0, "")
    same = summarize(Candidate("trainer.seed=42"), _steps([1] * 8), 2, 21, 0, "")
    assert stalled.tokens_per_s == same.tokens_per_s == 1000
    assert choose(judge(stalled, [same], 1e6, 2, 0.1)).label == "reference"
    # the reference's steps vary by 10 % (median absolute deviation): 8 % sooner is noise,
    # 30 % is not
    noisy = summarize(Candidate("reference"),
                      _steps([1, 1, 1 / 1.1, 1 / 0.9, 1, 1 / 1.1, 1 / 0.9, 1]), 2, 8, 0, "")
    assert noisy.rate_spread == pytest.approx(0.1)
    for rate, chosen in ((1080, "reference"), (1300, "faster")):
        other = summarize(Candidate("faster"), _steps([1000 / rate] * 8), 2, 8000 / rate, 0, "")
        assert choose(judge(noisy, [other], 1e6, 2, 0.1)).label == chosen


# 8. a run's flags given to `tune`

@pytest.mark.parametrize("flags", [["--cfg", "job"], ["-m"], ["--multirun"], ["--hydra-help"],
                                   ["--print-hydra"]])
def test_tune_refuses_a_run_s_flags_with_one_message(monkeypatch, capsys, flags):
    from rapidformer.cli.verbs.tune import tune_command
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "search", lambda *a, **k: pytest.fail("searched"))
    assert tune_command(["trainer.lr=1e-3", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"rapidformer tune does not take {flags[0]}" in err[0]


# 9. hand-picked candidates whose value no measurement sees

@pytest.mark.parametrize("extra, key", [
    ("trainer.train_iters=5", "trainer.train_iters changes what the run trains on or for how"),
    ("precision=bf16 trainer.epochs=1", "trainer.epochs changes"),
    ("data.synthetic_train_size=100", "data.synthetic_train_size changes"),
    ("data.split=98,1,1", "data.split changes"),
    ("trainer.eval_interval=3", "trainer.eval_interval is set by the measurement itself"),
    ("trainer.early_stopping_patience=null", "trainer.early_stopping_patience is set by"),
])
def test_an_extra_candidate_no_measurement_sees_is_refused_before_measuring(monkeypatch, extra,
                                                                             key):
    refused = refused_before_measuring(monkeypatch, f"['precision=bf16','{extra}']")
    assert len(refused.problems) == 1
    assert refused.problems[0].startswith(f"accelerate.extra_candidates '{extra}': {key}")


@pytest.mark.parametrize("extra, key", [
    # a model of one layer and inputs cut to 8 tokens each passed the loss check and won
    ("model.num_layers=1 model.hidden_size=32 model.num_attention_heads=2",
     "model.num_layers, model.hidden_size and model.num_attention_heads"),
    ("data.max_seq_length=8", "data.max_seq_length"),
    ("trainer.lr=1e-3", "trainer.lr"), ("trainer.seed=7", "trainer.seed"),
    ("trainer.clip_grad=1.0", "trainer.clip_grad"), ("scheduler=constant", "scheduler"),
    ("optim.beta2=0.95", "optim.beta2"), ("model=llama_tiny", "model"),
    ("peft=lora", "peft"), ("precision=bf16 task.num_labels=3", "task.num_labels"),
    # it trains other examples in each step: 2.5 points of validation accuracy lost
    ("data.group_by_length=true", "data.group_by_length"),
    ("logger=wandb trainer.keep_last=5", "logger and trainer.keep_last"),
])
def test_an_extra_candidate_that_changes_what_the_run_computes_is_refused(monkeypatch, extra,
                                                                           key):
    refused = refused_before_measuring(monkeypatch, f"['precision=bf16','{extra}']")
    one = " and " not in key
    assert refused.problems == [
        f"accelerate.extra_candidates '{extra}': {key} {'is' if one else 'are'} not how the "
        f"run computes: a candidate changes only that (the groups precision, graph, kernels, "
        f"memory, parallelism, and the batch, sequence, recompute and kernel keys "
        f"docs/tuning.md lists), and trains the config's model, data, objective and "
        f"optimization, which the first steps' loss cannot tell apart from others; set "
        f"{'it' if one else 'them'} on the command line"]


def test_every_problem_of_an_extra_candidate_is_named_at_once(monkeypatch):
    refused = refused_before_measuring(
        monkeypatch, "['trainer.epochs=1 model.num_layers=1 trainer.unpadd=true']")
    assert [p.split(": ", 1)[1][:40] for p in refused.problems] == [
        "trainer.epochs changes what the run trai", "trainer.unpadd: unknown key; did you mea"]
    refused = refused_before_measuring(monkeypatch, "['trainer.epochs=1 model.num_layers=1']")
    assert [p.split(": ", 1)[1][:40] for p in refused.problems] == [
        "trainer.epochs changes what the run trai", "model.num_layers is not how the run comp"]


def test_an_extra_candidate_that_sets_a_key_twice_is_refused(monkeypatch):
    # its label named bf16 and it trained fp32
    refused = refused_before_measuring(monkeypatch, "['precision=bf16 precision=fp32']")
    assert refused.problems == [
        "accelerate.extra_candidates 'precision=bf16 precision=fp32': it sets precision 2 times "
        "(its label would name a value it does not measure); set it once"]


@pytest.mark.parametrize("extra", [
    "graph=compile graph.mode=max-autotune", "memory=zero2", "kernels=none",
    "trainer.micro_batch_size=16", "trainer.checkpoint_activations=true trainer.unpad=true",
    "data.pad_to=[64] data.num_workers=1", "optim.fused=off", "trainer.tf32=true",
    "task.lm_head=all",
    "model.attn_implementation=eager", "+graph.options.max_autotune=true"])
def test_an_extra_candidate_of_how_the_run_computes_is_taken(extra):
    from rapidformer.tuning.search import check_extra_candidates

    _, _, cfg = settled("accelerate=auto", f"accelerate.extra_candidates=[\"{extra}\"]")
    check_extra_candidates(cfg)


# 10. the cache key's gaps

def test_a_megatron_blend_s_prefixes_are_in_the_key(tmp_path):
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            (tmp_path / f"{name}{ext}").write_bytes(b"0" * 8)
    blend = f"0.7 {tmp_path / 'a'} 0.3 {tmp_path / 'b'}"
    state = cache.local_state(blend)
    assert len(state) == 4
    (tmp_path / "b.bin").write_bytes(b"0" * 16)
    assert cache.local_state(blend) != state


def test_the_source_the_cpu_and_xdg_cache_home_are_in_the_key(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "mod.py"
    module.write_text("x = 1\n")
    before = cache.folder_fingerprint(tmp_path)
    module.write_text("x = 12\n")
    assert cache.folder_fingerprint(tmp_path) != before
    assert cache.versions()["rapidformer-source"] == cache.source_fingerprint()
    cpu = cache.hardware("cpu")
    assert {"model", "usable"} <= set(cpu)
    if hasattr(__import__("os"), "sched_getaffinity"):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
        assert cache.hardware("cpu")["usable"] == 1
    # OMP_NUM_THREADS=1 in front of a command: the same cores, other threads, another key
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    assert cache.hardware("cpu")["threads"] == 1
    _, _, cfg = settled("accelerate=auto")
    monkeypatch.delenv("RAPIDFORMER_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir(cfg) == tmp_path / "xdg" / "rapidformer" / "tuning"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # invalid by the spec: ignored
    assert cache.cache_dir(cfg).parts[-3:] == (".cache", "rapidformer", "tuning")


# cosmetic: the not-measured seconds, a stop's wording

def test_seconds_show_their_difference_and_a_stopped_search_is_a_stop():
    from rapidformer.tuning.search import SearchStopped, seconds

    assert seconds(0.34, 0.28) == ["0.34 s", "0.28 s"]  # not "0 s ... 0 s"
    assert seconds(12.2, 30.4) == ["12 s", "30 s"]
    assert seconds(0.04, 5.0) == ["0.04 s", "5.00 s"]
    assert seconds(0.0, 5.2) == ["0 s", "5 s"]
    assert issubclass(SearchStopped, Preempted) and SearchStopped("x").exit_code == 75


def test_the_printed_command_of_a_recipe_that_searches_trains_the_choice_without_a_search(
        tmp_path):
    from rapidformer.tuning.search import command

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "searching.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /accelerate: auto\nrecipe: searching\n")
    from rapidformer.config import search as config_search

    folder = f"hydra.searchpath=[file://{tmp_path}]"
    config_search.use([tmp_path])  # as --config-dir leaves it for the command
    try:
        got = command([folder, "+recipe=searching"], ["trainer.micro_batch_size=4"])
    finally:
        config_search.use([])
    assert got.endswith("+recipe=searching trainer.micro_batch_size=4 accelerate=none"), got
    plain = command(["+recipe=quickstart"], ["trainer.micro_batch_size=4"])
    assert plain.endswith("+recipe=quickstart trainer.micro_batch_size=4"), plain


@pytest.mark.parametrize("trained_unpad, reused", [(True, True), (False, False)])
def test_a_resumed_run_takes_only_a_choice_its_config_trained_with(tmp_path, monkeypatch,
                                                                  trained_unpad, reused):
    import yaml

    from rapidformer.errors import InputError
    from rapidformer.tuning import run as tuning_run
    from rapidformer.tuning import search as search_module

    monkeypatch.setattr(search_module, "search", lambda *a, **k: pytest.fail("searched"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "tuning.json").write_text(json.dumps(
        {"choice": {"label": "unpad mbs=16", "overrides": [
            "trainer.unpad=true", "trainer.micro_batch_size=16", "precision=fp32"]}}))
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"trainer": {"unpad": trained_unpad, "micro_batch_size": 16},
         "precision": {"name": "fp32"}}))
    given = ["+recipe=quickstart", "accelerate=auto", f"trainer.output_dir={run}",
             "trainer.resume=auto"]
    composed, _, cfg = cli_settled(*given)
    if reused:
        assert tuning_run.tuned_overrides(given, composed, cfg)[-3:] == [
            "++trainer.unpad=true", "++trainer.micro_batch_size=16", "precision=fp32"]
    else:
        with pytest.raises(InputError, match=r"its config.yaml did not train with "
                                             r"\(trainer.unpad: False\)"):
            tuning_run.tuned_overrides(given, composed, cfg)


def test_a_candidate_the_budget_s_end_stopped_marks_the_search_cut(monkeypatch, tmp_path):
    """A candidate started with less budget left than its own time limit, and stopped by it,
    is the budget's cut (a larger budget_s searches again), not the candidate's own timeout."""
    from rapidformer.tuning import search as search_module

    now = [0.0]
    clocked = fake_measure({"reference": 1000})

    def measure(run_overrides, candidate, steps, warmup, limit, work):
        if candidate.label == "reference":
            m = clocked(run_overrides, candidate, steps, warmup, limit, work)
        else:  # a compile that outlasts what the budget left it
            m = Measurement(candidate, "timeout", limit, reason=f"still running after "
                                                                f"{limit:.0f} s: stopped")
        now[0] += m.wall_s
        return m

    monkeypatch.setattr(search_module, "measure", measure)
    monkeypatch.setattr(search_module, "candidates", lambda *a, **k: _admitted("a"))
    monkeypatch.setattr(search_module.time, "monotonic", lambda: now[0])
    # 12 s of the reference, 12 kept for its second take: "a" starts with 16 s, and is stopped
    overrides = ["accelerate=auto", "accelerate.max_fraction=100", "accelerate.budget_s=40",
                 "accelerate.candidate_timeout_s=180", f"accelerate.cache_dir={tmp_path}"]
    _, _, cfg = settled(*overrides)
    record = search_module.search(overrides, cfg, memory_auto=False)
    assert {r["label"]: r for r in record["rows"]}["a"]["status"] == "timeout"
    assert record["truncated"]["by"] == "accelerate.budget_s"


def test_a_noisier_faster_candidate_does_not_hide_a_steady_sooner_one():
    from rapidformer.tuning.pick import Verdict

    reference = Verdict("reference", True, "ok", 100.0, "", 0.01)
    noisy, steady = Verdict("A", True, "ok", 80.0, "", 0.20), Verdict("B", True, "ok", 85.0, "",
                                                                      0.01)
    assert choose([reference, noisy, steady]).label == "B"  # A is within its own spread
    assert choose([reference, noisy]).label == "reference"


# 11. the config as given measured again before a candidate replaces it

def _search_with(monkeypatch, tmp_path, rates: dict, budget: float = 300, again=None,
                 extra=()):
    """A search of the reference and one candidate "a" at these rates on a fake clock;
    `again`: what becomes of the reference's second take ("timeout", "diverged losses")."""
    from dataclasses import replace

    from rapidformer.tuning import search as search_module

    now, calls = [0.0], []
    clocked = fake_measure(rates)

    def measure(run_overrides, candidate, steps, warmup, limit, work):
        calls.append((candidate.label, limit))
        m = clocked(run_overrides, candidate, steps, warmup, limit, work)
        if candidate.label == "reference (measured again)" and again == "timeout":
            m = Measurement(candidate, "timeout", limit, reason="still running: stopped")
        if again == "budget" and candidate.label == "a":  # its whole 16 s: 12 s are left
            m = replace(m, wall_s=limit)
        if again == "budget" and candidate.label == "reference (measured again)" and \
                1.1 * m.wall_s > limit:  # a machine a tenth slower than for the first take
            m = Measurement(candidate, "timeout", limit, reason="still running: stopped")
        if candidate.label == "reference (measured again)" and again == "diverged losses":
            m = replace(m, losses=[x * 30 for x in m.losses])  # finite, and far off
        now[0] += m.wall_s
        return m

    monkeypatch.setattr(search_module, "measure", measure)
    monkeypatch.setattr(search_module, "candidates", lambda *a, **k: _admitted("a"))
    monkeypatch.setattr(search_module.time, "monotonic", lambda: now[0])
    overrides = ["accelerate=auto", "accelerate.max_fraction=100",
                 f"accelerate.budget_s={budget}", f"accelerate.cache_dir={tmp_path}", *extra]
    _, _, cfg = settled(*overrides)
    record = search_module.search(overrides, cfg, memory_auto=False)
    return record, {r["label"]: r for r in record["rows"]}, calls


def test_a_reference_measured_on_a_busier_machine_is_measured_again_before_it_loses(
        monkeypatch, tmp_path):
    # another job slowed the reference's first measurement by 13 %: the identical setting "a"
    # would have won, and been cached
    record, rows, calls = _search_with(monkeypatch, tmp_path, {
        "reference": 1000, "a": 1150, "reference (measured again)": 1150})
    assert [label for label, _ in calls] == ["reference", "a", "reference (measured again)"]
    assert record["choice"]["label"] == "reference", record["table"]
    assert rows["reference"]["tokens_per_s"] == 1150 and rows["reference"]["chosen"]
    first = rows["reference (first)"]
    assert first["tokens_per_s"] == 1000 and first["passed"] and not first["chosen"]
    assert first["why"] == ("the config as given, first: the sooner of its two measurements "
                            "is the reference row, which candidates must beat")
    assert not rows["a"]["chosen"] and record["unsteady"] is None
    cached = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert cached["choice"]["label"] == "reference"


def test_a_load_that_changes_the_reference_3x_keeps_the_config_and_caches_nothing(
        monkeypatch, tmp_path, capsys):
    record, rows, _ = _search_with(monkeypatch, tmp_path, {
        "reference": 1000, "a": 5000, "reference (measured again)": 3000})
    assert record["choice"]["label"] == "reference"  # "a" beats both takes: still not trusted
    assert record["unsteady"].startswith(
        "the config as given measured 1,000 and then 3,000 real tokens/s (67% apart): the "
        "machine's load changed during the search")
    assert rows["reference (first)"]["why"] == record["unsteady"]
    assert rows["a"]["why"] == "not trusted: the machine's load changed during the search"
    assert record["unsteady"].endswith("raise accelerate.load_tolerance=0.2)")
    assert not list(tmp_path.glob("*.json"))
    err = capsys.readouterr().err
    assert "rapidformer: warning: accelerate=auto: the config as given measured" in err
    assert "the result is not cached: the machine's load changed during the search" in err
    # a machine known to be noisy: a larger tolerance trusts the sooner take
    record, rows, _ = _search_with(monkeypatch, tmp_path / "noisy", {
        "reference": 1000, "a": 5000, "reference (measured again)": 3000},
        extra=["accelerate.load_tolerance=1.0"])
    assert record["choice"]["label"] == "a" and record["unsteady"] is None


def test_an_unsteady_search_says_so_in_tune_s_summary(monkeypatch, tmp_path, capsys):
    from rapidformer.cli.verbs.tune import tune_command
    from rapidformer.tuning import search as search_module

    record = {"table": "|", "choice": {"label": "reference", "overrides": []},
              "search_s": 26.0, "budget_s": 300.0, "command": "python -m rapidformer",
              "unsteady": "the config as given measured 1 and then 3 real tokens/s"}
    monkeypatch.setattr(search_module, "search", lambda *a, **k: record)
    assert tune_command(["accelerate.cache=false"]) == 0
    assert "choice: reference (search 26 s of 300 s budget; the machine's load changed during " \
           "it: no gain trusted, nothing cached)" in capsys.readouterr().out


def test_a_candidate_sooner_than_both_measurements_of_the_reference_is_chosen(monkeypatch,
                                                                              tmp_path):
    record, rows, calls = _search_with(monkeypatch, tmp_path, {"reference": 1000, "a": 3000})
    assert record["choice"]["label"] == "a"
    again = rows["reference (measured again)"]
    assert again["tokens_per_s"] == 1000 and again["passed"] and not again["chosen"]
    assert {"prior", "estimate_gb", "loss_check", "time_to_result_s"} <= set(again)
    assert "reference (first)" not in rows
    # no second take when the reference stays the choice
    record, rows, calls = _search_with(monkeypatch, tmp_path / "2", {"reference": 3000,
                                                                     "a": 1000})
    assert [label for label, _ in calls] == ["reference", "a"]


@pytest.mark.parametrize("again, why", [
    ("timeout", "timeout: still running: stopped"),
    ("diverged losses", "its losses differ from the first measurement's: +2900.0% of the "
                        "reference's mean loss (tolerance 10%)"),
])
def test_a_second_take_that_fails_leaves_the_first_standing(monkeypatch, tmp_path, again, why):
    # faster, but its losses are not the config's: it may not become the reference
    record, rows, _ = _search_with(monkeypatch, tmp_path, {
        "reference": 1000, "a": 3000, "reference (measured again)": 5000}, again=again)
    assert record["choice"]["label"] == "a"
    assert rows["reference"]["tokens_per_s"] == 1000
    assert rows["reference (measured again)"]["why"] == (
        f"the config as given, measured again: {why}; its first measurement stands")
    assert not rows["reference (measured again)"]["passed"]


def test_a_second_take_the_budget_stops_marks_the_search_cut(monkeypatch, tmp_path):
    # "a" takes its whole 16 s: the second take has the 12 s the first took, and needs 13.2
    record, rows, calls = _search_with(monkeypatch, tmp_path, {"reference": 1000, "a": 3000},
                                       budget=40, again="budget")
    assert calls[2][0] == "reference (measured again)"
    assert record["truncated"]["by"] == "accelerate.budget_s"  # a larger budget searches again
    assert rows["reference (measured again)"]["why"].startswith(
        "the config as given, measured again: timeout")


def test_the_budget_keeps_room_for_the_reference_s_second_take(monkeypatch, tmp_path):
    # 12 s a measurement: a budget of 30 leaves 18 s after the reference, less than a
    # candidate's 12 s beside a second take's 12
    record, rows, calls = _search_with(monkeypatch, tmp_path, {"reference": 1000, "a": 3000},
                                       budget=30)
    assert [label for label, _ in calls] == ["reference"]
    assert "less than a measurement and the reference's second take (about 12 s each)" in \
        rows["every other candidate"]["why"]
    # 40: "a" is measured within 16 s, and the second take has its 12
    record, rows, calls = _search_with(monkeypatch, tmp_path / "2", {"reference": 1000,
                                                                     "a": 3000}, budget=40)
    assert calls[:2] == [("reference", 40), ("a", 16)]
    assert calls[2][0] == "reference (measured again)" and calls[2][1] >= 12
    assert record["search_s"] <= 40
