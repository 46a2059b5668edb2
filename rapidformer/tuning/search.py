"""The search: cache, candidates, measurements within the budget, the choice, the record.

    cached result for this key?  -> it, and no search
    the reference (the config as given) measured first: its losses are what the others are
        checked against, its rate gives the run's estimated length (steps x real tokens a step)
    the budget: accelerate.budget_s, and at most accelerate.max_fraction of that length
    a run too short for another measurement in that budget -> the reference, and the
        candidates are not even enumerated (asking every setting's refusals and memory plan
        takes seconds: on a short run they are seconds the search cannot win back)
    each admitted candidate, soonest expected first, measured while the budget lasts (a candidate
        starts only when the budget left covers what the reference's child took, and is
        stopped at the budget's end or accelerate.candidate_timeout_s)
    verdicts (tuning/pick.py), the fastest to the result that passes the loss check
    the record (tuning.json's content), stored in the cache
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import EXIT_PREEMPTED, ConfigError, InputError, RapidformerError
from rapidformer.tuning import cache, report
from rapidformer.tuning.enumerate import candidates
from rapidformer.tuning.measure import (TRAINED_ALL, Measurement, Stopped, check_stop,
                                       measure, signalled)
from rapidformer.tuning.pick import choose, judge, time_to_result
from rapidformer.tuning.space import REFERENCE

FORMAT = 1


def say(text: str) -> None:
    """Progress on stderr (the search runs before the run's log exists)."""
    print(f"rapidformer: tuning: {text}", file=sys.stderr, flush=True)


def user_overrides(run_overrides: list[str]) -> list[str]:
    """The run's overrides without accelerate's own (the reproducing command's start)."""
    from rapidformer.config.compose import override_key

    return [o for o in run_overrides if not override_key(o).lstrip("+~").startswith("accelerate")]


def command(run_overrides: list[str], chosen: list[str]) -> str:
    """The command that trains with the choice: the user's overrides less those the choice
    sets again (no `graph=compile graph=eager`) or whose group it switches, then the choice's."""
    from rapidformer.tuning.space import kept_overrides

    kept = kept_overrides(user_overrides(run_overrides), chosen)
    return shlex.join(["python", "-m", "rapidformer", *kept, *chosen])


def run_length(cfg: RunConfig, reference: Measurement) -> int:
    t = cfg.trainer
    if t.train_iters is not None:
        return t.train_iters
    if reference.steps_per_epoch is None:
        raise InputError("accelerate=auto: the reference measurement did not report the steps "
                         "of an epoch; set trainer.train_iters")
    return (t.epochs or 1) * reference.steps_per_epoch


def search(run_overrides: list[str], cfg: RunConfig, memory_auto: bool) -> dict:
    """The search's record for a settled config `cfg` given by `run_overrides`."""
    from rapidformer.preflight import run_device

    device, _ = run_device(cfg)
    a = cfg.accelerate
    check_extra_candidates(cfg)
    where = cache.cache_dir(cfg)
    check_cache_outside_the_run(cfg, where)
    fields = cache.key_fields(cfg, device.type)
    key = cache.key_of(fields)
    if a.cache:
        hit, unusable = cache.load(where, key)
        if hit is not None:
            say(f"cached result {where / (key + '.json')}: {hit['choice']['label']} (no search; "
                f"accelerate.cache=false searches again)")
            return {**hit, "cached": True, "command": command(run_overrides,
                                                              hit["choice"]["overrides"])}
        if unusable:
            say(f"searching again: {unusable} (it is replaced)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rapidformer-tuning-"))
    try:
        with _stop_signals_recorded():
            record = _measure_all(run_overrides, cfg, device, memory_auto, work, started)
    except Stopped as stop:  # the measuring child's group was killed (measure.run_child)
        raise SearchStopped(f"accelerate=auto: the search was stopped by "
                            f"{signal.Signals(stop.signum).name} before training; the candidate "
                            f"being measured and the search's folder are removed, nothing was "
                            f"trained or cached") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record.update(key=key, key_fields=fields, cached=False, format=FORMAT,
                  command=command(run_overrides, record["choice"]["overrides"]))
    if a.cache:
        stored, why_not = cache.store(where, key, record)
        if stored is None:
            say(f"the result is not cached: {why_not}; set accelerate.cache_dir to a writable "
                f"folder, or accelerate.cache=false")
        else:
            record["cache_file"] = str(stored)
    return record


def check_extra_candidates(cfg: RunConfig) -> None:
    """accelerate.extra_candidates that no run could take (an unknown key or option, a value
    of the wrong type) stop the search before it measures anything, all named at once; one that
    this run's settings refuse (a micro batch the global batch is no multiple of) is a row of
    the table, as the search's own candidates are."""
    from rapidformer.config.compose import check_overrides
    from rapidformer.tuning.space import apply, hand_picked

    problems = []
    for text in cfg.accelerate.extra_candidates:
        candidate = hand_picked(text)
        try:
            check_overrides(candidate.override_list())
            apply(cfg, candidate)
        except ConfigError as exc:
            problems += [f"accelerate.extra_candidates '{text}': {p}" for p in exc.problems]
        except KeyError:  # a key the typed check cannot apply (a free mapping's): the child's
            pass
    if problems:
        raise ConfigError(problems)


def check_cache_outside_the_run(cfg: RunConfig, where: Path) -> None:
    """A cache in the run's folder would be a file no run wrote there (the run refuses such a
    folder), and the cache is for other runs: refused before the search."""
    run = cfg.trainer.output_dir
    if not (cfg.accelerate.cache and run):
        return
    run_dir, cache_folder = Path(run).expanduser().resolve(), where.resolve()
    if cache_folder == run_dir or run_dir in cache_folder.parents:
        given = f"accelerate.cache_dir={cfg.accelerate.cache_dir}" if cfg.accelerate.cache_dir \
            else f"RAPIDFORMER_TUNING_CACHE={where}" if os.environ.get(
                "RAPIDFORMER_TUNING_CACHE") else f"the default tuning cache {where}"
        raise ConfigError([f"{given} is inside trainer.output_dir={run}: a run's folder holds "
                           f"what the run writes, and the cache serves other runs; set "
                           f"accelerate.cache_dir to a folder outside it, or "
                           f"accelerate.cache=false"])


class SearchStopped(RapidformerError):
    exit_code = EXIT_PREEMPTED


# what the training loop stops on (runtime/preemption.py), and a closed terminal's or dropped
# ssh session's SIGHUP (the measuring child, in a session of its own, does not get it); a
# signal ignored here (nohup's SIGHUP, a SIG_IGN the caller set) stays ignored
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _stop_signals_recorded():
    """SIGTERM, SIGINT or SIGHUP during the search are recorded, and raised as measure.Stopped
    from the wait on the measuring child (which kills its process group: in its own group, a
    scheduler's `kill -TERM -PGID` does not reach it) or between measurements: by default
    SIGTERM would end this process alone and leave the child and the work folder behind."""
    def record(signum, _frame):
        signalled.append(signum)

    signalled.clear()
    previous = {}
    for signum in STOP_SIGNALS:
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, record)
        except ValueError:  # not the main thread: the signals stay as they were
            pass
    try:
        yield
        check_stop()  # one that came after the last measurement
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signalled.clear()


def _measure_all(run_overrides, cfg: RunConfig, device, memory_auto: bool, work: Path,
                 started: float) -> dict:
    a = cfg.accelerate
    say(f"measuring the reference (the config as given) for {a.steps} steps")
    ref = measure(run_overrides, REFERENCE, a.steps, a.warmup_steps,
                  min(a.candidate_timeout_s, a.budget_s), work)
    if ref.status == "timeout":
        evaluating = TRAINED_ALL in ref.reason
        raise InputError(f"accelerate=auto: the config as given did not finish its measurement "
                         f"of {a.steps} steps within {min(a.candidate_timeout_s, a.budget_s):g} s "
                         f"({ref.reason}; the least of accelerate.candidate_timeout_s="
                         f"{a.candidate_timeout_s:g} and accelerate.budget_s={a.budget_s:g}); "
                         f"raise them, or " + ("evaluate on smaller validation and test sets"
                                               if evaluating else "lower accelerate.steps"))
    if ref.status != "ok" or ref.reason:
        raise InputError(f"accelerate=auto: the config as given did not train "
                         f"{a.steps} steps ({ref.status}: {ref.reason}); the search checks every "
                         f"candidate against it. Run it without accelerate=auto to see why")
    if not ref.tokens_per_s:
        raise InputError(
            "accelerate=auto: the config as given trained its measured steps, but its batches "
            "counted no real tokens (the loop counts a batch that is a dict with input_ids, and "
            "attention_mask where there is padding, or one whose collate attaches its counts "
            "with rapidformer.data.counts.with_counts), so no rate could be compared; make the "
            "collate return such a dict, or choose the settings by hand (without "
            "accelerate=auto)")
    steps = run_length(cfg, ref)
    run_tokens = steps * ref.tokens_per_step
    # a run of trainer.train_iters steps is its steps whatever a step holds (packing)
    run_steps = steps if cfg.trainer.train_iters is not None else None
    estimated = time_to_result(ref, run_tokens, a.warmup_steps, run_steps)
    budget = min(a.budget_s, a.max_fraction * estimated)
    say(f"reference: {ref.tokens_per_s:,.0f} real tokens/s; the run ({steps} steps) would take "
        f"about {estimated:,.0f} s; search budget {budget:,.0f} s (accelerate.budget_s="
        f"{a.budget_s:g}, max_fraction={a.max_fraction:g})")
    left = budget - (time.monotonic() - started)
    if left < ref.wall_s:
        admitted, priors = [], {}
        no_room = (f"{left:,.1f} s of the search's budget ({budget:,.1f} s) left after the "
                   f"reference's measurement, less than a measurement takes (about "
                   f"{ref.wall_s:,.0f} s)") if left > 0 else (
            f"the reference's measurement alone took {ref.wall_s:,.1f} s, past the search's "
            f"budget ({budget:,.1f} s: accelerate.budget_s, or accelerate.max_fraction of the "
            f"run)")
        left_out = [{"label": text, "why": f"not measured: {no_room}"}
                    for text in a.extra_candidates]
        left_out.append({"label": "every other candidate",
                         "why": f"not enumerated: the run is estimated at {estimated:,.1f} s; "
                                f"{no_room}"})
        say("no room for another measurement in the budget: the config as given is the choice")
    else:
        admitted, left_out, priors = candidates(cfg, device, memory_auto,
                                                run_s=run_tokens / ref.tokens_per_s)
        check_stop()
        say(f"{len(admitted)} candidates besides the reference, {len(left_out)} left out; "
            f"{a.steps} steps each ({a.warmup_steps} warm-up)")
    measured: list[Measurement] = []
    skipped: list[dict] = []
    estimates = {adm.candidate.label: adm.estimate_gb for adm in admitted}
    for adm in admitted:
        left = budget - (time.monotonic() - started)
        if left < ref.wall_s:
            skipped.append({"label": adm.candidate.label, "prior": priors.get(adm.candidate.label),
                            "why": f"not measured: {left:,.0f} s of the search's budget left, "
                                   f"a measurement takes about {ref.wall_s:,.0f} s"})
            continue
        check_stop()
        say(f"measuring {adm.candidate.label}")
        measured.append(measure(run_overrides, adm.candidate, a.steps, a.warmup_steps,
                                min(a.candidate_timeout_s, left), work))
    verdicts = judge(ref, measured, run_tokens, a.warmup_steps, a.loss_tolerance, run_steps)
    best = choose(verdicts)
    chosen = next(m for m in [ref, *measured] if m.candidate.label == best.label)
    rows = []
    for m, v in zip([ref, *measured], verdicts):
        rows.append({**m.as_dict(), "prior": 1.0 if m is ref else priors.get(v.label),
                     "estimate_gb": estimates.get(v.label), "loss_check": v.loss_check,
                     "time_to_result_s": None if v.time_to_result_s is None
                     else round(v.time_to_result_s, 3),
                     "passed": v.passed, "chosen": v.label == best.label, "why": v.why})
    rows += skipped + left_out
    search_s = time.monotonic() - started
    say(f"chose {best.label} after {search_s:,.0f} s")
    return {"search_s": round(search_s, 3), "budget_s": round(budget, 3),
            "run_steps": steps, "run_tokens": run_tokens,
            "choice": {"label": best.label, "overrides": chosen.candidate.override_list(),
                       "time_to_result_s": best.time_to_result_s},
            "reference_time_to_result_s": verdicts[0].time_to_result_s,
            "rows": rows, "table": report.table(rows)}
