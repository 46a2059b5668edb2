"""accelerate=auto's packing candidate: the config's examples a step in fewer, packed rows.

An unpacked SFT run logs what data.packing=true would make of its training examples
(data/chat.py packing_hint); the reference's measurement reads it, and the packing candidate
divides the global batch (in rows) by the examples a packed row holds, so that it trains the
config's optimizer steps on about its examples (within space.EXAMPLES_TOLERANCE). In-process
on given numbers, then one real search on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

from rapidformer.tuning.enumerate import candidates
from rapidformer.tuning.measure import Measurement, summarize
from rapidformer.tuning.pick import judge
from rapidformer.tuning.space import (REFERENCE, Candidate, PackedRows, apply, hand_picked,
                                      packed_batch, step_content_change)

from tests.conftest import assert_ok, run_cli
from tests.test_tuning import settled

CPU = torch.device("cpu")
SFT = ["+recipe=llama_sft", "trainer.train_iters=50", "accelerate=auto",
       "accelerate.max_candidates=40"]


def sft(*overrides: str):
    return settled(*SFT, *overrides)[2]


def test_the_packing_hint_counts_the_rows_that_packing_makes():
    from datasets import Dataset

    from rapidformer.data.chat import pack, packing_hint
    from rapidformer.tuning.measure import PACKING_HINT

    lengths = [7, 30, 3, 12, 25, 1, 16, 9, 31, 2]
    rows = Dataset.from_dict({"input_ids": [[5] * n for n in lengths],
                              "labels": [[5] * n for n in lengths]})
    text = packing_hint(rows, 32)
    found = PACKING_HINT.search(f"INFO {text}")
    assert (int(found.group(1)), int(found.group(2))) == (10, len(pack(rows, 32)))
    assert len(pack(rows, 32)) == 5  # 136 tokens in rows of 32: 5 at least, and best fit


@pytest.mark.parametrize("micro, global_, per_row, expected", [
    (16, 16, 4.0, (4, 4)),
    (16, 16, 4.1, (4, 4)),  # 16.4 examples a step: within the tolerance
    (2, 16, 4.0, (4, 2)),  # the config's micro batch divides the rows: kept
    (3, 15, 4.0, (4, 2)),  # 3.75 -> 4 rows; the largest divisor of 4 at most 3
    (8, 8, 3.0, (3, 3)),  # none within 10 % (6 or 9 examples): the nearest, 2.67 -> 3 rows
    (4, 4, 10.0, (1, 1)),  # under one row: one (step_content_change then refuses it)
    (4, 32, 1.0, (32, 4)),  # nothing packs: the config's rows
    # of the rows within 10 %, the fewest micro-batches: 13 rows would be 13 micro-batches of
    # one, 14 are 2 of 7; 22 would be 11 of 2, 21 are 3 of 7 (24, 3 of 8, is further)
    (8, 16, 1.23, (14, 7)),
    (8, 32, 1.45, (21, 7)),
])
def test_the_packed_batch_holds_the_configs_examples_a_step(micro, global_, per_row, expected):
    cfg = sft(f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={global_}")
    assert packed_batch(cfg, per_row) == expected


@pytest.mark.parametrize("rows, per_row, refused", [
    (4, 4.0, ""),
    (4, 4.35, ""),  # 17.4 examples against 16: within 10 %
    (4, 4.5, "about 18.0 examples at 4.50 a row, the config's 16, more than 10% apart"),
    (16, 4.0, "about 64.0 examples at 4.00 a row, the config's 16"),  # packing at 16 rows
])
def test_packing_keeps_the_steps_only_at_the_configs_examples_a_step(rows, per_row, refused):
    base = sft("trainer.micro_batch_size=4", "trainer.global_batch_size=16")
    cfg = apply(base, Candidate("packing", (("data.packing", "true"),
                                            ("trainer.global_batch_size", str(rows)))))
    why = step_content_change(base, cfg, per_row)
    assert (refused in why) if refused else why == ""
    # without the rows known, packing is refused whatever the batch (a step of as many rows
    # holds several times the examples)
    unknown = step_content_change(base, cfg)
    assert unknown.startswith("packing") and \
        "changes the examples each of trainer.train_iters=50 steps" in unknown
    # another max_seq_length packs other rows than the hint counted
    longer = apply(cfg, Candidate("longer", (("data.max_seq_length", "96"),)))
    assert "packing" in step_content_change(base, longer, per_row)


def test_the_packing_candidate_is_admitted_with_its_rows_and_pins_nothing_else():
    base = sft("trainer.micro_batch_size=8", "trainer.global_batch_size=16")
    pinned = {"trainer.micro_batch_size": "8", "trainer.global_batch_size": "16"}
    admitted, left_out, _ = candidates(base, CPU, memory_auto=False, pinned=pinned,
                                       packed=PackedRows(400, 97))
    by_label = {a.candidate.label: a.candidate for a in admitted}
    packing = by_label["packing (4 rows a step)"]
    # evaluation is not packed: it keeps the config's batch of examples
    assert dict(packing.overrides) == {"data.packing": "true", "trainer.global_batch_size": "4",
                                       "trainer.micro_batch_size": "4",
                                       "trainer.eval_micro_batch_size": "8"}
    assert packing.examples_per_row == pytest.approx(400 / 97)
    # never with another micro batch (both set it: the later would undo packing's rows)
    assert not [label for label in by_label if "packing" in label and "mbs=" in label]
    assert "mbs=4" not in by_label  # the command line's micro batch is kept elsewhere
    # the command line's data.packing=false is kept: no packing candidate at all
    admitted, left_out, _ = candidates(base, CPU, memory_auto=False,
                                       pinned={**pinned, "data.packing": "false"},
                                       packed=PackedRows(400, 97))
    assert not [a for a in admitted if "packing" in a.candidate.label]
    assert any("packing" in r["label"] and "data.packing=false" in r["why"] for r in left_out)
    # rows too few for the config's examples a step: listed with why
    _, left_out, _ = candidates(sft("trainer.micro_batch_size=2", "trainer.global_batch_size=2"),
                                CPU, memory_auto=False, packed=PackedRows(400, 40))
    assert "about 10.0 examples at 10.00 a row, the config's 2" in \
        {r["label"]: r["why"] for r in left_out}["packing (1 row a step)"]


@pytest.mark.parametrize("examples, rows, tried", [
    (200, 200, False),  # every example fills a row: packing would train the config's rows
    (200, 199, False),  # 16 examples at 1.005 a row are 16 rows still
    (200, 150, True),   # 1.33 a row: 12 rows a step
])
def test_packing_that_would_not_cut_the_rows_is_not_measured(examples, rows, tried):
    base = sft("trainer.micro_batch_size=8", "trainer.global_batch_size=16",
               "accelerate.axes=[sequences]")
    admitted, left_out, _ = candidates(base, CPU, memory_auto=False,
                                       packed=PackedRows(examples, rows))
    measured = [a.candidate.label for a in admitted if "packing" in a.candidate.label]
    assert bool(measured) == tried, (measured, left_out)
    if not tried:
        assert {r["label"]: r["why"] for r in left_out}["packing (16 rows a step)"] == (
            f"not tried: packing lays the training examples {examples / rows:.2f} a row: the "
            f"config's 16 examples a step would take as many rows, as they do unpacked")


def test_a_hand_picked_packing_candidate_is_held_to_the_configs_examples_a_step():
    base = sft("trainer.micro_batch_size=4", "trainer.global_batch_size=16",
               "accelerate.extra_candidates=['data.packing=true trainer.global_batch_size=4',"
               "'data.packing=true']", "accelerate.max_candidates=0")
    admitted, left_out, _ = candidates(base, CPU, memory_auto=False, packed=PackedRows(400, 100))
    assert [a.candidate.label for a in admitted] == [
        "data.packing=true trainer.global_batch_size=4"]
    assert "about 64.0 examples" in {r["label"]: r["why"] for r in left_out}["data.packing=true"]
    assert hand_picked("data.packing=false", PackedRows(4, 1)).examples_per_row is None


def test_the_measurement_reads_the_packing_hint_and_epochs_allow_whole_examples_a_row():
    steps = [{"loss": 2.0, "window_s": 1.0, "tokens_per_s": 100.0} for _ in range(5)]
    log = ("rapidformer INFO task=sft: data.packing=true would lay the 6000 training examples "
           "in 1462 rows of at most 2048 tokens (4.10 a row)\ntraining 200 iterations (375 per "
           "epoch")
    m = summarize(REFERENCE, steps, 2, 10.0, 0, log)
    assert m.packed_rows == PackedRows(6000, 1462) and m.steps_per_epoch == 375
    assert summarize(REFERENCE, steps, 2, 10.0, 0, "no hint").packed_rows is None

    def measured(label, per_epoch, per_row=None):
        return Measurement(Candidate(label, examples_per_row=per_row), "ok", 10.0,
                           losses=[2.0] * 5, fixed_s=1.0, tokens_per_s=100.0,
                           tokens_per_step=100.0, steps_per_epoch=per_epoch)

    # an epoch of 375 steps: packing's 366 (whole examples a row) is its schedule, 94 not; a
    # candidate that does not pack (a data.max_seq_length that drops examples) gets no leeway
    verdicts = judge(measured("reference", 375),
                     [measured("near", 366, 4.1), measured("far", 94, 4.1),
                      measured("not packing", 366)],
                     run_tokens=1e5, warmup_steps=2, tolerance=0.1)
    assert [v.passed for v in verdicts] == [True, True, False, False]
    assert "(94 per epoch, the config as given 375)" in verdicts[2].why


def _packed(label, losses, held_out, per_row=4.0):
    return Measurement(Candidate(label, examples_per_row=per_row), "ok", 10.0, losses=losses,
                       fixed_s=1.0, tokens_per_s=100.0, tokens_per_step=100.0,
                       held_out_loss=held_out)


@pytest.mark.parametrize("reference_held_out, candidate, passed, words", [
    # rows grouped by length train easier examples first: the training loss is 30 % lower
    # with the model no different; the held-out loss says so
    (2.0, _packed("packing", [1.4] * 5, 2.01), True, "+0.5% of the reference's validation"),
    (2.0, _packed("packing", [1.4] * 5, 2.5), False, "differs: +25.0% of the reference's valid"),
    (2.0, _packed("packing", [1.4, float("nan")] * 2, 2.0), False, "not finite"),
    (2.0, _packed("packing", [2.0] * 5, float("inf")), False, "not finite"),
    # no validation split: the training losses, whatever they are
    (None, _packed("packing", [1.4] * 5, None), False, "of the reference's mean loss"),
    # a candidate that does not pack: its own batches are the reference's, the training losses
    (2.0, _packed("bf16", [1.4] * 5, 2.0, per_row=None), False, "of the reference's mean loss"),
])
def test_packing_is_checked_on_the_held_out_loss(reference_held_out, candidate, passed, words):
    reference = _packed("reference", [2.0] * 5, reference_held_out, per_row=None)
    verdicts = judge(reference, [candidate], run_tokens=1e5, warmup_steps=2, tolerance=0.1)
    assert verdicts[1].passed is passed and words in verdicts[1].loss_check, verdicts[1]


def test_a_run_trains_the_packing_choice_with_the_command_lines_batch_sizes(monkeypatch,
                                                                            tmp_path):
    from rapidformer.tuning import run as tuning_run
    from rapidformer.tuning import search as search_module

    hint = ("task=sft: data.packing=true would lay the 400 training examples in 100 rows of at "
            "most 256 tokens (4.00 a row)")

    def measure(run_overrides, candidate, steps, warmup, limit, work):
        rate = 5000.0 if candidate.label.startswith("packing") else 1000.0
        rows = [{"loss": 2.0, "window_s": 1000 / rate, "tokens_per_s": rate}] * steps
        m = summarize(candidate, rows, warmup, 4 + steps * 1000 / rate, 0, hint)
        m.held_out_loss = 2.0
        return m

    monkeypatch.setattr(search_module, "measure", measure)
    given = ["+recipe=llama_sft", "trainer.train_iters=50", "trainer.micro_batch_size=8",
             "trainer.global_batch_size=16", "accelerate=auto", "accelerate.axes=[sequences]",
             "accelerate.max_fraction=100", f"accelerate.cache_dir={tmp_path / 'cache'}",
             f"trainer.output_dir={tmp_path / 'run'}"]
    composed, _, cfg = settled(*given)
    got = tuning_run.tuned_overrides(given, composed, cfg)
    record = dict(tuning_run._pending)
    tuning_run._pending.clear()
    assert record["choice"]["label"] == "packing (4 rows a step)", record["table"]
    assert [o.lstrip("+") for o in got[-4:]] == [
        "data.packing=true", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
        "trainer.eval_micro_batch_size=8"]
    assert "trainer.global_batch_size=16" not in got  # the choice's rows replace them
    reference = next(r for r in record["rows"] if r["label"] == "reference")
    assert reference["packed_rows"] == {"examples": 400, "rows": 100}
    # the command line's data.packing=false is kept: the reference trains
    composed, _, cfg = settled(*given, "data.packing=false")
    got = tuning_run.tuned_overrides([*given, "data.packing=false"], composed, cfg)
    assert tuning_run._pending["choice"]["label"] == "reference"
    tuning_run._pending.clear()


@pytest.mark.slow
def test_a_search_on_sft_data_measures_packing_at_the_configs_examples_a_step(tmp_path):
    result = assert_ok(run_cli(
        ["tune", "--json", "+recipe=llama_sft", "data.synthetic_train_size=200",
         "trainer.train_iters=40", "trainer.micro_batch_size=8", "trainer.global_batch_size=8",
         "accelerate.axes=[sequences]", "accelerate.steps=5", "accelerate.warmup_steps=2",
         "accelerate.max_fraction=100", "accelerate.cache=false"],
        tmp_path, module="rapidformer.cli"))
    record = json.loads(result.stdout)
    rows = {r["label"]: r for r in record["rows"] if "status" in r}
    packing = next(r for label, r in rows.items() if label.startswith("packing ("))
    reference = rows["reference"]
    assert packing["status"] == "ok" and packing["passed"], record["table"]
    given = dict(o.split("=", 1) for o in packing["overrides"])
    assert given["data.packing"] == "true" and int(given["trainer.global_batch_size"]) < 8
    # the same examples a step: as many real tokens a step (within the rows' rounding; which
    # is faster on a CPU is the measurement's to say)
    assert packing["tokens_per_step"] == pytest.approx(reference["tokens_per_step"], rel=0.25)
    assert packing["time_to_result_s"] > 0
    # checked on the validation loss (the synthetic chats have a validation split)
    assert "validation loss" in packing["loss_check"] and reference["held_out_loss"] > 0
