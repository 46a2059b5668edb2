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

import argparse
import difflib
import shlex
import signal
import sys
from pathlib import Path

from rapidformer.cli.hydra_args import HYDRA_FLAGS, HYDRA_FLAGS_WITH_VALUE
from rapidformer.cli.hydra_main import main as hydra_main
from rapidformer.cli.seed_flags import (ALL_FLAGS, NOT_YET, SWITCHES, TASKS, TOKENIZER_TYPES,
                                        VALUE_FLAGS)
from rapidformer.cli.verbs import VERBS, run_verb
from rapidformer.config.schema import PRETRAINING_TASKS
from rapidformer.errors import EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE


class SeedFlagError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rapidformer", add_help=False, allow_abbrev=False)
    for flag in VALUE_FLAGS:
        parser.add_argument(flag)
    for flag in SWITCHES:
        parser.add_argument(flag, action="store_true")
    for flag in ("--task", "--pretrained-model-name-or-path", "--lr-decay-style",
                 "--tokenizer-type", "--data-name"):
        parser.add_argument(flag)
    parser.add_argument("--data-path", "--dataset-path", dest="data_path")
    parser.add_argument("--dataset-name", dest="data_name")
    parser.add_argument("--vocab-file", "--vocab", dest="vocab_file")
    parser.add_argument("--print-hydra", action="store_true")
    return parser


def translate(argv: list[str]) -> tuple[list[str], list[str], bool]:
    """(Hydra flags, overrides, print_only) for a command line of seed flags and overrides."""
    parser = _parser()
    hydra_flags, seed_args, overrides = [], [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in HYDRA_FLAGS:
            hydra_flags.append(arg)
            if name in HYDRA_FLAGS_WITH_VALUE and i + 1 < len(argv):
                hydra_flags.append(argv[i + 1])
                i += 1
        elif arg.startswith("-"):
            seed_args.append(arg)
            if (name in VALUE_FLAGS or name not in {*SWITCHES, "--print-hydra"}) \
                    and "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                seed_args.append(argv[i + 1])
                i += 1
        else:
            overrides.append(arg)
        i += 1
    unknown = [a for a in seed_args if a.startswith("--") and a.split("=", 1)[0] not in ALL_FLAGS]
    if unknown:
        lines = []
        for flag in unknown:
            hint = difflib.get_close_matches(flag.split("=", 1)[0], ALL_FLAGS, n=1)
            lines.append(f"{flag} (did you mean {hint[0]}?)" if hint else flag)
        raise SeedFlagError("unknown flag(s): " + ", ".join(lines) +
                            "; docs/seed_flags.md lists the flags and their overrides")
    args = parser.parse_args(seed_args)
    return hydra_flags, _to_overrides(args) + overrides, args.print_hydra


def _to_overrides(args: argparse.Namespace) -> list[str]:
    later = [flag for flag in NOT_YET
             if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if later:
        needs = "; ".join(f"{flag} needs {NOT_YET[flag]}" for flag in later)
        raise SeedFlagError(f"not available in this version yet: {needs}", EXIT_NOT_AVAILABLE)
    out: list[str] = []
    if args.task:
        if args.task not in TASKS:
            raise SeedFlagError(f"--task {args.task}: unknown task; choose one of "
                                f"{', '.join(TASKS)}")
        if args.task == "casual_lm":
            print("rapidformer: note: --task casual_lm is the seed docs' spelling of causal_lm; "
                  "running task=causal_lm", file=sys.stderr)
        out.append(f"task={TASKS[args.task]}")
    if args.pretrained_model_name_or_path:
        out += ["model=hf", f"model.name_or_path={args.pretrained_model_name_or_path}"]
    pretraining = args.data_impl is not None or TASKS.get(args.task) in PRETRAINING_TASKS
    if args.data_path:
        out += _data_overrides(args.data_path, args.data_name, pretraining,
                               TASKS.get(args.task, "sequence_classification"))
    elif args.data_name:
        out.append(f"data.subset={args.data_name}")
    if args.lr_decay_style:
        out.append(f"scheduler={args.lr_decay_style}")
    if args.tokenizer_type:
        if args.tokenizer_type not in TOKENIZER_TYPES:
            raise SeedFlagError(f"--tokenizer-type {args.tokenizer_type}: unknown; choose one of "
                                f"{', '.join(TOKENIZER_TYPES)}")
        out.append(f"model.tokenizer_type={args.tokenizer_type}")
        if TOKENIZER_TYPES[args.tokenizer_type] is not None:
            out.append(f"model.lowercase={str(TOKENIZER_TYPES[args.tokenizer_type]).lower()}")
    if args.vocab_file:
        out.append(f"model.tokenizer={args.vocab_file}")
    switches = [o for flag, o in SWITCHES.items() if getattr(args, flag[2:].replace("-", "_"))]
    for group in ("precision", "memory"):
        chosen = sorted({o for o in switches if o.startswith(group + "=")})
        if len(chosen) > 1:
            raise SeedFlagError(f"conflicting flags: {' and '.join(chosen)}; choose one")
    out += list(dict.fromkeys(switches))
    for flag, key in VALUE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out.append(f"{key}={value}")
    return out


def _data_overrides(path: str, name: str | None, pretraining: bool,
                    task: str = "sequence_classification") -> list[str]:
    """--data-path: a Megatron prefix (pretraining), a local file or directory, GLUE/MRPC, or
    any other hub dataset."""
    if pretraining or Path(path + ".idx").is_file():
        return ["data=megatron", f"data.path={path}"]
    if Path(path).exists():
        local = "pairs_local" if task == "sequence_classification" else "local"
        return [f"data={local}", f"data.path={path}"]
    if path == "glue" and name == "mrpc":
        return ["data=glue_mrpc"]
    return ["data=hub", f"data.path={path}", *([f"data.subset={name}"] if name else [])]


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
    if argv and argv[0] in TRAIN_VERBS:
        argv = argv[1:]
    elif argv and (problem := not_a_verb(argv[0])) and argv[0] not in VERBS:
        print(f"rapidformer: error: {problem}", file=sys.stderr)
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
