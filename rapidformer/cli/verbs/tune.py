"""`rapidformer tune [+recipe=X] [overrides | seed flags]`: accelerate=auto's search alone.

Measures the candidates as a run with accelerate=auto would (rapidformer/tuning/), prints the
table and the command line that trains with the choice, and trains nothing. The result is
cached as the run's search is, so this verb again, or the run of the same command with
accelerate=auto, does not search again; the printed command trains with the choice without one.
A budget too short for the config as given's own measurement prints that table, says so, and
exits 0: the printed command is then the config as given (nothing cached), as after a search
whose two measurements of the config as given say the load changed. A run's flags
(--cfg, -m/--multirun, --hydra-help, ...) are refused: the verb takes overrides, --config-dir
and --json only.
"""
from __future__ import annotations

import json
import sys

from rapidformer.errors import EXIT_BAD_INPUT, Preempted, RapidformerError


def run_flags(argv: list[str]) -> list[str]:
    """The flags of a run (Hydra's, and the seed's --print-hydra) in a tune command line: the
    verb has no use for them (it prints no config, sweeps nothing), and dropped silently a
    `tune --cfg job` would start a search of minutes."""
    from rapidformer.cli.seed_flags import translate
    from rapidformer.config.search import take_config_dirs

    flags, overrides, print_only = translate(argv)
    flags, _ = take_config_dirs(flags, overrides)
    return [f for f in flags if f.startswith("-")] + (["--print-hydra"] if print_only else [])


def tune_command(argv: list[str]) -> int:
    import argparse

    from rapidformer.cli.verbs.inspect import _overrides
    from rapidformer.config.compose import check_overrides, compose, override_key, \
        with_default_recipe
    from rapidformer.preflight import settle
    from rapidformer.tuning.run import refusals
    from rapidformer.tuning.search import search

    parser = argparse.ArgumentParser(
        prog="rapidformer tune", description=__doc__.split("\n\n")[0],
        epilog="accelerate.* overrides set the search (budget_s, max_candidates, steps, axes, "
               "...); docs/tuning.md")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    known, rest = parser.parse_known_args(argv)
    try:
        overrides = _overrides(rest)
        if flags := run_flags(rest):
            print(f"rapidformer: error: rapidformer tune does not take {', '.join(flags)}: it "
                  f"searches once and prints the command that trains with its choice (flags: "
                  f"--config-dir, --json). To print a config use `rapidformer show ...`; to "
                  f"sweep, run the printed command with -m", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not any(override_key(o) == "accelerate" for o in overrides):
            overrides.append("accelerate=auto")
        overrides = check_overrides(with_default_recipe(overrides))
        composed = compose(overrides, default_recipe=False)
        _, cfg = settle(composed, environment=True, claims=False)
        if cfg.accelerate.name != "auto":
            print("rapidformer: error: rapidformer tune searches with accelerate=auto; drop "
                  "accelerate=none", file=sys.stderr)
            return 2
        if problems := refusals(cfg, multirun=False):
            print(f"rapidformer: error: {problems[0]}", file=sys.stderr)
            return 2
        from omegaconf import OmegaConf

        record = search(overrides, cfg, OmegaConf.select(composed, "memory.name") == "auto")
    except RapidformerError as exc:
        # a stop signal is said as the training loop says it (exit 75)
        kind = "stopped" if isinstance(exc, Preempted) else "error"
        print(f"rapidformer: {kind}: {exc}", file=sys.stderr)
        return exc.exit_code
    if known.json:
        print(json.dumps(record, indent=2, default=str))
        return 0
    print(record["table"])
    how = "cached" if record.get("cached") else \
        "no measurement: accelerate.budget_s ended before the config as given's own did; " \
        "nothing cached" if record.get("measured") is False else \
        f"search {record['search_s']:.0f} s of {record['budget_s']:.0f} s budget" + (
            "; the machine's load changed during it: no gain trusted, nothing cached"
            if record.get("unsteady") else "")
    print(f"\nchoice: {record['choice']['label']} ({how})")
    print(record["command"])
    return 0
