"""The candidates of a config, in the order they are measured, and those left out with why.

Each axis's values (tuning/space.py) are first asked alone: a value the refusal pass or this
machine refuses on its own (unpad on a decoder, fp8 without float8 tensor cores, liger without
CUDA) is out once, with its reason, and in no combination; a value the priors do not try here
(CUDA graphs on a CPU) likewise. The combinations of the rest are ordered by their prior
(tuning/priors.py), or, with the run's length known, by the time to result the priors expect
(a compiled candidate on a run too short to pay for its compilation comes after the eager
ones; one expected no sooner than the config as given is listed, not measured), then each,
best first, is admitted by the refusal pass and the memory plan (tuning/admit.py) until
accelerate.max_candidates are in. Hand-picked candidates
(accelerate.extra_candidates) come first and are not counted in the maximum. A value that
would change what the command line sets (space.pins) is not tried: one row per pinned value.
With the reference measured, `packed` (what packing makes of the training data) gives the
packing candidate its batch in rows (space.packed_batch); combinations of two settings that set
one key (that batch and another micro batch) are none.
"""
from __future__ import annotations

import itertools
import math

import torch

from rapidformer.config.schema import RunConfig
from rapidformer.tuning.admit import Admission, admit
from rapidformer.tuning.priors import Context, expected_time, reference_time, relative_factor
from rapidformer.tuning.space import (PackedRows, Setting, axis_settings, combine,
                                      gains_nothing, hand_picked, overlapping, pinned_changes)

# combinations examined at most (each asked of the refusal pass), and refused ones listed
EXAMINED = 400
LISTED = 12


def context(cfg: RunConfig, device: torch.device) -> Context:
    from rapidformer.planning.model_shape import model_shape

    shape = model_shape(cfg)
    return Context(device.type == "cuda", shape.parameters, shape.hidden, shape.vocab,
                   cfg.trainer.micro_batch_size)


def candidates(cfg: RunConfig, device: torch.device, memory_auto: bool,
               run_s: float | None = None, pinned: dict[str, str] | None = None,
               packed: PackedRows | None = None, reference_fits: bool = True
               ) -> tuple[list[Admission], list[dict], dict[str, float]]:
    """(the admitted candidates with their estimates, in measuring order; rows of those left
    out: label, prior, why; each admitted label's prior). `run_s`: the training time of the run
    with the config as given, when known (the order is then by expected time to result).
    `pinned`: what the command line sets (space.pins): no candidate changes it. `packed`:
    what packing makes of the training data (the reference's measurement), when known.
    `reference_fits`: False where the config as given does not fit the device (search.
    reference_overflow): no candidate is then left out for being no sooner than it."""
    a = cfg.accelerate
    pinned = pinned or {}
    ctx = context(cfg, device)
    out: list[dict] = []
    admitted = []
    for text in a.extra_candidates:
        if changed := pinned_changes(hand_picked(text).overrides, pinned):
            out.append({"label": text, "why": f"refused: {_pinned_words(changed[0])}"})
        else:
            admitted.append(admit(cfg, hand_picked(text, packed), device, memory_auto))
    for adm in admitted:
        if adm.problems:
            out.append({"label": adm.candidate.label, "why": f"refused: {adm.problems[0]}"})
    admitted = [adm for adm in admitted if not adm.problems]
    axes: list[list[tuple[Setting, float]]] = []
    held: dict[str, list[str]] = {}  # a pinned override -> the axis values it leaves out
    for axis in a.axes:
        kept = []
        for setting in axis_settings(cfg, axis, packed):
            if changed := pinned_changes(setting.chosen_overrides(), pinned):
                held.setdefault(changed[0], []).append(setting.label)
                continue
            if why := gains_nothing(cfg, setting):
                out.append({"label": setting.label, "why": f"not tried: {why}"})
                continue
            prior = relative_factor(setting, ctx, cfg)
            if prior is None:
                out.append({"label": setting.label, "why": f"not tried on a {device.type}"})
                continue
            alone = admit(cfg, combine([setting]), device, memory_auto)
            if alone.problems:
                out.append({"label": setting.label, "why": f"refused: {alone.problems[0]}"})
                continue
            kept.append((setting, prior))
        axes.append(kept)
    out += [{"label": " / ".join(labels), "why": f"not tried: {_pinned_words(given)}"}
            for given, labels in held.items()]  # once for each pinned override
    combos, slower = [], []
    given = None if run_s is None or not reference_fits else reference_time(ctx, cfg, run_s)
    for choice in itertools.product(*[[None, *kept] for kept in axes]):
        picked = [c for c in choice if c is not None]
        if not picked or overlapping([s for s, _ in picked]):
            continue
        prior = math.prod(p for _, p in picked)
        expected = expected_time([s for s, _ in picked], prior, ctx, cfg, run_s)
        # with the run's length known, what the priors expect no sooner than the config as
        # given is not worth a measurement (listed, the soonest first)
        (combos if given is None or expected < given else slower).append(
            (expected, prior, picked))
    combos.sort(key=lambda item: (item[0], len(item[2])))
    slower.sort(key=lambda item: (item[0], len(item[2])))
    for expected, prior, picked in slower[:LISTED]:
        out.append({"label": combine([s for s, _ in picked]).label, "prior": round(prior, 3),
                    "why": f"not measured: the priors expect {expected:,.1f} s to the result, "
                           f"the config as given {given:,.1f} s"})
    found, listed = 0, 0
    priors: dict[str, float] = {}
    for _, prior, picked in combos[:EXAMINED]:
        if found >= a.max_candidates:
            break
        adm = admit(cfg, combine([s for s, _ in picked]), device, memory_auto)
        if adm.problems:
            if listed < LISTED:
                out.append({"label": adm.candidate.label, "prior": round(prior, 3),
                            "why": f"refused: {adm.problems[0]}"})
                listed += 1
            continue
        admitted.append(adm)
        priors[adm.candidate.label] = round(prior, 3)
        found += 1
    return admitted, out, priors


def _pinned_words(given: str) -> str:
    return (f"it changes {given}, which the command line sets (a choice never replaces a value "
            f"given there; leave it out to search it)")
