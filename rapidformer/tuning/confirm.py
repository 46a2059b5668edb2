"""The config as given measured again before a candidate replaces it.

The reference (the config as given) is measured first and each candidate after it, each in a
child of its own: a machine busier during the reference's child (on a CPU, another job) makes
the config look slower than it is, and any candidate, an identical one too, would win and be
cached. So a candidate that would replace the config has the config measured again, and the
sooner of its two measurements is the reference candidates must beat; two measurements
whose rates differ by more than accelerate.load_tolerance plus their spreads say the load
changed during the search, and then no gain is trusted (the config as given, nothing cached).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from rapidformer.config.schema import RunConfig
from rapidformer.tuning.measure import Measurement
from rapidformer.tuning.pick import loss_check
from rapidformer.tuning.report import say
from rapidformer.tuning.space import REFERENCE

AGAIN = "measured again"


@dataclass
class Confirmation:
    reference: Measurement  # what candidates are held to: the sooner of the config's takes
    rows: list[dict] = field(default_factory=list)  # the config's other measurement
    unsteady: str = ""  # why no gain is trusted: the load changed during the search
    budget_stopped: bool = False  # the budget's end stopped the second take


def confirmed(cfg: RunConfig, ref: Measurement, winner: str, left: float, measure_as,
              time_of) -> Confirmation:
    """Once `winner` would replace the config as given: the config measured again
    (`measure_as(candidate, limit)`: a child as the search measures one) with `left` seconds of
    the budget, and the sooner of its two measurements by `time_of`. A second take that fails,
    or whose losses differ from the first's, leaves the first standing (one the budget's end
    stopped marks the search cut, as a candidate's does); two takes whose rates differ by more
    than accelerate.load_tolerance plus their spreads say the load changed during the search."""
    a = cfg.accelerate
    say(f"{winner} would replace the config as given: measuring the config as given again "
        f"(the machine's load may have changed since its first measurement)")
    limit = min(a.candidate_timeout_s, max(left, ref.wall_s))
    again = measure_as(replace(REFERENCE, label=f"{REFERENCE.label} ({AGAIN})"), limit)
    same, words = loss_check(ref.losses, again.losses, a.loss_tolerance)
    first_s, again_s = time_of(ref), time_of(again)
    usable = again.status == "ok" and not again.reason and same and again_s is not None
    sooner = usable and first_s is not None and again_s < first_s
    other, other_s = (ref, first_s) if sooner else (again, again_s)
    row = {**other.as_dict(), "label": f"{REFERENCE.label} ({'first' if sooner else AGAIN})",
           "prior": 1.0, "estimate_gb": None, "loss_check": words, "passed": usable,
           "chosen": False, "time_to_result_s": None if other_s is None else round(other_s, 3),
           "why": f"the config as given, {'first' if sooner else AGAIN}: the sooner of its two "
                  f"measurements is the reference row, which candidates must beat"}
    if not usable:
        failed = f"{again.status}: {again.reason}" if again.status != "ok" or again.reason \
            else f"its losses differ from the first measurement's: " \
                 f"{words.split(': ', 1)[-1]}" if not same else "no rate"
        row["why"] = f"the config as given, {AGAIN}: {failed}; its first measurement stands"
        return Confirmation(ref, [row], budget_stopped=again.status == "timeout" and
                            limit < a.candidate_timeout_s)
    rates = ref.tokens_per_s, again.tokens_per_s
    apart = abs(rates[0] - rates[1]) / max(rates)
    unsteady = "" if apart <= a.load_tolerance + max(ref.rate_spread, again.rate_spread) else (
        f"the config as given measured {rates[0]:,.0f} and then {rates[1]:,.0f} real tokens/s "
        f"({apart:.0%} apart): the machine's load changed during the search, so no "
        f"candidate's gain over it can be trusted; the config as given is the choice, and "
        f"nothing is cached (search again on a quieter machine, or raise "
        f"accelerate.load_tolerance={a.load_tolerance:g})")
    if unsteady:
        row["why"] = unsteady
    return Confirmation(replace(again, candidate=REFERENCE) if sooner else ref, [row], unsteady)
