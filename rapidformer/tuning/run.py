"""What the command line calls: the search for a run (`accelerate=auto`), before its run
directory is claimed, and the record written into that directory once it is."""
from __future__ import annotations

import logging

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
    runs); the record is kept for `write_record`."""
    from omegaconf import OmegaConf

    from rapidformer.config.compose import check_overrides
    from rapidformer.tuning.search import search
    from rapidformer.tuning.space import kept_overrides

    if problems := refusals(cfg, multirun=False):
        raise InputError(problems[0])
    memory_auto = OmegaConf.select(composed, "memory.name") == "auto"
    record = search(overrides, cfg, memory_auto)
    _pending.clear()
    _pending.update(record)
    # as the command line's own: keys no option's YAML holds become ++key=value; the user's
    # keys the choice sets again or whose group it switches go, as in its measurement
    chosen = record["choice"]["overrides"]
    return [*kept_overrides(overrides, chosen), *check_overrides(chosen)]


def write_record(run_dir: str) -> None:
    """tuning.json into the run directory and the table into the run's log, when this process
    searched (a worker or a run without accelerate=auto has nothing to write)."""
    from rapidformer.tuning.report import write

    if not _pending:
        return
    record = dict(_pending)
    _pending.clear()
    path = write(run_dir, record)
    how = "cached result" if record.get("cached") else f"search of {record['search_s']:.0f} s"
    log.info("accelerate=auto (%s): %s, training with %s\n%s\nreproduce: %s\nrecord: %s",
             how, record["choice"]["label"], " ".join(record["choice"]["overrides"]) or
             "the config as given", record["table"], record["command"], path)
