"""Whether a candidate may run: the one refusal pass's pieces, asked of its typed config.

The config's own checks (config/validate.py), the strategy table's and each transform's
refusals (refusals.py), what this machine lacks for the strategies and transforms it asks
for, and the memory plan: under memory=auto the mode the plan picks for the candidate (with
activation checkpointing or sharding where it must), else whether the config's own mode fits
the device. A refused candidate is never measured; its reason goes into the table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError
from rapidformer.tuning.space import REFERENCE, Candidate, apply, step_content_change


@dataclass(frozen=True)
class Admission:
    candidate: Candidate  # with the memory plan's overrides added under memory=auto
    problems: tuple[str, ...] = ()
    estimate_gb: float | None = None  # the memory plan's estimate per device


def machine_problems(cfg: RunConfig, device: torch.device) -> list[str]:
    """What this machine lacks for the strategies and transforms `cfg` asks for."""
    from rapidformer import transforms
    from rapidformer.accelerators.table import requested

    found = [p for cls in requested(cfg) for p in cls.environment_problems(cfg, device)]
    found += transforms.environment_problems(cfg, device)
    return [p.text for p in found]


def config_problems(cfg: RunConfig) -> list[str]:
    from rapidformer.config.validate import check_values
    from rapidformer.refusals import config_problems as refused

    return [*check_values(cfg), *refused(cfg)]


def admit(base: RunConfig, candidate: Candidate, device: torch.device,
          memory_auto: bool) -> Admission:
    """The candidate with its problems (none: it may run) and its memory estimate."""
    from rapidformer.planning.memory_plan import (GB, Mode, choose_mode, device_capacity,
                                                  estimate, gb, usable_bytes)
    from rapidformer.planning.model_shape import model_shape

    try:
        cfg = apply(base, candidate)
    except KeyError as exc:  # a hand-picked key the typed check cannot apply: the child checks it
        return Admission(candidate, (), None) if candidate.hand_picked else \
            Admission(candidate, (f"no key {exc}",))
    except ConfigError as exc:  # a value of the wrong type
        return Admission(candidate, tuple(exc.problems))
    except Exception as exc:  # noqa: BLE001 - a hand-picked value of the wrong type, an option
        return Admission(candidate, (f"{type(exc).__name__}: {exc}",))
    # the first steps' loss cannot see another schedule or other examples a step: candidates
    # train the config's steps on its examples (space.step_content_change), after what no run
    # may take
    problems = config_problems(cfg) or [
        why for why in [step_content_change(base, cfg, candidate.examples_per_row)] if why]
    if problems:
        return Admission(candidate, tuple(problems))
    if memory_auto and not cfg.model.is_megatron:
        # the plan picks the mode with the candidate's recompute, else the config's own (the
        # user's, or what the plan picked for the config as given): the reference keeps it, and
        # so must a candidate that does not set it (offloading recompute's inputs asks for it)
        from dataclasses import replace

        asked = cfg.trainer.checkpoint_activations or cfg.trainer.offload_activations
        cfg = replace(cfg, trainer=replace(cfg.trainer, checkpoint_activations=asked))
        try:
            mode = choose_mode(cfg)
        except ConfigError as exc:
            return Admission(candidate, tuple(exc.problems))
        overrides = tuple(tuple(o.split("=", 1)) for o in mode.overrides())
        candidate = replace(candidate, overrides=candidate.overrides + overrides)
        cfg = apply(base, candidate)
        problems = config_problems(cfg)
    else:
        mode = Mode(cfg.memory.name, cfg.memory.offload_optimizer, cfg.memory.offload_params,
                    cfg.trainer.checkpoint_activations)
    problems += machine_problems(cfg, device)
    capacity, _ = device_capacity(cfg)
    needed = None
    if not problems and cfg.memory.name != "auto":
        needed = estimate(model_shape(cfg), cfg, mode, capacity is not None).total
        if capacity is not None and needed > usable_bytes(capacity):
            problems.append(f"the memory plan estimates {gb(needed)} GB per device, over "
                            f"the {gb(usable_bytes(capacity))} GB usable")
    return Admission(candidate, tuple(problems), None if needed is None else needed / GB)


def reference_overflow(cfg: RunConfig, device: torch.device, memory_auto: bool) -> str:
    """Why the config as given does not fit the device by the memory plan, the check every
    candidate gets (admit), or "". Its measured steps may still fit where the run's longest
    batches do not: the plan sizes a micro batch at data.max_seq_length."""
    return "; ".join(admit(cfg, REFERENCE, device, memory_auto).problems)
