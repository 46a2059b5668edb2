"""The end-of-run summary: what a finished run left and the commands that go on from it, read
from the run directory itself (metrics.jsonl, checkpoints/, hf_model/, .hydra/overrides.yaml),
so it says what is on disk, not what the run meant to write. A run that stopped as asked
before its last step (trainer.exit_interval) says so in its first line, and its resume command
goes on to the end. A run that early stopping ended says "stopped early at step N of M (no
improvement ...)", and instead of a resume command (refused: it would stop again) the command
that trains on without early stopping.

    rapidformer: run finished: outputs/2025-01-01_12-00-00
      final     step 1500: loss 0.0123; validation/accuracy=0.9850, validation/loss=0.0512
      best      validation/accuracy=0.9900 (step 1000), validation/loss=0.0455 (step 1000)
      kept best validation/accuracy=0.9900 at step 1000: outputs/.../checkpoints/step_00001000
      newest    outputs/.../checkpoints/step_00001500
      exported  outputs/.../hf_model
      resume    python -m rapidformer +recipe=quickstart trainer.output_dir=... trainer.resume=auto
      export    rapidformer export outputs/... --to DIR
      curves    rapidformer plot outputs/...

Printed once, by the process that started the run (the launcher of a multi-process run).
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from rapidformer.checkpoint import store
from rapidformer.config.compose import override, override_key
from rapidformer.config.run_paths import anchored, names_a_path
from rapidformer.observability.format import format_value
from rapidformer.observability.records import (NO_EVALUATION, STOPPED, planned_stop,
                                               read_metrics, stop_words, stopped_early)
from rapidformer.templates.best import inferred_mode

# overrides the resume command sets itself (the same directory, resumed), and the stop it goes on
# from
RUN_DIR_KEYS = ("trainer.output_dir", "trainer.resume", "trainer.overwrite",
                "trainer.exit_interval")
EVALUATED = ("validation/", "test/")


def run_overrides(run_dir: Path, argv: list[str] | None = None) -> list[str]:
    """The overrides the run was started with: Hydra's record of them, else the command line's
    (`argv`, default sys.argv[1:]) without its flags."""
    recorded = run_dir / ".hydra" / "overrides.yaml"
    if recorded.is_file():
        return [str(o) for o in yaml.safe_load(recorded.read_text()) or []]
    argv = sys.argv[1:] if argv is None else argv
    return [a for a in argv if not a.startswith("-")]


def _hydra_record(run_dir: Path) -> dict:
    recorded = run_dir / ".hydra" / "hydra.yaml"
    try:
        return (yaml.safe_load(recorded.read_text()) or {}).get("hydra") or {}
    except (OSError, yaml.YAMLError):
        return {}


def _config_dirs(hydra: dict) -> list[str]:
    """The run's own config folders (--config-dir, hydra.searchpath), as Hydra recorded them."""
    return [entry[len("file://"):] for entry in hydra.get("searchpath") or []
            if isinstance(entry, str) and entry.startswith("file://")]


def _from_anywhere(item: str, start: Path) -> str:
    """`key=value` with a value that names a path relative to the folder the run started in
    made absolute, so that the printed command runs from any folder."""
    key, sep, value = item.partition("=")
    text, name = value.strip("'\""), override_key(item)
    # a group's option (model=bert_tiny) is a name, not a path, even where a folder shares it
    if not sep or ("." not in name and name != "user_script") or name.startswith("hydra.") or \
            not names_a_path(text, start):
        return item
    return override(key, start / text)


def _resolved(run_dir: Path) -> dict:
    try:
        plain = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return plain if isinstance(plain, dict) else {}


def _searched(resolved: dict) -> bool:
    """Whether the run trained with accelerate=auto's choice (its config says auto)."""
    accelerate = resolved.get("accelerate")
    return isinstance(accelerate, dict) and accelerate.get("name") == "auto"


def resume_command(run_dir: Path, argv: list[str] | None = None,
                   settings: tuple[str, ...] = ()) -> str:
    """`python -m rapidformer [--config-dir DIR] <the run's overrides> [settings]
    trainer.output_dir=RUN_DIR trainer.resume=auto`, quoted for a POSIX shell, runnable from
    any folder: the run's config folders and the paths its overrides name are absolute.
    `settings` (key=value) replace the run's own of their keys. A run that trained with
    accelerate=auto's choice resumes that choice (its overrides are the run's) without
    searching: accelerate's own overrides go, and accelerate=none where a recipe set auto."""
    run_dir = Path(run_dir).absolute()
    hydra = _hydra_record(run_dir)
    start = Path((hydra.get("runtime") or {}).get("cwd") or Path.cwd())
    last = {override_key(o): o for o in run_overrides(run_dir, argv)}  # a key set twice: the last
    replaced = {*RUN_DIR_KEYS, *(override_key(s) for s in settings)}
    resolved = _resolved(run_dir)
    if _searched(resolved):
        # (a command line's accelerate=auto dropped leaves the default, none; a recipe's is
        # set back; a resumed run with auto would reuse its tuning.json all the same)
        given = "accelerate" in last
        replaced |= {k for k in last if k == "accelerate" or k.startswith("accelerate.")}
        settings = (*settings, *(() if given else ("accelerate=none",)))
    kept = [_from_anywhere(o, start) for o in last.values() if override_key(o) not in replaced]
    # a relative path the run's config took from a recipe or config file, not the command line
    kept += [override(f"++{key}", path) for key, path in anchored(resolved, start).items()
             if key not in last and key not in replaced]
    folders = [part for d in _config_dirs(hydra) for part in ("--config-dir", d)]
    return shlex.join(["python", "-m", "rapidformer", *folders, *kept, *settings,
                       override("trainer.output_dir", run_dir), "trainer.resume=auto"])


# how a run that stopped early trains on: the same command resumed is refused (it would stop
# again), this one trains to the end without early stopping
TRAIN_ON = ("trainer.early_stopping_patience=null", "trainer.early_stopping_min_delta=0")


def _final(records: list[dict]) -> str | None:
    """The last step, its training loss, and the last value of every evaluated metric."""
    if not records:
        return None
    last: dict = {}
    for record in records:
        last.update({k: v for k, v in record.items() if k.startswith(EVALUATED)})
    loss = next((r["loss"] for r in reversed(records) if "loss" in r), None)
    parts = [f"loss {format_value(loss)}"] if loss is not None else []
    if last:
        parts.append(", ".join(f"{k}={format_value(v)}" for k, v in last.items()))
    return f"step {records[-1].get('step', '?')}" + (": " + "; ".join(parts) if parts else "")


def _best(records: list[dict]) -> str | None:
    """Each validation metric's best value over the run's evaluations, and its step (the
    direction from its name, as trainer.best_metric infers it)."""
    best: dict[str, tuple[float, int]] = {}
    for record in records:
        for key, value in record.items():
            if not key.startswith("validation/") or not isinstance(value, (int, float)):
                continue
            lower = inferred_mode(key, None) == "min"
            if key not in best or (value < best[key][0] if lower else value > best[key][0]):
                best[key] = (value, record.get("step"))
    return ", ".join(f"{k}={format_value(v)} (step {s})" for k, (v, s) in best.items()) or None


def _megatron_run(run_dir: Path) -> bool:
    """Whether the run trained a megatron-core model (config.yaml's model.arch)."""
    import yaml

    try:
        arch = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get(
            "model", {}).get("arch", "")
    except (OSError, yaml.YAMLError, AttributeError):
        return False
    return str(arch).startswith("megatron")


def summary_lines(run_dir: Path, argv: list[str] | None = None) -> list[str]:
    run_dir = Path(run_dir).absolute()  # every line holds for any folder it is used from
    records = read_metrics(run_dir)
    root = run_dir / "checkpoints"
    rows = [("final", _final(records)), ("best", _best(records))]
    unevaluated = next((r[NO_EVALUATION] for r in records if NO_EVALUATION in r), None)
    if unevaluated and not any(k.startswith("validation/") for r in records for k in r):
        rows.append(("evaluation", f"none: {unevaluated}"))
    marker = store.read_best(root) if root.is_dir() else None
    if marker is not None:
        kept = root / f"step_{marker['step']:08d}"
        rows.append(("kept best", f"{marker.get('metric')}={format_value(marker.get('value'))} "
                                  f"at step {marker['step']}: {kept}"))
    newest = store.newest_complete(root) if root.is_dir() else None
    rows.append(("newest", str(newest) if newest else "none: no checkpoint was written"))
    if (run_dir / "hf_model").is_dir():
        rows.append(("exported", str(run_dir / "hf_model")))
    stop = planned_stop(records)
    if newest and stopped_early(stop):
        rows.append(("train on", resume_command(run_dir, argv, TRAIN_ON)))
    elif newest:
        rows.append(("resume", resume_command(run_dir, argv)))
        if not _megatron_run(run_dir):  # its checkpoints do not export (the run's end does)
            rows.append(("export", shlex.join(["rapidformer", "export", str(run_dir), "--to",
                                               "DIR"])))
    if records:
        rows.append(("curves", shlex.join(["rapidformer", "plot", str(run_dir)])))
    width = max(len(name) for name, _ in rows)
    if stopped_early(stop):
        ended = f"run {stop_words(stop)}: {run_dir}"
    elif stop:
        ended = (f"run stopped at step {stop['step']} of {stop[STOPPED]['of']} "
                 f"({stop[STOPPED]['by']}): {run_dir}")
    else:
        ended = f"run finished: {run_dir}"
    return [f"rapidformer: {ended}",
            *(f"  {name:<{width}}  {value}" for name, value in rows if value)]


def print_summary(run_dir: Path, argv: list[str] | None = None, file=None) -> None:
    print("\n".join(summary_lines(run_dir, argv)), file=file or sys.stderr, flush=True)
