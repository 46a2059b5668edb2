"""`rapidformer --help` (and `-h`): what the console script takes, built from the verb and flag
tables themselves so that it cannot drift from them. Hydra's own help (the config groups and
their options) stays at `rapidformer --hydra-help` and `python -m rapidformer --help`."""
from __future__ import annotations

from rapidformer.cli.seed_flags import SWITCHES, VALUE_FLAGS
from rapidformer.cli.verbs import VERBS

# seed flags shown as examples, each with the override it becomes (from the flag tables)
EXAMPLE_VALUE_FLAGS = {"--micro-batch-size": "16", "--lr": "1e-4", "--epochs": "3", "--save": "DIR"}
EXAMPLE_SWITCHES = ("--mixed-precision", "--zero-1-memory-optimization")


def help_text() -> str:
    width = max(len(v) for v in VERBS) + 2
    verbs = "\n".join(f"  {name:<{width}}{line}" for name, (_, line) in VERBS.items())
    values = "\n".join(f"  {flag + ' ' + value:<34}-> {VALUE_FLAGS[flag]}={value}"
                       for flag, value in EXAMPLE_VALUE_FLAGS.items() if flag in VALUE_FLAGS)
    switches = "\n".join(f"  {flag:<34}-> {SWITCHES[flag]}"
                         for flag in EXAMPLE_SWITCHES if flag in SWITCHES)
    return f"""\
usage: rapidformer [SEED FLAGS] [OVERRIDES] [HYDRA FLAGS]    train (or fine-tune) a model
       rapidformer VERB [ARGS]                              inspect configs, runs, checkpoints
       python -m rapidformer [OVERRIDES] [HYDRA FLAGS]      train, Hydra overrides only

With no recipe, task or user script named it runs the quickstart: a tiny BERT on generated
sentence pairs, on a CPU. Every run prints first which recipe it uses.

verbs (rapidformer VERB --help for each one's arguments):
{verbs}

seed flags: the original Rapidformer's command line; each flag is one override
  rapidformer --task sequence_classification --pretrained-model-name-or-path bert-base-cased \\
      --data-path glue --data-name mrpc --micro-batch-size 16 --mixed-precision
{values}
{switches}
  --print-hydra                     print the equivalent `python -m rapidformer` line, run nothing
  every flag and its override: docs/seed_flags.md

overrides (Hydra's syntax; alone or mixed with seed flags):
  group=option                      pick a config group's option: precision=bf16 memory=zero2
  key=value                         set a value: trainer.lr=1e-4 trainer.output_dir=outputs/run
  +recipe=NAME                      start from a recipe (rapidformer ls lists them)
  +key=value / ++key=value          add a key / add or replace one
  -m a=1,2 b=x,y                    a sweep (multirun): one run per combination
  --cfg job                         print the composed config and run nothing
  --config-dir DIR                  also look for recipes and options in DIR

more help:
  rapidformer ls                    recipes and every config group's options
  rapidformer show +recipe=NAME     the resolved config;  rapidformer plan ...  its memory plan
  rapidformer --hydra-help          Hydra's own help (also: python -m rapidformer --help)
  docs/                             docs/index.md, docs/cli.md, docs/seed_flags.md,
                                    docs/configuration.md, docs/troubleshooting.md
"""
