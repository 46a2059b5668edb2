"""The search: cache, candidates, measurements within the budget, the choice, the record.

    cached result for this key?  -> it, and no search (unless the budget cut it short and this
        run's accelerate.budget_s is larger: cache.outgrown)
    the reference (the config as given) measured first: its losses are what the others are
        checked against, its rate gives the run's estimated length (steps x real tokens a step)
        (a budget too short for the reference's own measurement: the config as given, with
        one warning, nothing cached)
    the budget: accelerate.budget_s, and at most accelerate.max_fraction of that length
    a run too short for another measurement in that budget -> the reference, and the
        candidates are not even enumerated (asking every setting's refusals and memory plan
        takes seconds: on a short run they are seconds the search cannot win back)
    each admitted candidate, soonest expected first, measured while the budget lasts (a candidate
        starts only when the budget left covers what the reference's child took twice, and is
        stopped at the budget's end less that or accelerate.candidate_timeout_s)
    verdicts (tuning/pick.py), the fastest to the result that passes the loss check; when it
        is not the config as given, the config is measured again and the sooner of its two
        measurements is the reference (tuning/confirm.py: a load change between children)
    the record (tuning.json's content), stored in the cache
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import EXIT_PREEMPTED, ConfigError, InputError, Preempted
from rapidformer.tuning import cache, report
from rapidformer.planning.memory_plan import fitting_advice
from rapidformer.tuning.admit import reference_overflow
from rapidformer.tuning.confirm import confirmed
from rapidformer.tuning.enumerate import candidates
from rapidformer.tuning.measure import (MEASUREMENT_KEYS, TRAINED_ALL, Measurement, Stopped,
                                       check_stop, measure, signalled)
from rapidformer.tuning.pick import choose, judge, time_to_result
from rapidformer.tuning.report import no_passing, say, warn
from rapidformer.tuning.space import REFERENCE, pins, touched_pins

FORMAT = 1


# where a run writes and what it resumes: a training run's reproducing command leaves them out
# (pasted, its own folder would be refused as an existing run's)
RUN_DIR_KEYS = ("trainer.output_dir", "trainer.resume", "trainer.overwrite", "hydra.run.dir")


def user_overrides(run_overrides: list[str], fresh: bool = False) -> list[str]:
    """The run's overrides without accelerate's own (the reproducing command's start), and
    with `fresh` without where it writes (RUN_DIR_KEYS)."""
    from rapidformer.config.compose import override_key

    return [o for o in run_overrides if not override_key(o).startswith("accelerate")
            and not (fresh and override_key(o) in RUN_DIR_KEYS)]


def command(run_overrides: list[str], chosen: list[str], fresh: bool = False) -> str:
    """The command that trains with the choice: the user's overrides less those the choice
    sets again (no `graph=compile graph=eager`) or whose group it switches, then the choice's;
    `fresh`: into a new folder (a training run's record: its own folder is taken)."""
    from rapidformer.tuning.space import kept_overrides

    kept = kept_overrides(user_overrides(run_overrides, fresh), chosen)
    given = [*kept, *chosen]
    if _composes_auto(given):  # a recipe's accelerate=auto would search again
        given.append("accelerate=none")
    return shlex.join(["python", "-m", "rapidformer", *given])


def _composes_auto(overrides: list[str]) -> bool:
    """Whether these overrides compose accelerate=auto (a recipe, a config folder's)."""
    from omegaconf import OmegaConf

    from rapidformer.config.compose import compose, with_default_recipe

    try:
        composed = compose(with_default_recipe(list(overrides)), default_recipe=False)
    except Exception:  # noqa: BLE001 - the command is printed as it is; the run checks it
        return False
    return OmegaConf.select(composed, "accelerate.name") == "auto"


def seconds(*values: float) -> list[str]:
    """`values` in seconds, with the fewest decimals (up to 2) that tell them apart: "0.34 s
    ... 0.28 s", not "0 s ... 0 s"."""
    for digits in (0, 1, 2):
        texts = [f"{v:,.{digits}f}" for v in values]
        if len(set(texts)) == len(set(values)) and \
                all(t.strip("0.,-") or not v for t, v in zip(texts, values)):
            break  # distinct, and none but a zero shown as 0
    return [f"{t} s" for t in texts]


def run_length(cfg: RunConfig, reference: Measurement) -> int:
    t = cfg.trainer
    if t.train_iters is not None:
        return t.train_iters
    if reference.steps_per_epoch is None:
        raise InputError("accelerate=auto: the reference measurement did not report the steps "
                         "of an epoch; set trainer.train_iters")
    return (t.epochs or 1) * reference.steps_per_epoch


def search(run_overrides: list[str], cfg: RunConfig, memory_auto: bool,
           fresh: bool = False) -> dict:
    """The search's record for a settled config `cfg` given by `run_overrides`; `fresh`: its
    command trains into a new folder (a training run's record: `command`)."""
    from rapidformer.preflight import run_device

    device, _ = run_device(cfg)
    a = cfg.accelerate
    check_extra_candidates(cfg)
    where = cache.cache_dir(cfg)
    check_cache_outside_the_run(cfg, where)
    pinned = pins(run_overrides, memory_auto)
    fields = cache.key_fields(cfg, device.type, touched_pins(cfg, pinned))
    key = cache.key_of(fields)
    if a.cache:
        hit, unusable = cache.load(where, key)
        if hit is not None and (unusable := cache.outgrown(hit, a.budget_s)):
            hit = None
        if hit is not None:
            say(f"cached result {where / (key + '.json')}: {hit['choice']['label']} (no search; "
                f"accelerate.cache=false searches again)")
            chosen = hit["choice"]["overrides"]
            return {**hit, "cached": True, "cache_file": str(where / (key + ".json")),
                    "command": command(run_overrides, chosen, fresh)}
        if unusable:
            say(f"searching again: {unusable} (it is replaced)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rapidformer-tuning-"))
    try:
        with _stop_signals_recorded():
            record = _measure_all(run_overrides, cfg, device, memory_auto, work, started,
                                  pinned)
    except Stopped as stop:  # the measuring child's group was killed (measure.run_child)
        raise SearchStopped(f"accelerate=auto: the search was stopped by "
                            f"{signal.Signals(stop.signum).name} before training; the candidate "
                            f"being measured and the search's folder are removed, nothing was "
                            f"trained or cached") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record.update(key=key, key_fields=fields, cached=False, format=FORMAT,
                  command=command(run_overrides, record["choice"]["overrides"], fresh))
    if not record["measured"]:  # nothing to keep: another run's budget may measure
        warn(record["warning"])
    elif a.cache and record.get("unsteady"):
        say("the result is not cached: the machine's load changed during the search")
    elif a.cache:
        stored, why_not = cache.store(where, key, record)
        if stored is None:
            say(f"the result is not cached: {why_not}; set accelerate.cache_dir to a writable "
                f"folder, or accelerate.cache=false")
        else:
            record["cache_file"] = str(stored)
    return record


# what the run trains on and for how long, and how much it evaluates: a measurement of
# accelerate.steps steps on the run's data compares settings of one run, not two runs
RUN_KEYS = ("trainer.epochs", "trainer.train_iters", "trainer.eval_iters", "data",
            "data.name", "data.source", "data.path", "data.subset", "data.train_file",
            "data.validation_file", "data.test_file", "data.split", "data.synthetic_train_size",
            "data.synthetic_eval_size", "data.synthetic_seed", "data.synthetic_lengths")


# what a hand-picked candidate may set: how the run computes, not what. The model, its data
# and their length, the objective and the optimization are the config's, which every candidate
# trains: a few steps' mean loss inside the warm-up cannot tell a smaller model, inputs cut to 8
# tokens or another clipping from the config (each passed the loss check and won)
HOW_GROUPS = ("precision", "graph", "kernels", "memory", "parallelism")
# (data.group_by_length is not: it trains other examples in each step, whose first steps' loss
# matched the config's, and it cost 2.5 points of validation accuracy)
HOW_KEYS = ("trainer.micro_batch_size", "trainer.global_batch_size",
            "trainer.eval_micro_batch_size", "trainer.unpad", "trainer.checkpoint_activations",
            "trainer.offload_activations", "trainer.recompute_granularity", "trainer.tf32",
            "trainer.deterministic", "data.packing", "data.pad_to", "data.num_workers",
            "data.impl", "data.mmap_warmup", "model.attn_implementation", "optim.fused",
            "peft.fused", "peft.base_dtype", "task.mlm_head", "task.lm_head")


def unmeasurable(key: str) -> str:
    """Why a hand-picked candidate may not set `key`, or ""."""
    if key in RUN_KEYS:
        return (f"{key} changes what the run trains on or for how long, which a measurement of "
                f"its first steps cannot compare; set it on the command line (the config as "
                f"given and every candidate then have it)")
    if key in MEASUREMENT_KEYS:
        return (f"{key} is set by the measurement itself (a child runs accelerate.steps steps "
                f"into a folder of its own), so a candidate's value would not be measured; set "
                f"it on the command line")
    return ""


def computes_otherwise(keys: list[str]) -> str:
    """Why a hand-picked candidate may not set those of `keys` (keys the CLI takes) that are
    what the run computes, or "": HOW_GROUPS and HOW_KEYS are how it computes."""
    what = [key for key in keys if key.split(".")[0] not in HOW_GROUPS and key not in HOW_KEYS]
    if not what:
        return ""
    one = len(what) == 1
    named = what[0] if one else f"{', '.join(what[:-1])} and {what[-1]}"
    return (f"{named} {'is' if one else 'are'} not how the run computes: a candidate changes "
            f"only that (the groups {', '.join(HOW_GROUPS)}, and the batch, sequence, "
            f"recompute and kernel keys docs/tuning.md lists), and trains the config's model, "
            f"data, objective and optimization, which the first steps' loss cannot tell apart "
            f"from others; set {'it' if one else 'them'} on the command line")


def check_extra_candidates(cfg: RunConfig) -> None:
    """accelerate.extra_candidates that no run could take (an unknown key or option, a value
    of the wrong type, a key set twice), whose value no measurement sees (a key of the run's
    length or data, RUN_KEYS, or one the measurement sets, MEASUREMENT_KEYS) or that change
    what the run computes (a key outside HOW_GROUPS and HOW_KEYS: the model's shape, the
    learning rate) stop the search before it measures anything, all named at once; one that
    this run's settings refuse (a micro batch the global batch is no multiple of) is a row of
    the table, as the search's own candidates are."""

    from rapidformer.config.compose import check_overrides
    from rapidformer.tuning.space import apply, hand_picked

    problems = []
    for text in cfg.accelerate.extra_candidates:
        candidate = hand_picked(text)
        given = [key.lstrip("+~") for key, _ in candidate.overrides]
        keys = list(dict.fromkeys(given))
        found = [why for key in keys if (why := unmeasurable(key))]
        found += [f"it sets {key} {given.count(key)} times (its label would name a value it "
                  f"does not measure); set it once" for key in keys if given.count(key) > 1]
        # the others are checked as the CLI checks them (a misspelt key is unknown, not "what"),
        # then against what a candidate may set
        rest = tuple(o for o in candidate.overrides if not unmeasurable(o[0].lstrip("+~")))
        try:
            check_overrides([f"{key}={value}" for key, value in rest])
            apply(cfg, replace(candidate, overrides=rest))
        except ConfigError as exc:
            found += exc.problems
            rest = ()
        except KeyError:  # a key the typed check cannot apply (a free mapping's): the child's
            pass
        if why := computes_otherwise(list(dict.fromkeys(key.lstrip("+~") for key, _ in rest))):
            found.append(why)
        problems += [f"accelerate.extra_candidates '{text}': {why}" for why in found]
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


class SearchStopped(Preempted):
    """Said as the training loop's stop is ("rapidformer: stopped: ..."), exit 75."""
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
                 started: float, pinned: dict[str, str] | None = None) -> dict:
    a = cfg.accelerate
    # the config as given, held to the memory plan as each candidate is: one that does not fit
    # stays the baseline of the loss check and the rates, never the choice
    too_big = reference_overflow(cfg, device, memory_auto)
    if too_big:
        say(f"the config as given does not fit this device ({too_big}): it is measured as the "
            f"baseline only")
    say(f"measuring the reference (the config as given) for {a.steps} steps")
    ref = measure(run_overrides, REFERENCE, a.steps, a.warmup_steps,
                  min(a.candidate_timeout_s, a.budget_s), work)
    if ref.status == "timeout" and a.budget_s < a.candidate_timeout_s:
        if too_big:  # the budget cut it, and the config as given cannot be the choice
            raise InputError(f"accelerate=auto: accelerate.budget_s={a.budget_s:g} ended before "
                             f"the config as given finished its {a.steps} measured steps "
                             f"[{ref.reason}], and it does not fit this device ({too_big}), so "
                             f"it cannot be the choice either: raise accelerate.budget_s, or "
                             f"make it fit: {fitting_advice(cfg)}")
        return _unmeasured(cfg, ref, started)  # the budget, not the config, cut it
    if too_big and ref.status == "out_of_memory":
        raise InputError(f"accelerate=auto: the config as given does not fit this device "
                         f"({too_big}) and ran out of memory in its {a.steps} measured steps "
                         f"({ref.reason}); the search checks every candidate's loss against "
                         f"it: make it fit: {fitting_advice(cfg)}")
    if ref.status == "timeout":
        evaluating = TRAINED_ALL in ref.reason
        raise InputError(f"accelerate=auto: the config as given did not finish its measurement "
                         f"of {a.steps} steps within {min(a.candidate_timeout_s, a.budget_s):g} s "
                         f"({ref.reason}; the least of accelerate.candidate_timeout_s="
                         f"{a.candidate_timeout_s:g} and accelerate.budget_s={a.budget_s:g}); "
                         f"raise them, or " + ("evaluate on smaller validation and test sets"
                                               if evaluating else "lower accelerate.steps"))
    if ref.status != "ok" or ref.reason:
        also = f" (it also does not fit this device: {too_big})" if too_big else ""
        raise InputError(f"accelerate=auto: the config as given did not train "
                         f"{a.steps} steps ({ref.status}: {ref.reason}){also}; the search checks "
                         f"every candidate against it. Run it without accelerate=auto to see why")
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
    # what a search cut short was cut by (cache.outgrown: a larger budget_s searches again)
    cut = {"by": "accelerate.budget_s" if a.budget_s <= a.max_fraction * estimated
           else "accelerate.max_fraction", "budget_s": a.budget_s, "max_fraction": a.max_fraction}
    say(f"reference: {ref.tokens_per_s:,.0f} real tokens/s; the run ({steps} steps) would take "
        f"about {estimated:,.0f} s; search budget {budget:,.0f} s (accelerate.budget_s="
        f"{a.budget_s:g}, max_fraction={a.max_fraction:g})")
    left = budget - (time.monotonic() - started)
    # a candidate that would replace the config has it measured again first (confirmed), kept
    # aside in the budget; a config that does not fit is replaced by any that passes
    second_take = 0.0 if too_big else ref.wall_s
    truncated = left < ref.wall_s + second_take
    if truncated and too_big:
        raise InputError(f"accelerate=auto: the config as given does not fit this device "
                         f"({too_big}), and the search's budget left no room to measure a "
                         f"setting that does ({max(left, 0.0):,.0f} s left, a measurement takes "
                         f"about {ref.wall_s:,.0f} s): raise accelerate.budget_s (and "
                         f"accelerate.max_fraction), or make it fit: {fitting_advice(cfg)}")
    if truncated:
        admitted, priors = [], {}
        left_text, takes, took, whole = seconds(left, ref.wall_s, ref.wall_s, budget)
        no_room = (f"{left_text} of the search's budget ({whole}) left after the "
                   f"reference's measurement, less than a measurement and the reference's "
                   f"second take (about {takes} each)") if left > 0 else (
            f"the reference's measurement alone took {took}, past the search's "
            f"budget ({whole}: accelerate.budget_s, or accelerate.max_fraction of the run)")
        left_out = [{"label": text, "why": f"not measured: {no_room}"}
                    for text in a.extra_candidates]
        left_out.append({"label": "every other candidate",
                         "why": f"not enumerated: the run is estimated at {estimated:,.1f} s; "
                                f"{no_room}"})
        say("no room for another measurement in the budget: the config as given is the choice")
    else:
        admitted, left_out, priors = candidates(cfg, device, memory_auto,
                                                run_s=run_tokens / ref.tokens_per_s,
                                                pinned=pinned, packed=ref.packed_rows,
                                                reference_fits=not too_big)
        check_stop()
        say(f"{len(admitted)} candidates besides the reference, {len(left_out)} left out; "
            f"{a.steps} steps each ({a.warmup_steps} warm-up)")
    measured: list[Measurement] = []
    skipped: list[dict] = []
    budget_stopped = False  # a child the budget's end stopped (not its own time limit)
    estimates = {adm.candidate.label: adm.estimate_gb for adm in admitted}
    for adm in admitted:
        left = budget - (time.monotonic() - started) - second_take
        if left < ref.wall_s:
            left_text, takes = seconds(max(left, 0.0), ref.wall_s)
            beside = "" if too_big else " beside the reference's second take"
            skipped.append({"label": adm.candidate.label, "prior": priors.get(adm.candidate.label),
                            "why": f"not measured: {left_text} of the search's budget "
                                   f"left{beside}, a measurement takes about {takes}"})
            continue
        check_stop()
        say(f"measuring {adm.candidate.label}")
        measured.append(measure(run_overrides, adm.candidate, a.steps, a.warmup_steps,
                                min(a.candidate_timeout_s, left), work))
        budget_stopped |= measured[-1].status == "timeout" and left < a.candidate_timeout_s
    verdicts = judge(ref, measured, run_tokens, a.warmup_steps, a.loss_tolerance, run_steps)
    if too_big:
        verdicts[0] = replace(verdicts[0], passed=False,
                              why=f"does not fit: {too_big}; measured as the baseline only")
        if not any(v.passed for v in verdicts):
            raise InputError(f"accelerate=auto: the config as given does not fit this device "
                             f"({too_big}), and no measured candidate fits and trains as it "
                             f"does ({no_passing(verdicts[1:], skipped + left_out)}); make it "
                             f"fit: {fitting_advice(cfg)}")
    best = choose(verdicts)
    again_row, unsteady = [], ""
    if best.label != REFERENCE.label and not too_big:
        check_stop()
        confirmation = confirmed(
            cfg, ref, best.label, budget - (time.monotonic() - started),
            lambda candidate, limit: measure(run_overrides, candidate, a.steps, a.warmup_steps,
                                             limit, work),
            lambda m: time_to_result(m, run_tokens, a.warmup_steps, run_steps))
        ref, again_row, unsteady = (confirmation.reference, confirmation.rows,
                                    confirmation.unsteady)
        budget_stopped |= confirmation.budget_stopped
        verdicts = judge(ref, measured, run_tokens, a.warmup_steps, a.loss_tolerance, run_steps)
        best = verdicts[0] if unsteady else choose(verdicts)
        if unsteady:
            warn(f"accelerate=auto: {unsteady}")
    chosen = next(m for m in [ref, *measured] if m.candidate.label == best.label)
    rows = []
    for m, v in zip([ref, *measured], verdicts):
        rows.append({**m.as_dict(), "prior": 1.0 if m is ref else priors.get(v.label),
                     "estimate_gb": estimates.get(v.label), "loss_check": v.loss_check,
                     "time_to_result_s": None if v.time_to_result_s is None
                     else round(v.time_to_result_s, 3),
                     "passed": v.passed, "chosen": v.label == best.label,
                     "why": v.why or ("not trusted: the machine's load changed during the "
                                      "search" if unsteady and v.passed and m is not ref
                                      else "")})
    rows += again_row + skipped + left_out
    search_s = time.monotonic() - started
    say(f"chose {best.label} after {search_s:,.0f} s")
    return {"search_s": round(search_s, 3), "budget_s": round(budget, 3), "measured": True,
            "unsteady": unsteady or None,
            "truncated": cut if truncated or skipped or budget_stopped else None,
            "run_steps": steps, "run_tokens": run_tokens,
            "choice": {"label": best.label, "overrides": chosen.candidate.override_list(),
                       "time_to_result_s": best.time_to_result_s},
            "reference_time_to_result_s": verdicts[0].time_to_result_s,
            "rows": rows, "table": report.table(rows)}


def _unmeasured(cfg: RunConfig, ref: Measurement, started: float) -> dict:
    """The record of a search whose budget (accelerate.budget_s, below the candidates' time
    limit) ended before the reference's own measurement did: the config as given is the
    choice, nothing is cached (search.search warns once), and a run trains with it."""
    a = cfg.accelerate
    warning = (f"accelerate=auto: accelerate.budget_s={a.budget_s:g} allowed no measurement: "
               f"the config as given did not finish its {a.steps} steps within it "
               f"[{ref.reason}]; the config as given is the choice, and nothing is cached. A "
               f"larger accelerate.budget_s lets the search measure")
    rows = [{**ref.as_dict(), "prior": 1.0, "chosen": True, "passed": False,
             "why": "no measurement within accelerate.budget_s"},
            {"label": "every other candidate",
             "why": f"not enumerated: accelerate.budget_s={a.budget_s:g} ended before the "
                    f"reference's measurement did"}]
    search_s = time.monotonic() - started
    return {"search_s": round(search_s, 3), "budget_s": a.budget_s, "measured": False,
            "warning": warning, "truncated": None, "run_steps": None, "run_tokens": None,
            "choice": {"label": REFERENCE.label, "overrides": [], "time_to_result_s": None},
            "reference_time_to_result_s": None, "rows": rows, "table": report.table(rows)}
