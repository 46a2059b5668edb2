"""The `rapidformer` console script: the seed's flags, translated to Hydra overrides.

    rapidformer --task sequence_classification --pretrained-model-name-or-path bert-base-cased \
        --data-path glue --data-name mrpc --micro-batch-size 16 --mixed-precision ...
    rapidformer ... --print-hydra      # print the equivalent `python -m rapidformer` line
    rapidformer ls | show | validate | plan | env | export | plot ...   (rapidformer/verbs)

Each flag maps to one override (docs/seed_flags.md has the table). Hydra-style arguments
(`+recipe=bert_mrpc`, `trainer.lr=1e-4`, `--cfg job`) pass through unchanged, alone or mixed
with seed flags. A seed flag whose feature is not built yet is refused with a message saying so,
never dropped silently.
"""
from __future__ import annotations

import shlex
import signal
import sys

from rapidformer.cli.hydra_main import main as hydra_main
# the translation lives with the flags' table (the verbs read seed flags too)
from rapidformer.cli.seed_flags import SWITCHES, VALUE_FLAGS, SeedFlagError, translate  # noqa: F401
from rapidformer.cli.verbs import VERBS, run_verb
from rapidformer.errors import EXIT_BAD_INPUT


def hydra_command(hydra_flags: list[str], overrides: list[str]) -> str:
    return shlex.join(["python", "-m", "rapidformer", *overrides, *hydra_flags])


# the explicit form of what `python -m rapidformer` and a bare `rapidformer` do
TRAIN_VERBS = ("run", "train")


def not_a_verb(word: str) -> str | None:
    """The message for a first word that looks like a verb but is none (an override has `=`,
    a flag starts with `-`, a group option is `group=option`)."""
    if not word or word[0] in "-+" or "=" in word or \
            not word.replace("-", "").replace("_", "").isalnum():
        return None
    from rapidformer.config.compose import OPTION_GROUPS, group_options
    from rapidformer.config.typed import closest

    known = [*VERBS, *TRAIN_VERBS]
    hint = closest(word, known)
    option = next((f"+{g}={word}" if g == "recipe" else f"{g}={word}" for g in OPTION_GROUPS
                   if word in group_options(g)), None)
    return (f"no verb '{word}'" + (f"; did you mean '{hint}'?" if hint else
                                   f"; did you mean '{option}'?" if option else "")
            + f" The verbs: {', '.join(known)} (rapidformer --help); a training run takes "
            f"overrides (key=value) or seed flags (--flag)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    training = argv[0] if argv and argv[0] in TRAIN_VERBS else None
    if training:
        argv = argv[1:]
    elif argv and (problem := not_a_verb(argv[0])) and argv[0] not in VERBS:
        print(f"rapidformer: error: {problem}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if training and argv and argv[0] in VERBS:  # `rapidformer run ls`: a verb is no override
        print(f"rapidformer: error: '{argv[0]}' after '{training}' is a verb, not an override; "
              f"run it alone: rapidformer {argv[0]} ...", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if argv and argv[0] in VERBS:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `rapidformer ls | head` ends quietly
        sys.exit(run_verb(argv[0], argv[1:]))
    if any(arg in ("-h", "--help") for arg in argv):
        from rapidformer.cli.help import help_text

        print(help_text(), end="")  # Hydra's help stays reachable: --hydra-help
        return
    try:
        hydra_flags, overrides, print_only = translate(argv)
    except SeedFlagError as exc:
        print(f"rapidformer: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if print_only:
        print(hydra_command(hydra_flags, overrides))
        return
    sys.argv = ["rapidformer", *hydra_flags, *overrides]
    hydra_main([*hydra_flags, *overrides])


if __name__ == "__main__":
    main()
