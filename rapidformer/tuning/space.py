"""The candidates accelerate=auto may try: each axis's values, and what a candidate is.

    axis                    values (besides the config's own)
    precision               fp32, bf16, fp16, fp8
    graph                   eager, compile, compile with graph.mode=reduce-overhead (CUDA graphs)
    sequences               trainer.unpad=true (encoders), data.packing=true (task=sft, the
                            config's examples a step in fewer rows: packed_batch)
    kernels                 liger (kernels=none where kernels=auto picks liger)
    micro_batch_size        half, double, four times the config's, the global batch kept
    checkpoint_activations  true
    adapters                peft.fused=true (peft=lora/qlora: each adapted layer one function),
                            or false where the config fuses them

A candidate is the config's settings with some of these changed, written as Hydra overrides
(so the child process that measures it, and the command that reproduces the choice, run it as
the user would). `apply` makes the typed config a candidate runs, for the refusal pass
(tuning/admit.py) to judge without composing it again. What the command line sets is pinned
(`pins`): no candidate changes it. Every candidate trains the config's optimizer steps on
its examples (`step_content_change`: another global batch is refused). The packing candidate
does so in rows of several examples: its global batch, in rows, is the config's divided by the
examples a packed row holds (which the reference's measurement reads from the run's own data:
`PackedRows`), within EXAMPLES_TOLERANCE of the config's examples a step.
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
    # a packing candidate's examples a packed row (PackedRows.per_row): its global batch, in
    # rows, holds the config's examples a step (step_content_change)
    examples_per_row: float | None = None

    def override_list(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.overrides]


REFERENCE = Candidate("reference")


@dataclass(frozen=True)
class Setting:
    """One value of one axis: its overrides, and its label's words."""
    axis: str
    label: str
    overrides: tuple[tuple[str, str], ...]
    examples_per_row: float | None = None
    # keys whose value follows from the setting's own (packing's batch in rows, from the
    # config's examples a step): they keep what the command line set, so they pin nothing
    derived: tuple[str, ...] = ()

    def chosen_overrides(self) -> tuple[tuple[str, str], ...]:
        """The overrides that are this setting's choice (what a pin may forbid)."""
        return tuple(o for o in self.overrides if o[0] not in self.derived)


@dataclass(frozen=True)
class PackedRows:
    """What data.packing=true makes of the run's training examples: how many rows (the
    reference's child logs it: data/chat.py PACKING_HINT)."""
    examples: int
    rows: int

    @property
    def per_row(self) -> float:
        return self.examples / max(self.rows, 1)


# the batch keys a packing candidate sets from the config's own (Setting.derived): not pins
PACKED_BATCH_KEYS = ("trainer.global_batch_size", "trainer.micro_batch_size",
                     "trainer.eval_micro_batch_size")


def packs(overrides) -> bool:
    """Whether these overrides ((key, value) pairs or `key=value` strings) set data.packing=true."""
    pairs = [tuple(o.split("=", 1)) if isinstance(o, str) else o for o in overrides]
    return any(k.lstrip("+") == "data.packing" and _same(k, v, "true") for k, v in pairs)


# a packed candidate's step holds the config's examples within this share (its rows hold
# whole examples: 16 examples a step at 4.1 a row are 4 rows, 16.4 examples)
EXAMPLES_TOLERANCE = 0.1


def packed_batch(cfg: RunConfig, per_row: float) -> tuple[int, int]:
    """(global batch, micro batch) in packed rows of `per_row` examples that hold the config's
    global batch of examples: the rows a step rounded to a multiple of the data-parallel ranks
    (one row a rank at least), the micro batch the largest divisor of a rank's rows that is at
    most the config's."""
    return packed_rows_a_step(global_batch(cfg), cfg.trainer.micro_batch_size,
                              data_parallel_size(cfg), per_row)


def packed_rows_a_step(examples: int, micro_batch: int, ranks: int, per_row: float
                       ) -> tuple[int, int]:
    """packed_batch on plain numbers: a step of `examples` over `ranks`, in rows of `per_row`
    examples, with micro batches of at most `micro_batch` rows. Of the rows a rank within
    EXAMPLES_TOLERANCE of the examples, those of the fewest micro-batches a step, then the
    nearest (13 rows a step is 13 micro-batches of one; 12 or 14 are 2 of 6 or 7); none within
    it: the nearest (step_content_change then says why it is out)."""
    def micro(rows: int) -> int:
        return max(size for size in range(1, min(micro_batch, rows) + 1) if rows % size == 0)

    wanted = examples / per_row / ranks
    nearest = max(1, round(wanted))
    within = [rows for rows in range(1, 2 * nearest + 2)
              if abs(rows * ranks * per_row - examples) <= EXAMPLES_TOLERANCE * examples]
    per_rank = min(within, key=lambda rows: (rows // micro(rows), abs(rows - wanted))) \
        if within else nearest
    return per_rank * ranks, micro(per_rank)


def _rows(count: int) -> str:
    return f"{count} row{'' if count == 1 else 's'}"


def _packing(cfg: RunConfig, packed: PackedRows | None) -> Setting:
    """data.packing=true: with the training data's packed rows known, the config's examples a
    step in fewer rows (packed_batch); without, packing alone (which step_content_change
    refuses: a step of as many rows holds several times the examples)."""
    if packed is None:
        return Setting("sequences", "packing", (("data.packing", "true"),))
    rows, micro = packed_batch(cfg, packed.per_row)
    t = cfg.trainer
    # evaluation is not packed: it keeps the config's batch of examples
    evaluation = t.eval_micro_batch_size or t.micro_batch_size
    return Setting("sequences", f"packing ({_rows(rows)} a step)",
                   (("data.packing", "true"), ("trainer.global_batch_size", str(rows)),
                    ("trainer.micro_batch_size", str(micro)),
                    ("trainer.eval_micro_batch_size", str(evaluation))),
                   examples_per_row=packed.per_row,
                   derived=PACKED_BATCH_KEYS)


def gains_nothing(cfg: RunConfig, setting: Setting) -> str:
    """Why the search's packing setting is not worth a measurement (its step would be as many
    rows as the config's: each example fills a row of its own), or ""."""
    if setting.examples_per_row is None or \
            packed_batch(cfg, setting.examples_per_row)[0] < global_batch(cfg):
        return ""
    return (f"packing lays the training examples {setting.examples_per_row:.2f} a row: the "
            f"config's {global_batch(cfg)} examples a step would take as many rows, as they do "
            f"unpacked")


def _bool(value: bool) -> str:
    return "true" if value else "false"


def axis_settings(cfg: RunConfig, axis: str, packed: PackedRows | None = None
                  ) -> list[Setting]:
    """The values of `axis` other than the config's own, as settings (`packed`: what packing
    makes of the training data, when the reference's measurement said)."""
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
            out.append(_packing(cfg, packed))
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
    if axis == "adapters":
        if cfg.peft.name == "none":
            return []
        fuse = not cfg.peft.fused
        return [Setting(axis, "fused adapters" if fuse else "peft's adapters",
                        (("peft.fused", _bool(fuse)),))]
    raise ValueError(f"no tuning axis {axis!r}")


def combine(settings: list[Setting]) -> Candidate:
    overrides: list[tuple[str, str]] = []
    for setting in settings:
        overrides += setting.overrides
    per_row = next((s.examples_per_row for s in settings if s.examples_per_row), None)
    return Candidate(" ".join(s.label for s in settings), tuple(overrides),
                     examples_per_row=per_row)


def overlapping(settings: list[Setting]) -> bool:
    """Whether two settings set one key (packing's batch in rows and another micro batch):
    no candidate, the later would undo the earlier."""
    keys = [key for s in settings for key, _ in s.overrides]
    return len(keys) != len(set(keys))


def hand_picked(text: str, packed: PackedRows | None = None) -> Candidate:
    """A candidate of accelerate.extra_candidates: one string of space-separated overrides
    (one that packs, with `packed` known, is held to the config's examples a step as the
    search's own packing candidate is)."""
    from rapidformer.config.validate import extra_candidate_overrides

    overrides = extra_candidate_overrides(text)
    return Candidate(text, overrides, hand_picked=True,
                     examples_per_row=packed.per_row if packed and packs(overrides) else None)


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


# keys that the command line's overrides do not pin: accelerate's own, Hydra's, the recipe
UNPINNED = ("accelerate", "hydra", "recipe")


def pins(run_overrides: list[str], memory_auto: bool = False) -> dict[str, str]:
    """What the command line sets explicitly, key -> value as given (the last one): a choice
    never replaces it. A value equal to the default (trainer.unpad=false) is the user's choice
    all the same, and the cache cannot tell it from the default: the pins are in its key.
    Under memory=auto the memory plan picks the mode and turns recompute on where it must (as
    for the config as given): the memory group and trainer.checkpoint_activations=false are
    the plan's to decide, not pins."""
    from rapidformer.config.compose import override_key

    out = {}
    for text in run_overrides:
        key = override_key(text)
        if text.startswith("~") or "=" not in text or key.split(".")[0] in UNPINNED:
            continue
        out[key] = text.split("=", 1)[1]
    if memory_auto:
        out = {k: v for k, v in out.items() if k.split(".")[0] != "memory" and not (
            k == "trainer.checkpoint_activations" and _same(k, v, "false"))}
    return out


def _same(key: str, given: str, value: str) -> bool:
    """Whether two override values of `key` are the same value (Hydra reads 32 and 32.0, true
    and True alike)."""
    from rapidformer.errors import ConfigError

    try:
        return _parse(key, given) == _parse(key, value)
    except ConfigError:
        return given == value


def pinned_changes(overrides, pinned: dict[str, str]) -> list[str]:
    """The pinned overrides (`key=value` as given) that `overrides` ((key, value) pairs, or
    `key=value` strings) would change: the key set to another value, or its group switched
    (which drops the group's keys the command line set, as kept_overrides does)."""
    pairs = [tuple(o.split("=", 1)) if isinstance(o, str) else o for o in overrides]
    sets = {key.lstrip("+~"): value for key, value in pairs}
    changed = []
    for pinned_key, given in pinned.items():
        if pinned_key in sets:
            if not _same(pinned_key, given, sets[pinned_key]):
                changed.append(f"{pinned_key}={given}")
        elif any("." not in key and pinned_key.startswith(f"{key}.") for key in sets):
            changed.append(f"{pinned_key}={given}")
    return changed


def touched_pins(cfg: RunConfig, pinned: dict[str, str]) -> list[str]:
    """The pinned keys that a searched axis or a hand-picked candidate sets (or whose group it
    switches): those whose pinning changes what the search may pick (the cache key's part)."""
    keys = [k for axis in cfg.accelerate.axes for s in axis_settings(cfg, axis)
            for k, _ in s.overrides]
    keys += [k.lstrip("+~") for text in cfg.accelerate.extra_candidates
             for k, _ in hand_picked(text).overrides]
    return sorted(p for p in pinned
                  if any(p == k or p.startswith(f"{k}.") or k.startswith(f"{p}.") for k in keys))


def global_batch(cfg: RunConfig) -> int:
    t = cfg.trainer
    return t.global_batch_size or t.micro_batch_size * data_parallel_size(cfg)


def step_content_change(base: RunConfig, cfg: RunConfig,
                        examples_per_row: float | None = None) -> str:
    """Why `cfg` (a candidate of `base`) trains on other examples in an optimizer step, or "":
    packing lays several examples in a row, another global batch takes other rows. Neither is
    the config's result sooner: a run given in epochs takes other steps (packing 5 examples a
    row makes 5x fewer, and the schedule's warm-up then never ends: the first steps' loss
    cannot show it), a run of trainer.train_iters steps trains on more or fewer examples.
    Packing whose rows a step hold the config's examples a step (`examples_per_row` known,
    within EXAMPLES_TOLERANCE) trains the config's steps on as many examples: it may run."""
    what = []
    packing_changed = cfg.data.packing != base.data.packing or \
        (cfg.data.packing and cfg.data.max_seq_length != base.data.max_seq_length)
    rows_kept = examples_per_row and cfg.data.packing and not base.data.packing and \
        cfg.data.max_seq_length == base.data.max_seq_length
    if rows_kept:
        examples, given = global_batch(cfg) * examples_per_row, global_batch(base)
        if abs(examples - given) > EXAMPLES_TOLERANCE * given:
            what.append(f"packing {_rows(global_batch(cfg))} a step (about "
                        f"{examples:,.1f} examples at {examples_per_row:.2f} a row, the "
                        f"config's {given}, more than {EXAMPLES_TOLERANCE:.0%} apart)")
    else:
        if packing_changed:
            what.append("packing")
        if global_batch(cfg) != global_batch(base):
            what.append(f"a global batch of {global_batch(cfg)} (the config's "
                        f"{global_batch(base)})")
    if not what:
        return ""
    how = (f"the optimizer steps of a run given in epochs (trainer.epochs={base.trainer.epochs})"
           if base.trainer.train_iters is None else
           f"the examples each of trainer.train_iters={base.trainer.train_iters} steps trains on")
    return (f"{' and '.join(what)} changes {how}: not the config's result sooner; set it by "
            f"hand if it is the run you want")


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
