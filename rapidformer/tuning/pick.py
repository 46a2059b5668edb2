"""The loss check and the choice by time to result: pure functions of the measurements.

Loss check: a candidate trains as the reference does when every step's loss is finite and the
mean of its losses over the measured steps (same seed, same batches: the reference's first
steps) is within `tolerance` of the reference's mean, as a share of it. The mean, not each
step: dropout masks and a different micro-batch split move single steps; a wrong setting
(fp16 overflow, a bad kernel) moves all of them or gives NaN. A packing candidate's steps hold
other examples (its rows group them by length), whose training loss differs by what they are:
its check is the validation loss after the measured steps against the reference's (the same
held-out examples), when both have one (held_out_check).

Time to result of a candidate, for a run of `run_tokens` real tokens (a run given in epochs:
the same tokens whatever the setting) or of `run_steps` steps (trainer.train_iters: packing
puts more real tokens in each of its steps, so the steps, not the tokens, are what it runs):

    fixed           = the child's time outside its steps: start-up, and the evaluation and test
                      at its end, their compilation included (a compiled model compiles its
                      evaluation apart from its training step)
    warm-up excess  = the warm-up steps' time - the time those steps take at the rate after it
                      (compilation, CUDA graph capture, autotuning: paid once per run)
    time to result  = fixed + warm-up excess + run_tokens / rate
                      (or + run_steps x its real tokens a step / rate)

and the search's own cost, the same for every candidate, is added to what is reported. So a
compiled candidate twice as fast per step loses to eager on a run too short to pay its
compilation, and wins on a long one. The child evaluates once; a run that evaluates every
epoch pays the later evaluations at the evaluation's rate, not counted here.

The rate is the median of the steps' rates (measure.summarize), and a candidate replaces the
config as given only when sooner by more than MARGIN plus the larger rate spread of the two:
identical settings on a loaded machine must not win by noise. In a run given in epochs a
candidate whose epoch has another number of optimizer steps (packing at the config's rows a
step) is out: the run would follow another schedule, which the first steps' loss cannot show
(other_epoch). Packing at the config's examples a step has about its steps (their rows hold
whole examples): within space.EXAMPLES_TOLERANCE it runs the config's schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rapidformer.tuning.measure import Measurement


@dataclass(frozen=True)
class Verdict:
    label: str
    passed: bool
    loss_check: str  # "ok (+1.2 %)", "diverged (+340 %)", "not finite", "-"
    time_to_result_s: float | None
    why: str = ""  # why it is out, when it is
    spread: float = 0.0  # its steps' rate spread (Measurement.rate_spread)


def loss_check(reference: list[float], losses: list[float], tolerance: float
               ) -> tuple[bool, str]:
    if not losses or not all(math.isfinite(x) for x in losses):
        return False, "not finite" if losses else "no loss"
    n = min(len(reference), len(losses))
    ref, got = sum(reference[:n]) / n, sum(losses[:n]) / n
    change = (got - ref) / abs(ref) if ref else got - ref
    words = f"{change:+.1%} of the reference's mean loss"
    if abs(change) > tolerance:
        return False, f"differs: {words} (tolerance {tolerance:.0%})"
    return True, f"ok: {words}"


def held_out_check(reference: Measurement, m: Measurement, tolerance: float
                   ) -> tuple[bool, str] | None:
    """The loss check of a candidate whose steps train other examples than the reference's
    (packing): its training losses finite, and its validation loss after the measured steps
    within `tolerance` of the reference's; None: not such a candidate, or no validation loss
    on both sides (the training losses' check then, which the examples' difficulty moves)."""
    if not m.candidate.examples_per_row or reference.held_out_loss is None or \
            m.held_out_loss is None:
        return None
    if not m.losses or not all(math.isfinite(x) for x in [*m.losses, m.held_out_loss]):
        return False, "not finite"
    ref, got = reference.held_out_loss, m.held_out_loss
    change = (got - ref) / abs(ref) if ref else got - ref
    words = f"{change:+.1%} of the reference's validation loss (its steps hold other examples)"
    if abs(change) > tolerance:
        return False, f"differs: {words} (tolerance {tolerance:.0%})"
    return True, f"ok: {words}"


# a candidate replaces the config as given only when it is this much sooner to the result, and
# by more than the spread of the steps' rates (choose): a start-up's jitter or a noisy rate moves
# a few percent, and a setting that gains less than that is not worth its risk
MARGIN = 0.03


def time_to_result(m: Measurement, run_tokens: float, warmup_steps: int,
                   run_steps: int | None = None) -> float | None:
    if not m.tokens_per_s or m.tokens_per_step is None:
        return None
    excess = max(m.warmup_s - warmup_steps * m.tokens_per_step / m.tokens_per_s, 0.0)
    tokens = run_tokens if run_steps is None else run_steps * m.tokens_per_step
    return m.fixed_s + excess + tokens / m.tokens_per_s


def judge(reference: Measurement, measured: list[Measurement], run_tokens: float,
          warmup_steps: int, tolerance: float, run_steps: int | None = None) -> list[Verdict]:
    """A verdict for the reference and each measured candidate."""
    out = []
    for m in [reference, *measured]:
        label = m.candidate.label
        if m.status != "ok":
            out.append(Verdict(label, False, "-" if not m.losses else
                               loss_check(reference.losses, m.losses, tolerance)[1],
                               None, f"{m.status}: {m.reason}"))
            continue
        passed, words = held_out_check(reference, m, tolerance) or \
            loss_check(reference.losses, m.losses, tolerance)
        ttr = time_to_result(m, run_tokens, warmup_steps, run_steps)
        why = "" if passed else "loss check"
        if passed and ttr is None:
            passed, why = False, "no rate measured"
        if passed and (other := other_epoch(reference, m, run_steps)):
            passed, why = False, other
        out.append(Verdict(label, passed, words, ttr, why, m.rate_spread))
    return out


def other_epoch(reference: Measurement, m: Measurement, run_steps: int | None) -> str:
    """Why `m` is no candidate of a run given in epochs (`run_steps` None): its epoch has
    another number of optimizer steps (packing, another global batch), so the run would follow
    another schedule, which its first steps' loss cannot show; else "". Packed rows hold whole
    examples: steps within EXAMPLES_TOLERANCE of the config's are its schedule."""
    from rapidformer.tuning.space import EXAMPLES_TOLERANCE

    ref, got = reference.steps_per_epoch, m.steps_per_epoch
    # only a packing candidate's rows of whole examples earn the tolerance; any other
    # candidate whose epoch has other steps (a data.max_seq_length that drops examples) is out
    within = EXAMPLES_TOLERANCE * ref if ref and m.candidate.examples_per_row else 0
    if run_steps is not None or ref is None or got is None or abs(got - ref) <= within:
        return ""
    return (f"it changes the optimizer steps of a run given in epochs ({got} per epoch, the "
            f"config as given {ref}); give trainer.train_iters to compare")


def choose(verdicts: list[Verdict]) -> Verdict:
    """The soonest passing candidate that is sooner than the reference (first) by more than
    MARGIN plus the larger of the two rates' spreads, as a share of the reference's time, else
    the reference: a gain within what the steps of one setting vary by is noise (identical
    settings measured on a loaded machine differ by that much). Each candidate is held to its
    own spread: a noisier, faster one does not hide a steady one that clears it."""
    passing = [v for v in verdicts if v.passed]
    if not passing:
        raise ValueError("no candidate passed, the reference included")
    reference = verdicts[0]
    if not reference.passed:
        return min(passing, key=lambda v: v.time_to_result_s)
    # each candidate against its own margin: a noisier, faster one does not hide a steady one
    clear = [v for v in passing if v is not reference and v.time_to_result_s <= (
        1 - MARGIN - max(reference.spread, v.spread)) * reference.time_to_result_s]
    return min(clear, key=lambda v: v.time_to_result_s) if clear else reference
