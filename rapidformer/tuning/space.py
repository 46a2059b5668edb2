"""The candidates accelerate=auto may try: each axis's values, and what a candidate is.

    axis                    values (besides the config's own)
    precision               fp32, bf16, fp16, fp8
    graph                   eager, compile, compile with graph.mode=reduce-overhead (CUDA graphs)
    sequences               trainer.unpad=true (encoders), data.packing=true (task=sft)
    kernels                 liger (kernels=none where kernels=auto picks liger)
    micro_batch_size        half, double, four times the config's, the global batch kept
    checkpoint_activations  true

A candidate is the config's settings with some of these changed, written as Hydra overrides
(so the child process that measures it, and the command that reproduces the choice, run it as
the user would). `apply` makes the typed config a candidate runs, for the refusal pass
(tuning/admit.py) to judge without composing it again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import yaml

from rapidformer.config.schema import RunConfig
from rapidformer.config.sizes import data_parallel_size

# a group switched by an axis: the option's own keys replace the group's (as Hydra does)
GROUP_AXES = ("precision", "graph", "kernels")


@dataclass(frozen=True)
class Candidate:
    """A set of settings: (key, value) pairs as in an override `key=value`; `label` names
    what it changes, or "reference" for the config as given."""
    label: str
    overrides: tuple[tuple[str, str], ...] = ()
    hand_picked: bool = False

    def override_list(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.overrides]


REFERENCE = Candidate("reference")


@dataclass(frozen=True)
class Setting:
    """One value of one axis: its overrides, and its label's words."""
    axis: str
    label: str
    overrides: tuple[tuple[str, str], ...]


def _bool(value: bool) -> str:
    return "true" if value else "false"


def axis_settings(cfg: RunConfig, axis: str) -> list[Setting]:
    """The values of `axis` other than the config's own, as settings."""
    t = cfg.trainer
    if axis == "precision":
        return [Setting(axis, name, (("precision", name),))
                for name in ("fp32", "bf16", "fp16", "fp8") if name != cfg.precision.name]
    if axis == "graph":
        out = []
        if cfg.graph.name != "eager":
            out.append(Setting(axis, "eager", (("graph", "eager"),)))
        if cfg.graph.name != "compile" or cfg.graph.mode is not None:
            out.append(Setting(axis, "compile", (("graph", "compile"),)))
        if cfg.graph.name != "compile" or cfg.graph.mode != "reduce-overhead":
            out.append(Setting(axis, "compile(reduce-overhead)",
                               (("graph", "compile"), ("graph.mode", "reduce-overhead"))))
        return out
    if axis == "sequences":
        out = []
        if not t.unpad:
            out.append(Setting(axis, "unpad", (("trainer.unpad", "true"),)))
        if not cfg.data.packing:
            out.append(Setting(axis, "packing", (("data.packing", "true"),)))
        return out
    if axis == "kernels":
        # kernels=auto is liger for the tasks it picks it for (on a GPU, installed): the other
        # side is then the model's own layers
        from rapidformer.transforms.liger import AUTO_TASKS

        if cfg.kernels.name == "liger":
            return []
        if cfg.kernels.name == "auto" and cfg.task.name in AUTO_TASKS:
            return [Setting(axis, "no kernels", (("kernels", "none"),))]
        return [Setting(axis, "liger", (("kernels", "liger"),))]
    if axis == "micro_batch_size":
        b, dp = t.micro_batch_size, data_parallel_size(cfg)
        global_batch = t.global_batch_size or b * dp
        out = []
        for size in (b // 2, b * 2, b * 4):
            if size < 1 or size == b or global_batch % (size * dp):
                continue  # the global batch is kept: micro batch x ranks must divide it
            out.append(Setting(axis, f"mbs={size}",
                               (("trainer.micro_batch_size", str(size)),
                                ("trainer.global_batch_size", str(global_batch)))))
        return out
    if axis == "checkpoint_activations":
        on = not t.checkpoint_activations
        # offload moves recompute's inputs: without recompute there is none to move
        offload = () if on or not t.offload_activations else \
            (("trainer.offload_activations", "false"),)
        return [Setting(axis, f"ckpt={_bool(on)}",
                        (("trainer.checkpoint_activations", _bool(on)), *offload))]
    raise ValueError(f"no tuning axis {axis!r}")


def combine(settings: list[Setting]) -> Candidate:
    overrides: list[tuple[str, str]] = []
    for setting in settings:
        overrides += setting.overrides
    return Candidate(" ".join(s.label for s in settings), tuple(overrides))


def hand_picked(text: str) -> Candidate:
    """A candidate of accelerate.extra_candidates: one string of space-separated overrides."""
    from rapidformer.config.validate import extra_candidate_overrides

    return Candidate(text, extra_candidate_overrides(text), hand_picked=True)


def _option_section(group: str, option: str, current):
    """The group's typed section as `group=option` makes it (the option's YAML keys)."""
    from rapidformer.config.compose import option_text

    values = yaml.safe_load(option_text(group, option)) or {}
    values = {k: v for k, v in values.items() if not k.startswith("_") and k != "defaults"}
    fresh = type(current)()
    return replace(fresh, **values)


def _parse(key: str, value: str):
    """An override's value as the CLI reads it: Hydra's override grammar (off a string, null
    None, [64,128] a list, {a:1} a mapping), then typed as the CLI types it (apply)."""
    from hydra.errors import OverrideParseException

    from rapidformer.config.compose import parse_override
    from rapidformer.errors import ConfigError

    try:
        parsed = parse_override(f"{key}={value}")
    except OverrideParseException as exc:
        raise ConfigError([f"cannot parse override '{key}={value}': "
                           f"{str(exc).splitlines()[0]}"]) from None
    if parsed.is_sweep_override():
        raise ConfigError([f"{key}={value}: a comma (or a range) makes a list of values; a "
                           f"candidate sets one value"])
    return parsed.value()


def kept_overrides(run_overrides: list[str], chosen: list[str]) -> list[str]:
    """The run's overrides that stay under `chosen` (a candidate's): those it sets again go,
    and so do the user's keys of a group it switches (`precision=fp16 precision.initial_scale=
    1024` under a bf16 candidate), as `apply` checks it: the child runs what was checked."""
    from rapidformer.config.compose import override_key

    replaced = {override_key(o).lstrip("+~") for o in chosen}
    switched = tuple(f"{key}." for key in replaced if "." not in key)
    return [o for o in run_overrides
            if (key := override_key(o).lstrip("+~")) not in replaced
            and not key.startswith(switched)]


def apply(cfg: RunConfig, candidate: Candidate) -> RunConfig:
    """The typed config `candidate` runs: groups switched to the option's keys, other keys set
    (dotted group.key); KeyError for a key the schema does not have, ConfigError for a value
    of the wrong type (typed as the CLI types a run's config: its messages)."""
    from rapidformer.config.typed import typed_config

    for key, value in candidate.overrides:
        if key.startswith("~"):  # a deletion: the child's composition judges it
            raise KeyError(key)
        group, _, name = key.lstrip("+").partition(".")
        if not hasattr(cfg, group):
            raise KeyError(key)
        section = getattr(cfg, group)
        if not dataclasses.is_dataclass(section):  # a top-level value (user_script)
            if name:
                raise KeyError(key)
            cfg = replace(cfg, **{group: _parse(key, value)})
            continue
        if not name:
            cfg = replace(cfg, **{group: _option_section(group, value, section)})
            continue
        if name not in {f.name for f in dataclasses.fields(section)}:
            raise KeyError(key)
        cfg = replace(cfg, **{group: replace(section, **{name: _parse(key, value)})})
    return typed_config(dataclasses.asdict(cfg)) if candidate.overrides else cfg
