"""`python -m rapidformer [+recipe=NAME] [group=option ...] [key=value ...]`

Compose (Hydra), check every override against the schemas, resolve once, validate, write the
resolved config into the run directory, and hand it to the trainer factory. Hydra's own flags
(`--cfg job --resolve`, `--help`, `-m`) work as usual.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from rapidformer.cli.hydra_args import split_argv
from rapidformer.errors import (EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE, Preempted, RapidformerError,
                                debug_enabled, out_of_memory, refused_write)
from rapidformer.runtime.outside_loop import StoppedOutsideLoop, signal_number, stops_outside_loop

log = logging.getLogger("rapidformer")

# Hydra's settings for a process that does not hold the run directory (holds_directory)
NOT_HOLDING = ("hydra.output_subdir=null", "~hydra.job_logging.handlers.file",
               "hydra.job_logging.root.handlers=[console]")


def report(error: BaseException) -> None:
    kind = "stopped" if isinstance(error, Preempted) else "error"
    print(f"rapidformer: {kind}: {error}", file=sys.stderr)


def finished_or_stopped(run_dir: Path) -> tuple[str, str | None]:
    """A run that returned: "ok"; "stopped" (with what stopped it) when it stopped as asked
    before its last step (trainer.exit_interval); "stopped_early" (with the step and why) when
    early stopping ended it, its final scores and export written."""
    from rapidformer.observability.records import (planned_stop, read_metrics, stop_words,
                                                   stopped_early)

    stop = planned_stop(read_metrics(run_dir))
    if stop is None:
        return "ok", None
    return ("stopped_early" if stopped_early(stop) else "stopped"), stop_words(stop)


def write_run_records(run_dir: str, resolved: dict, run_cfg, held: bool) -> None:
    """config.yaml, environment.json and accelerate=auto's record, by the process that holds
    the directory only. The job's other processes write none: torchrun's or srun's other ranks
    and a later node's launcher start at once with the holder, and on a shared file system one
    of them wrote these before the holder claimed the directory, which the holder then refused
    as holding files no rapidformer run wrote. (A later node's launcher gives its workers the
    config in a file of its own: runtime/launch.py.)"""
    from rapidformer.observability.run_record import write_environment

    if not held:
        return
    with open(Path(run_dir) / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(resolved, f, sort_keys=False)
    write_environment(run_dir, run_cfg.trainer.seed, run_cfg.trainer.deterministic)
    from rapidformer.tuning.run import write_record

    write_record(run_dir)  # accelerate=auto's tuning.json and table, when it searched


def record_status(run_dir: str, status: str, error: str | None = None) -> None:
    """status.json, when the directory can still be written: a full or read-only disk must not
    turn the run's one message into a second traceback."""
    from rapidformer.cli.multirun import write_status

    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_status(run_dir, status, error)
    except OSError as exc:
        log.warning("could not write %s/status.json: %s", run_dir, exc.strerror or exc)


# the installed package (the repository's conf/), not a folder beside this file
@hydra.main(config_path="pkg://rapidformer.conf", config_name="config", version_base="1.3")
def hydra_entry(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rapidformer.factory import run
    from rapidformer.planning.memory_plan import over_device
    from rapidformer.preflight import settle
    from rapidformer.cli.multirun import job_row
    from rapidformer.cli.summary import print_summary
    from rapidformer.checkpoint.run_dir import claimed, holds_directory

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    held = True  # the job's records and status: written by the directory's holder only
    try:
        # checked again here: a sweep's jobs are checked only here, each on its own settings
        # (the directory is claimed next, with what Hydra wrote into it expected)
        resolved, run_cfg = settle(cfg, run_dir, environment=True, claims=False)
        if run_cfg.accelerate.name == "auto" and hydra_cfg.mode == RunMode.MULTIRUN:
            from rapidformer.errors import InputError
            from rapidformer.tuning.run import refusals

            raise InputError(refusals(run_cfg, multirun=True)[0])
        # the job's directory (a sweep's, or hydra.run.dir's): Hydra made it and wrote .hydra/
        # and the job's log into it before this job started
        held = holds_directory(run_cfg.launcher)
        with claimed(run_dir, run_cfg.trainer.resume, run_cfg.trainer.overwrite,
                     held=held, hydra_job=hydra_cfg.job.name):
            write_run_records(run_dir, resolved, run_cfg, held)
            log.info("run directory: %s", run_dir)
            # a mode memory=auto or accelerate=auto picked was held to the plan already
            picked = OmegaConf.select(cfg, "memory.name") == "auto" or \
                run_cfg.accelerate.name == "auto"
            if held and not picked and (warning := over_device(run_cfg)):
                log.warning(warning)
            result = run(run_cfg, run_dir, resolved)
            if held:
                record_status(run_dir, *finished_or_stopped(Path(run_dir)))
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # what a sweeper optimises (Optuna): the job's final eval metric, as the summary shows
            return job_row(Path(run_dir))["value"]
        if not held:  # the summary (and its resume command) is the first node's to print
            log.info("node %d of %d done; the first node prints the job's summary",
                     run_cfg.launcher.node_rank, run_cfg.launcher.nnodes)
            return result
        print_summary(Path(run_dir))
        return result
    except RapidformerError as exc:
        if debug_enabled():
            raise
        report(exc)
        if held:  # a later node's failure is the job's too: the holder's status says it
            record_status(run_dir, "preempted" if isinstance(exc, Preempted) else "failed",
                          str(exc).splitlines()[0])
        if hydra_cfg.mode == RunMode.MULTIRUN and not isinstance(exc, Preempted):
            return None  # the sweep goes on; this job is reported as failed
        # a stop signal ends a sweep too: its SystemExit passes Hydra's job runner
        sys.exit(exc.exit_code)
    except Exception as exc:
        # a full disk outside a checkpoint's write; the device out of memory
        refused = refused_write(exc) or out_of_memory(exc)
        if refused is not None and hydra_cfg.mode != RunMode.MULTIRUN and not debug_enabled():
            report(refused)
            if held:
                record_status(run_dir, "failed", str(refused))
            sys.exit(refused.exit_code)
        if hydra_cfg.mode != RunMode.MULTIRUN or debug_enabled():
            raise
        # a sweep outlives a crashing job: the traceback goes to the job's log, the row says so
        log.exception("job failed")
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        record_status(run_dir, "failed", f"{type(exc).__name__}: {first_line}")
        return None


def _given(overrides: list[str], key: str, composed=None) -> str | None:
    """The value the command line gives a Hydra setting (hydra.run.dir, hydra.sweep.dir),
    resolved against the composed config where it interpolates; None when not given or not
    resolvable before Hydra runs (Hydra's own ${hydra:...})."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from rapidformer.config.compose import override_key

    given = [o for o in overrides if override_key(o) == key]
    if not given:
        return None
    try:
        value = OverridesParser.create().parse_overrides([given[-1]])[0].value()
        if isinstance(value, str) and "${" in value:
            merged = OmegaConf.merge(composed or {}, {"_rapidformer_given": value})
            value = merged._rapidformer_given
    except Exception:  # noqa: BLE001 - Hydra checks it itself, later
        return None
    return value if isinstance(value, str) and value.strip() else None


def main(argv: list[str] | None = None) -> None:
    """A run from the command line (its stops outside the training loop: one line, the run
    directory put back when nothing was trained; runtime/outside_loop.py)."""
    held: dict = {}  # "start" (a RunStart) and "dir" once the run directory is held
    with stops_outside_loop():
        try:
            _main(argv, held)
        except (KeyboardInterrupt, StoppedOutsideLoop) as exc:
            _stopped(signal_number(exc), held.get("start"), held.get("dir"))


def _stopped(signum: int, start, held_dir) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the put-back is not to be cut short
        signal.signal(sig, signal.SIG_IGN)
    if start is not None and not start.trained():
        start.put_back()
        where = (f"before training: nothing was run; {held_dir} "
                 f"{'was removed' if start.created else 'is as it was'}")
    elif start is not None:
        where = (f"outside the training loop: no checkpoint was written for the stop; "
                 f"rapidformer verify {held_dir} names the newest one")
    else:
        where = "before a run directory was held: nothing was written"
    print(f"rapidformer: stopped by {signal.Signals(signum).name} {where} (exit code "
          f"{128 + signum})", file=sys.stderr)
    sys.exit(128 + signum)


def _main(argv: list[str] | None, held: dict) -> None:
    from omegaconf import OmegaConf

    from rapidformer.config.compose import (check_overrides, compose, recipe_line,
                                            with_default_recipe)
    from rapidformer.config.search import take_config_dirs
    from rapidformer.preflight import settle
    from rapidformer.runtime.fast_exit import install as exit_fast
    from rapidformer.checkpoint.run_dir import claimed, holds_directory, sweep_problems
    from rapidformer.checkpoint.run_start import RunStart
    from rapidformer.errors import InputError

    exit_fast()
    stack = contextlib.ExitStack()
    start = None  # the run directory as it was, put back if the run is refused before training
    argv = list(sys.argv[1:] if argv is None else argv)
    flags, overrides = split_argv(argv)
    try:
        flags, overrides = take_config_dirs(flags, overrides)
    except RapidformerError as exc:
        report(exc)
        sys.exit(exc.exit_code)
    if "--hydra-help" not in flags:  # Hydra's own help composes no recipe: it cannot take one
        overrides = with_default_recipe(overrides)
    multirun = any(f in ("-m", "--multirun") for f in flags)
    asks_help = any(f in ("-h", "--help", "--hydra-help", "--info", "-i") for f in flags)
    if not asks_help:
        print(f"rapidformer: {recipe_line(overrides)}", file=sys.stderr)
    prints_only = asks_help or any(f in ("--cfg", "-c") for f in flags)
    try:
        overrides = check_overrides(overrides, multirun)
        sweep_dir = _given(overrides, "hydra.sweep.dir") if multirun and not prints_only \
            else None
        if sweep_dir and (problems := sweep_problems(
                sweep_dir, _given(overrides, "hydra.job.name") or "rapidformer")):
            # before Hydra writes its multirun.yaml and the jobs' .hydra/ there
            raise InputError(problems[0])
        if not multirun and not asks_help:
            # validate the whole config before Hydra creates a run directory
            composed = compose(overrides, default_recipe=False)
            output_dir = str(OmegaConf.select(composed, "trainer.output_dir"))
            # the one refusal pass (rapidformer/preflight.py): a run checks this machine too;
            # a dry run or --cfg only prints, perhaps for another machine
            dry_run = OmegaConf.select(composed, "trainer.dry_run") is True
            _, run_cfg = settle(composed, "(run directory)",
                                environment=not (prints_only or dry_run), writes_to=output_dir)
            if run_cfg.accelerate.name == "auto" and not (prints_only or dry_run):
                # the measured search (rapidformer/tuning/): its choice joins the overrides, so
                # the run and its config.yaml are the chosen settings
                from rapidformer.tuning.run import choice_settled, tuned_overrides

                overrides = tuned_overrides(overrides, composed, run_cfg)

                def with_choice():
                    chosen = compose(overrides, default_recipe=False)
                    return chosen, settle(chosen, "(run directory)", environment=True,
                                          writes_to=output_dir)[1]

                composed, run_cfg = choice_settled(with_choice)
            if run_cfg.trainer.dry_run and not prints_only:
                from rapidformer.cli.verbs.inspect import print_plan

                print_plan(run_cfg)  # and stop: no run directory, no data
                return
        if not multirun and not asks_help and run_cfg.launcher.name == "slurm":
            flags.append("--multirun")  # Hydra hands a job to its launcher only in a sweep
        elif not multirun and not prints_only:
            # the directory is held from here, before Hydra writes into it; the resolved name
            # goes to Hydra too, so that a timestamped default is not resolved a second later
            quoted = output_dir.replace("\\", "\\\\").replace("'", "\\'")
            overrides = [*overrides, f"++trainer.output_dir='{quoted}'"]
            # the job's directory: hydra.run.dir where the command gives one (Hydra writes
            # .hydra/ there, and the run its files), else trainer.output_dir
            job_dir = _given(overrides, "hydra.run.dir", composed)
            held_dir = job_dir or output_dir
            holder = holds_directory(run_cfg.launcher)
            if not holder:
                # another node's process holds the directory: Hydra writes no .hydra/ and no log
                # file into it here (on a shared file system, written before the holder's claim,
                # they made it refuse the directory as not a run's, and this node waited for it)
                overrides = [*overrides, *NOT_HOLDING]
            # a later node's process never puts the directory back: the holder's run is in it
            start = RunStart(held_dir) if holder else None
            held.update(start=start, dir=held_dir)
            stack.enter_context(claimed(held_dir, run_cfg.trainer.resume,
                                        run_cfg.trainer.overwrite,
                                        held=holder,
                                        setting="hydra.run.dir" if job_dir else
                                        "trainer.output_dir"))
    except RapidformerError as exc:
        if debug_enabled():
            raise
        report(exc)
        sys.exit(exc.exit_code)
    sys.argv = [sys.argv[0], *flags, *overrides]
    try:
        with stack:
            hydra_entry()
    except SystemExit as exc:
        if start is not None and exc.code in (EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE) and \
                not start.trained():
            start.put_back()  # a refusal changes nothing on disk
            print(f"rapidformer: nothing was run; {held_dir} "
                  f"{'was removed' if start.created else 'is as it was'}", file=sys.stderr)
        elif start is not None and start.trained():
            start.drop_stash()
        raise
    if start is not None:
        start.drop_stash()


if __name__ == "__main__":
    main()
