"""`rapidformer ls | show | validate | plan`: what a config is, before anything runs."""
from __future__ import annotations

import re
import sys

import yaml

from rapidformer.config.compose import (OPTION_GROUPS, check_overrides, compose, group_options,
                                        option_text, with_default_recipe)
from rapidformer.config.search import take_config_dirs
from rapidformer.config.typed import closest
from rapidformer.errors import (EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE, ConfigError, InputError,
                                NotAvailableError, RapidformerError)

SECRET_KEY = re.compile(r"token|secret|passw|api_?key|credential", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(//[^/:@\s]+:)[^@\s]+@")
REDACTED = "***"
# a full stop inside these does not end the first sentence
ABBREVIATIONS = ("e.g", "i.e", "etc", "vs")


def description(group: str, option: str) -> str:
    """The first sentence of an option's leading comment (what `ls` shows)."""
    text = option_text(group, option)
    words = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if "@package" in line:
            continue
        body = line[1:].strip()
        if not body or line.startswith("#  ") or body.startswith("python "):
            break  # the end of the first paragraph, or a command line
        words.append(body)
    paragraph = " ".join(words)
    for match in re.finditer(r"(?<=[a-z0-9)])\.(\s|$)", paragraph):
        if not paragraph[: match.start()].endswith(ABBREVIATIONS):
            return paragraph[: match.start() + 1]
    return paragraph


def ls_command(argv: list[str]) -> int:
    """`rapidformer ls [GROUP ...]`: the verbs, and the options of every group (or of those
    named) with their one-line descriptions."""
    import argparse

    from rapidformer.cli.verbs import VERBS

    groups = ["recipe", *[g for g in OPTION_GROUPS if g != "recipe"]]
    parser = argparse.ArgumentParser(prog="rapidformer ls", description=ls_command.__doc__)
    parser.add_argument("groups", nargs="*", metavar="GROUP",
                        help=f"a config group ({', '.join(groups)}); default: all")
    wanted = parser.parse_args(argv).groups
    unknown = [g for g in wanted if g not in groups]
    if unknown:
        hints = [f" (did you mean '{hint}'?)" if (hint := closest(g, groups)) else ""
                 for g in unknown]
        print("rapidformer: error: " + "; ".join(f"no config group '{g}'{h}" for g, h in
                                                   zip(unknown, hints))
              + f"; the groups are {', '.join(groups)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not wanted:
        print("verbs: " + ", ".join(VERBS) + "  (rapidformer VERB ...; anything else trains)")
    for group in wanted or groups:
        print(f"\n{group}:")
        options = group_options(group)
        width = max(len(o) for o in options)
        for option in options:
            print(f"  {option:<{width}}  {description(group, option)}")
    print("\npython -m rapidformer +recipe=NAME group=option key=value   (rapidformer show ... "
          "prints what that composes to)")
    return 0


def redact(tree):
    if isinstance(tree, dict):
        return {k: (REDACTED if SECRET_KEY.search(str(k)) and v not in (None, "") else redact(v))
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    if isinstance(tree, str):
        return URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", tree)
    return tree


def _overrides(argv: list[str]) -> list[str]:
    """The overrides of a verb's command line as a run reads them: Hydra overrides, and the
    seed's flags turned into theirs (rapidformer/cli/seed_flags.py), --config-dir taken."""
    from rapidformer.cli.seed_flags import SeedFlagError, translate

    try:
        flags, overrides, _ = translate(argv)
    except SeedFlagError as exc:
        raise (NotAvailableError(str(exc)) if exc.exit_code == EXIT_NOT_AVAILABLE
               else InputError(str(exc))) from None
    return take_config_dirs(flags, overrides)[1]


def _resolved(argv: list[str]):
    """The settled config of a command line: every config problem refused (the machine is not
    asked: a plan or a shown config may be for another one)."""
    from rapidformer.preflight import settle

    overrides = _overrides(argv)
    overrides = check_overrides(with_default_recipe(overrides))
    return settle(compose(overrides, default_recipe=False))


def _resolved_reporting_all(argv: list[str]):
    """As `_resolved`, with this machine's problems too (the run's own refusal pass), and the
    overrides with unknown keys or options left out and their problems joined with those of
    the rest, so that one run reports everything."""
    overrides = _overrides(argv)
    good, problems = [], []
    for override in with_default_recipe(overrides):
        try:
            good += check_overrides([override])
        except ConfigError as exc:
            problems += exc.problems
    from rapidformer.preflight import settle

    try:
        plain, cfg = settle(compose(good, default_recipe=False), environment=True)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from exc
    except RapidformerError as exc:
        if problems:  # the config's problems are bad input, whatever the machine lacks
            raise ConfigError([*problems, str(exc)]) from exc
        raise
    if problems:
        raise ConfigError(problems)
    return plain, cfg


def _report(exc: RapidformerError) -> int:
    print(f"rapidformer: error: {exc}", file=sys.stderr)
    return exc.exit_code


def show_command(argv: list[str]) -> int:
    try:
        plain, _ = _resolved(argv)
    except RapidformerError as exc:
        return _report(exc)
    print(yaml.safe_dump(redact(plain), sort_keys=False), end="")
    return 0


def validate_command(argv: list[str]) -> int:
    """Every problem of the config and of this machine for it: the run's own refusal pass."""
    try:
        _, cfg = _resolved_reporting_all(argv)
    except ConfigError as exc:
        print(f"rapidformer: {exc}", file=sys.stderr)
        return exc.exit_code
    except RapidformerError as exc:
        return _report(exc)
    world = cfg.launcher.nproc_per_node * cfg.launcher.nnodes
    choices = " ".join(f"{group}={getattr(cfg, group).name}"
                       for group in ("task", "model", "data", "precision", "memory", "graph"))
    print(f"ok: recipe={cfg.recipe} {choices}, {world} process{'es' if world > 1 else ''}")
    return 0


def print_plan(cfg) -> None:
    from rapidformer.planning.memory_plan import plan_report
    from rapidformer.planning.model_shape import model_shape
    from rapidformer.runtime import hub

    hub.prepare(cfg)  # a pretrained model's config.json: local, cached, or said what to do
    print(plan_report(cfg, model_shape(cfg)))


def plan_command(argv: list[str]) -> int:
    try:
        _, cfg = _resolved(argv)
        print_plan(cfg)
    except RapidformerError as exc:
        return _report(exc)
    return 0
