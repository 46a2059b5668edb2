"""Verbs of the `rapidformer` console script, each in its own module:

    rapidformer ls                              recipes and every group's options
    rapidformer show +recipe=X [overrides]      the resolved config (secrets redacted)
    rapidformer validate +recipe=X [overrides]  every problem at once; exit code 0 when none
    rapidformer plan +recipe=X [overrides]      parameters and the memory plan of every mode
    rapidformer env [--json]                    versions, devices, what each accelerator needs
    rapidformer export RUN_DIR --to DIR         a Hugging Face model from any checkpoint
    rapidformer verify RUN_DIR|CHECKPOINT       every byte of the checkpoints against their manifests
    rapidformer eval RUN_DIR [overrides]        a checkpoint's metrics on the run's or other data
    rapidformer predict RUN_DIR --input F --output F   predictions of a checkpoint, row by row
    rapidformer generate RUN_DIR --prompt TEXT  a causal LM's answer (or --input F [--output F])
    rapidformer plot RUN_DIR [RUN_DIR ...]      PNG curves of loss, lr, throughput
    rapidformer cp RECIPE DIR                   a shipped recipe copied to edit (--config-dir DIR)
    rapidformer tune +recipe=X [overrides]      accelerate=auto's measured search; prints the command

Anything else on the command line is a training run (seed flags or Hydra overrides).
"""
from __future__ import annotations

import importlib

# verb -> (module, one line for `rapidformer ls`)
VERBS = {
    "ls": ("rapidformer.cli.verbs.inspect", "recipes and every config group's options"),
    "show": ("rapidformer.cli.verbs.inspect", "the resolved config, secrets redacted"),
    "validate": ("rapidformer.cli.verbs.inspect", "check a config; every problem at once"),
    "plan": ("rapidformer.cli.verbs.inspect", "parameters and estimated GPU memory per memory mode"),
    "env": ("rapidformer.cli.verbs.env", "versions, devices, what each accelerator needs"),
    "export": ("rapidformer.cli.verbs.export", "a Hugging Face model from a run's checkpoint"),
    "verify": ("rapidformer.cli.verbs.verify", "check every byte of a run's checkpoints"),
    "plot": ("rapidformer.cli.verbs.plot", "PNG curves comparing runs"),
    "cp": ("rapidformer.cli.verbs.copy", "copy a shipped recipe or option to edit as your own"),
    "eval": ("rapidformer.cli.verbs.evaluate", "a checkpoint's metrics on the run's or other data"),
    "predict": ("rapidformer.cli.verbs.predict", "a checkpoint's predictions for a jsonl/csv file"),
    "generate": ("rapidformer.cli.verbs.generate", "a causal LM's answers to prompts or chats"),
    "tune": ("rapidformer.cli.verbs.tune", "measure candidate settings; print the fastest's command"),
}


# verbs that read a training command's overrides and flags, not argparse's: -h/--help is theirs
OWN_ARGS = ("show", "validate", "plan", "env")


def verb_usage(name: str) -> str:
    """The verb's line of this module's table, and what it takes."""
    line = next(line.strip() for line in __doc__.splitlines()
                if line.strip().startswith(f"rapidformer {name} "))
    command, _, what = line.partition("  ")
    takes = ("" if name == "env" else "\nIt takes what a training command takes: +recipe=NAME, "
             "overrides (key=value) and seed flags (--flag); `rapidformer ls` lists the options.")
    return f"usage: {command.strip()}\n\n{what.strip()}{takes}"


def run_verb(name: str, argv: list[str]) -> int:
    """The verb's exit code; a RapidformerError it raises is one line on stderr, not a
    traceback (RAPIDFORMER_DEBUG=1 shows the traceback)."""
    import sys

    from rapidformer.errors import RapidformerError, debug_enabled, refused_write

    if name in OWN_ARGS and ("-h" in argv or "--help" in argv):
        print(verb_usage(name))
        return 0
    module = importlib.import_module(VERBS[name][0])
    try:
        return getattr(module, f"{name}_command")(argv)
    except (RapidformerError, OSError) as exc:
        error = exc if isinstance(exc, RapidformerError) else refused_write(exc)
        if error is None or debug_enabled():
            raise
        print(f"rapidformer: error: {error}", file=sys.stderr)
        return error.exit_code
