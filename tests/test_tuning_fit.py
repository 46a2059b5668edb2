"""accelerate=auto where the config as given does not fit the device by the memory plan (a run
whose measured steps fit and whose longest batches do not): it stays the baseline of the loss
check and the rates, never the choice; any candidate that fits and passes replaces it without
a second take of it; where none can, one message says how to make it fit."""
from __future__ import annotations

import pytest

from rapidformer.errors import InputError
from rapidformer.tuning import search as search_module
from rapidformer.tuning.measure import summarize
from tests.test_tuning import fake_measure, settled

# 1.6 GB less the 5 % and 1.5 GB reserve leaves about 20 MB: a micro batch of 32 at length 128
# does not fit the tiny BERT, 16 does (tests/test_tuning.py's memory plan test); the micro batch
# is the search's to change (not on the command line)
TOO_BIG = ["accelerate=auto", "accelerate.cache=false", "memory.device_memory_gb=1.6",
           "data.max_seq_length=128", "trainer.global_batch_size=32",
           "accelerate.axes=[micro_batch_size]", "accelerate.max_fraction=100"]


def _search(monkeypatch, measure, *extra: str) -> dict:
    monkeypatch.setattr(search_module, "measure", measure)
    overrides = [*TOO_BIG, *extra]
    return search_module.search(overrides, settled(*overrides)[2], memory_auto=False)


@pytest.mark.parametrize("rate", [900.0, 1000.0, 3000.0])  # slower, as fast, faster
def test_a_candidate_that_fits_replaces_a_config_that_does_not_whatever_its_rate(monkeypatch,
                                                                                   rate):
    taken = []
    fake = fake_measure({"reference": 1000.0, "mbs=16": rate})

    def measure(run_overrides, candidate, *args):
        taken.append(candidate.label)
        return fake(run_overrides, candidate, *args)

    record = _search(monkeypatch, measure)
    rows = {r["label"]: r for r in record["rows"]}
    assert record["choice"]["label"] == "mbs=16"
    assert record["choice"]["overrides"] == ["trainer.micro_batch_size=16",
                                             "trainer.global_batch_size=32"]
    assert not rows["reference"]["passed"] and not rows["reference"]["chosen"]
    assert rows["reference"]["why"].startswith("does not fit: the memory plan estimates")
    assert taken == ["reference", "mbs=16"]  # no second take of a config that cannot win


def test_a_config_that_does_not_fit_with_no_candidate_that_passes_says_how_to_fit(monkeypatch):
    fake = fake_measure({"reference": 1000.0, "mbs=16": 2000.0})

    def diverging(run_overrides, candidate, steps, warmup, limit, work):
        m = fake(run_overrides, candidate, steps, warmup, limit, work)
        if candidate.label == "mbs=16":
            m.losses = [x * 3 for x in m.losses]
        return m

    with pytest.raises(InputError) as caught:
        _search(monkeypatch, diverging)
    said = str(caught.value)
    assert "the config as given does not fit this device (the memory plan estimates" in said
    assert "mbs=16: loss check" in said
    # at 1.6 GB no memory mode fits (rapidformer plan says so): not memory=auto, then
    assert "make it fit: no memory mode fits this device by the plan: lower" in said


def test_a_budget_with_no_room_for_a_setting_that_fits_is_an_error_not_the_config(monkeypatch):
    # the reference's measurement takes 5 s of a 6 s budget: nothing that fits can be measured
    with pytest.raises(InputError, match="left no room to measure a setting that does .* "
                                         "raise accelerate.budget_s .* make it fit: no memory"):
        _search(monkeypatch, fake_measure({"reference": 1000.0}, wall_s=5.0),
                "accelerate.budget_s=6")


def failing(status: str, reason, wall_s: float | None = 3.0, rss_kib: int = 0, text: str = ""):
    """A measure() whose every child ends with `status`: `reason` (a function of the child's
    time limit where it names it); `wall_s` None: the child ran to its limit."""
    def measure(run_overrides, candidate, steps_, warmup, limit, work):
        m = summarize(candidate, [], warmup, limit if wall_s is None else wall_s, rss_kib, text)
        m.status, m.reason = status, reason(limit) if callable(reason) else reason
        return m
    return measure


def test_a_config_that_does_not_fit_and_runs_out_of_memory_in_its_measurement(monkeypatch):
    oom = failing("out_of_memory", "CUDA out of memory. Tried to allocate 16.00 GiB", rss_kib=1,
                  text="CUDA out of memory")
    with pytest.raises(InputError, match="does not fit this device .* ran out of memory in its "
                                         "8 measured steps \\(CUDA out of memory"):
        _search(monkeypatch, oom)


def test_a_budget_that_cuts_a_config_that_does_not_fit_says_so(monkeypatch):
    cut = failing("timeout", lambda limit: f"still running after {limit:.0f} s (after 2 of 8 "
                                           f"steps)", wall_s=None)
    with pytest.raises(InputError, match="accelerate.budget_s=3 ended before the config as "
                                         "given finished .* does not fit this device .* raise "
                                         "accelerate.budget_s"):
        _search(monkeypatch, cut, "accelerate.budget_s=3")


def test_a_config_that_does_not_fit_and_diverges_is_told_so_not_to_fit(monkeypatch):
    diverged = failing("diverged", "exit code 4: rapidformer: error: the loss was NaN")
    with pytest.raises(InputError) as caught:
        _search(monkeypatch, diverged)
    said = str(caught.value)
    assert "did not train 8 steps (diverged: exit code 4" in said
    assert "(it also does not fit this device: the memory plan estimates" in said
    assert "Run it without accelerate=auto to see why" in said


@pytest.mark.parametrize("code, logged, status", [
    (4, "rapidformer: warning: ... the run's longest batches may not fit\n", "diverged"),
    (4, "torch.OutOfMemoryError: CUDA out of memory\n", "diverged"),  # the exit code decides
    (5, "rapidformer: error: out of GPU memory (CUDA out of memory. Tried ...)\n",
     "out_of_memory"),
    (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
     "out_of_memory"),
    (1, "the memory plan estimates 9 GB per device: may run out of memory\n", "crashed"),
])
def test_a_child_s_failure_is_told_by_its_exit_code_then_torch_s_words(monkeypatch, tmp_path,
                                                                      code, logged, status):
    from rapidformer.tuning import measure as measuring
    from rapidformer.tuning.space import REFERENCE

    def failed(overrides, label, limit, log_path):
        log_path.write_text(logged)
        return code, 1.0, 0

    monkeypatch.setattr(measuring, "run_child", failed)
    assert measuring.measure(["+recipe=quickstart"], REFERENCE, 4, 1, 30.0,
                             tmp_path).status == status


def test_the_advice_to_fit_names_memory_auto_only_where_a_mode_fits():
    from rapidformer.planning.memory_plan import fitting_advice

    def advice(gb: float) -> str:
        return fitting_advice(settled("memory.device_memory_gb=" + str(gb),
                                      "data.max_seq_length=128")[2])

    assert advice(80).startswith("memory=auto picks a mode that fits")
    assert advice(1.6).startswith("no memory mode fits this device by the plan")


def test_a_config_that_fits_keeps_its_second_take_and_can_stay_the_choice(monkeypatch):
    overrides = [o for o in TOO_BIG if not o.startswith("memory.device_memory_gb")]
    monkeypatch.setattr(search_module, "measure",
                        fake_measure({"reference": 1000.0, "mbs=16": 900.0}))
    record = search_module.search(overrides, settled(*overrides)[2], memory_auto=False)
    assert record["choice"]["label"] == "reference"
    assert {r["label"]: r for r in record["rows"]}["reference"]["passed"]


def test_the_adapters_axis_fuses_lora_layers_where_the_config_may():
    from tests.test_tuning import search_space

    lora = ["+recipe=llama_lora", "trainer.train_iters=50", "accelerate=auto",
            "accelerate.max_candidates=40"]
    _, found, left_out = search_space(*lora)
    labels = [c.label for c in found]
    assert "fused adapters" in labels
    fused = next(c for c in found if c.label == "fused adapters")
    assert fused.override_list() == ["peft.fused=true"]
    # graph=compile traces peft's own modules: never a candidate beside fused adapters
    assert not [label for label in labels if "compile" in label and "fused adapters" in label]
    import torch

    from rapidformer.tuning.enumerate import candidates
    from rapidformer.tuning.space import pins

    given = [*lora, "peft.fused=true"]
    admitted, left_out, _ = candidates(settled(*given)[2], torch.device("cpu"), False,
                                       pinned=pins(given))
    assert not [a for a in admitted if "adapters" in a.candidate.label]  # the command line's
    assert any("peft.fused=true, which the command line sets" in r["why"] for r in left_out)
    _, found, left_out = search_space("accelerate=auto", "accelerate.max_candidates=40")
    assert not [c for c in found if "adapters" in c.label] and \
        not [label for label in left_out if "adapters" in label]  # no peft: no axis
