"""What the command line calls: the search for a run (`accelerate=auto`), before its run
directory is claimed, and the record written into that directory once it is."""
from __future__ import annotations

import logging
from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")

# the search's record, from the search (before Hydra starts the run) to the run's directory
_pending: dict = {}


def refusals(cfg: RunConfig, multirun: bool) -> list[str]:
    """What accelerate=auto does not do yet (one sentence each)."""
    p = []
    if multirun:
        p.append("accelerate=auto in a sweep (-m): not yet; search once with `rapidformer tune "
                 "...` and sweep over the command it prints")
    from rapidformer.runtime.launch import already_launched

    if already_launched():
        p.append("accelerate=auto under an outside launcher (torchrun or srun set RANK and "
                 "WORLD_SIZE): each rank would search alone, its children waiting for ranks "
                 "that never join; run `rapidformer tune ...` outside the launcher and launch "
                 "the command it prints")
    if cfg.launcher.nnodes > 1:
        p.append(f"accelerate=auto with launcher.nnodes={cfg.launcher.nnodes}: each node would "
                 f"search alone (a child waits for a rendezvous the others never join, and the "
                 f"nodes could choose apart); run `rapidformer tune ...` with launcher.nnodes=1 "
                 f"on one node and give every node the command it prints")
    if cfg.launcher.name != "local":
        p.append(f"accelerate=auto with launcher={cfg.launcher.name}: the search measures on "
                 f"this machine, not the job's; run `rapidformer tune ...` on a node of the "
                 f"job's kind and submit the command it prints")
    return p


def tuned_overrides(overrides: list[str], composed, cfg: RunConfig) -> list[str]:
    """The run's overrides with the search's choice added (the config then records what
    runs); the record is kept for `write_record`. A run that resumes a directory whose
    tuning.json records a choice trains on with it: no search, the record kept as it is."""
    from omegaconf import OmegaConf

    from rapidformer.config.compose import check_overrides
    from rapidformer.tuning.search import search
    from rapidformer.tuning.space import (PACKED_BATCH_KEYS, kept_overrides, packs,
                                          pinned_changes, pins)

    if problems := refusals(cfg, multirun=False):
        raise InputError(problems[0])
    # the CLI settles the run with a stand-in for its folder (it is not claimed yet): the
    # folder the run resumes, and the cache's place beside it, are the composed config's
    from dataclasses import replace

    if folder := OmegaConf.select(composed, "trainer.output_dir"):
        cfg = replace(cfg, trainer=replace(cfg.trainer, output_dir=str(folder)))
    _pending.clear()
    memory_auto = OmegaConf.select(composed, "memory.name") == "auto"
    record = recorded_choice(cfg, overrides)
    if record is None:
        # the run log's command trains again into a new folder: this one is the run's own
        record = search(overrides, cfg, memory_auto, fresh=True)
    chosen = record["choice"]["overrides"]
    pinned = pins(overrides, memory_auto)
    if packs(chosen) and "data.packing" not in pinned:
        # packing's batch in rows follows from the command line's examples a step
        # (space.Setting.derived): as in the search, those keys pin nothing
        pinned = {k: v for k, v in pinned.items() if k not in PACKED_BATCH_KEYS}
    if changed := pinned_changes(chosen, pinned):
        # a search never chooses so (space.pins); a resumed run's record may have
        raise InputError(f"accelerate=auto: the choice {record['choice']['label']} "
                         f"({' '.join(chosen)}) changes {changed[0]}, which the command line "
                         f"sets; {_where(record)}. Leave {changed[0]} out, or run without "
                         f"accelerate=auto")
    _pending.update(record)
    # as the command line's own: keys no option's YAML holds become ++key=value; the user's
    # keys the choice sets again or whose group it switches go, as in its measurement
    return [*kept_overrides(overrides, chosen), *check_overrides(chosen)]


def choice_settled(settle_with_choice):
    """`settle_with_choice()` (the run's config composed and settled with the choice's
    overrides), its problems naming the choice as their source, and a resumed run's line once
    they are none: the choice is the run's only then."""
    from rapidformer.errors import ConfigError

    record = _pending
    try:
        settled = settle_with_choice()
    except ConfigError as exc:
        if not record["choice"]["overrides"]:  # the config as given: nothing of the choice's
            raise
        where = f"recorded in {record['resumed']}" if record.get("resumed") else \
            f"cached in {record['cache_file']} (accelerate.cache=false searches again)" \
            if record.get("cached") else "chosen by this search"
        raise ConfigError([*exc.problems, f"{' '.join(record['choice']['overrides'])} is "
                                          f"accelerate=auto's choice "
                                          f"{record['choice']['label']}, {where}"]) from None
    if record.get("resumed"):
        from rapidformer.tuning.search import say

        say(f"resuming {Path(record['resumed']).parent}: training on with the choice its "
            f"{Path(record['resumed']).name} records, {record['choice']['label']} (no search)")
    return settled


def _where(record: dict) -> str:
    return f"the choice is {record['resumed']}'s" if record.get("resumed") else \
        "the search's (a cached record's)"


def recorded_choice(cfg: RunConfig, overrides: list[str] = ()) -> dict | None:
    """The record of the run this one resumes (trainer.resume set, its folder holding a
    tuning.json: trainer.output_dir, or a plain hydra.run.dir of the command line, where Hydra
    writes the job's files), else None: a resumed run trains on as it trained, and searching
    again (with the choice's overrides now on the command line, another key) would replace
    its record."""
    import json

    from rapidformer.config.compose import override_key

    job = [o.split("=", 1)[1].strip("'\"") for o in overrides
           if override_key(o) == "hydra.run.dir" and "${" not in o]
    folders = [Path(p).expanduser() for p in (*job[-1:], cfg.trainer.output_dir)]
    path = next((f / "tuning.json" for f in folders if (f / "tuning.json").is_file()), None)
    if cfg.trainer.resume is None or path is None:
        return None
    try:
        record = json.loads(path.read_text())
        choice = record["choice"]
        if not (isinstance(choice["label"], str) and isinstance(choice["overrides"], list)
                and all(isinstance(o, str) for o in choice["overrides"])):
            raise TypeError("no choice")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"accelerate=auto: resuming {path.parent}, whose {path.name} records "
                         f"no readable choice ({type(exc).__name__}: {exc}); resume without "
                         f"accelerate=auto and with the settings it trained with (its "
                         f"config.yaml)") from None
    if differs := _not_trained_with(choice["overrides"], path.parent / "config.yaml"):
        raise InputError(f"accelerate=auto: resuming {path.parent}, whose {path.name} records "
                         f"the choice {choice['label']}, which its config.yaml did not train "
                         f"with ({differs}): the record is another run's; resume without "
                         f"accelerate=auto and with the settings of its config.yaml")
    return {**record, "resumed": str(path)}


def write_record(run_dir: str) -> None:
    """tuning.json into the run directory and the table into the run's log, when this process
    searched (a worker or a run without accelerate=auto has nothing to write); a resumed run's
    record is the run's already: said in the log, not written again."""
    from rapidformer.tuning.report import write

    if not _pending:
        return
    record = dict(_pending)
    _pending.clear()
    chosen = " ".join(record["choice"]["overrides"]) or "the config as given"
    if record.get("resumed"):
        log.info("accelerate=auto (resumed): %s, training with %s, as %s records",
                 record["choice"]["label"], chosen, record["resumed"])
        return
    path = write(run_dir, record)
    how = "cached result" if record.get("cached") else \
        "no measurement" if record.get("measured") is False else \
        f"search of {record['search_s']:.0f} s"
    log.info("accelerate=auto (%s): %s, training with %s\n%s\nreproduce: %s\nrecord: %s",
             how, record["choice"]["label"], chosen, record["table"], record["command"], path)


def _not_trained_with(chosen: list[str], config_file) -> str:
    """The first of the chosen overrides that the run's config.yaml does not hold ("key: its
    value there"), or "" (also where there is no config.yaml to compare with)."""
    import yaml
    from omegaconf import OmegaConf

    from rapidformer.config.compose import override_key

    try:
        trained = OmegaConf.create(yaml.safe_load(config_file.read_text()) or {})
    except (OSError, ValueError, yaml.YAMLError):
        return ""
    for given in chosen:
        key, value = override_key(given).lstrip("+~"), given.split("=", 1)[1]
        path = key if "." in key else f"{key}.name"  # a group: its option's name
        held = OmegaConf.select(trained, path, default=None)
        if str(yaml.safe_load(value)) != str(held):
            return f"{key}: {held}"
    return ""
