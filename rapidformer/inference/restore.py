"""A run's checkpoint as `rapidformer eval` and `predict` use it: the run's resolved config (with
overrides, checked as a training command's), the checkpoint chosen and verified byte by byte,
and its fp32 weights read by the strategy that wrote it, so that a checkpoint of any memory mode
(plain, ZeRO shards, FSDP2) is used in one process."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from rapidformer.checkpoint import reading, store
from rapidformer.checkpoint.state import read_state
from rapidformer.config.run_paths import with_anchored_paths
from rapidformer.errors import ConfigError, InputError

log = logging.getLogger("rapidformer")

LAST, BEST = "last", "best"
BEST_FILE = "best.json"  # checkpoints/best.json: the checkpoint trainer.best_metric chose
# what eval and predict decide themselves: one process on the consolidated weights, reading the
# run's directory without resuming, claiming or overwriting it
FIXED_KEYS = ("memory", "parallelism", "graph", "launcher", "user_script", "trainer.resume",
              "trainer.output_dir", "trainer.overwrite")


def run_config(run_dir: Path) -> dict:
    """The resolved config.yaml that the run wrote, as plain data."""
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory; give the directory of a training "
                         f"run (its trainer.output_dir)")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise InputError(f"{path} is missing: {run_dir} is not a run directory (a run writes its "
                         f"resolved config.yaml there first); give a training run's directory")
    try:
        plain = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not readable YAML ({str(exc).splitlines()[0]}); it is the "
                         f"run's record: restore it from the run's .hydra/config.yaml") from exc
    if not isinstance(plain, dict) or "task" not in plain:
        raise InputError(f"{path} holds no run config (no 'task' key); give a training run's "
                         f"directory")
    # its relative paths are the folder's the run started in, wherever this verb runs
    return with_anchored_paths(plain, run_dir)


def _fixed(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in FIXED_KEYS)


def with_overrides(plain: dict, overrides: list[str], verb: str) -> dict:
    """`plain` with `key=value` overrides applied, each checked as a training command's: unknown
    keys (with the closest name), keys the picked options would not read, then (in
    `one_process_config`) every value's type and range. Group options (`data=local`) are not
    swapped here: the run's config is resolved already, so its keys are set instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import OmegaConf

    from rapidformer.config.compose import (OPTION_GROUPS, check_overrides,
                                            ignored_override_problems)

    if not overrides:
        return plain
    parser = OverridesParser.create()
    cfg = OmegaConf.create(plain)
    problems, normalized = [], []
    for given in overrides:  # each checked alone: one command reports every problem
        try:
            (text,) = check_overrides([given])
        except ConfigError as exc:
            problems += exc.problems
            continue
        normalized.append(text)
        (override,) = parser.parse_overrides([text])
        key, text = override.key_or_group, given
        if key in OPTION_GROUPS:
            problems.append(f"{text}: {verb} reads the run's resolved config, where a group's "
                            f"option cannot be swapped; set its keys instead (e.g. "
                            f"data.source=local data.path=DIR data.validation_file=FILE)")
        elif _fixed(key):
            what = key if key.startswith("trainer.") else key.split(".")[0]
            problems.append(f"{text}: {verb} sets {what} itself (one process on the "
                            f"checkpoint's consolidated weights, the run directory read, never "
                            f"resumed or written over); drop the override")
        elif override.is_sweep_override():
            problems.append(f"{text}: {verb} scores one configuration; give one value")
        elif override.type == OverrideType.DEL:
            problems.append(f"{text}: {verb} cannot delete keys of the run's config; set the "
                            f"key to another value instead")
        else:
            OmegaConf.update(cfg, key, override.value(), merge=False, force_add=True)
    if problems:
        raise ConfigError(problems)
    problems = ignored_override_problems(normalized, cfg)
    if problems:
        raise ConfigError(problems)
    return OmegaConf.to_container(cfg, resolve=True)


def one_process_config(plain: dict, run_dir: Path):
    """The typed config of one process that reads `run_dir` (no launcher, no sharding, no
    compilation: eager numerics, which a compiled run's evaluation matches within rounding)."""
    from rapidformer.config.validate import build_run_config

    plain = dict(plain)
    plain["memory"] = {"name": "none"}
    plain["parallelism"] = {"name": "dp"}
    plain["graph"] = {"name": "eager"}
    plain["launcher"] = {**plain.get("launcher", {}), "nproc_per_node": 1, "nnodes": 1,
                         "node_rank": 0}
    # evaluation recomputes nothing: the training run's offload (its GPU's) is not asked here
    plain["trainer"] = {**plain.get("trainer", {}), "resume": None, "output_dir": str(run_dir),
                        "offload_activations": False}
    plain["user_script"] = None
    return build_run_config(plain)


def choose_checkpoint(run_dir: Path, choice: str | None) -> Path:
    """The checkpoint `--checkpoint` names (`last`: the newest complete one; `best`: the one
    checkpoints/best.json names; or a step_NNNNNNNN directory), every byte verified."""
    root = run_dir / "checkpoints"
    if choice in (None, LAST):
        path, problems = reading.newest_verified(root)
        if path is None:
            raise InputError(f"{run_dir}: no complete checkpoint under {root} (interrupted saves "
                             f"are ignored); train the run further, or give --checkpoint "
                             f"PATH to a step_NNNNNNNN directory")
    elif choice == BEST:
        path = best_checkpoint(root)
        problems = store.verify(path)
    else:
        path = Path(choice)
        if not path.is_dir():
            raise InputError(f"--checkpoint {choice}: no such directory; give last, best, or a "
                             f"checkpoints/step_NNNNNNNN directory of the run")
        if not store.NAME.match(path.name):
            raise InputError(f"--checkpoint {choice} is not a checkpoint (a directory named "
                             f"step_NNNNNNNN under the run's checkpoints/); give one, or last or "
                             f"best")
        problems = store.verify(path)
    reading.require_intact(path, problems, f"--checkpoint {choice or LAST}", advice=(
        f"choose another with --checkpoint PATH (`rapidformer verify {run_dir}` lists the "
        f"intact ones)"))
    return path


def best_checkpoint(root: Path) -> Path:
    """The checkpoint named by checkpoints/best.json ({"checkpoint": "step_NNNNNNNN", ...} or
    {"step": N, ...}), which a run with trainer.best_metric keeps up to date."""
    record_file = root / BEST_FILE
    if not record_file.is_file():
        raise InputError(f"--checkpoint best: {record_file} does not exist: the run kept no best "
                         f"checkpoint (train with trainer.best_metric=validation/accuracy, or "
                         f"another logged metric); use --checkpoint last or a step_NNNNNNNN "
                         f"directory")
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{record_file} is not readable JSON ({exc}); use --checkpoint last or "
                         f"a step_NNNNNNNN directory") from exc
    name = record.get("checkpoint") if isinstance(record, dict) else None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(name, str) and name:
        path = Path(name) if Path(name).is_absolute() else root / Path(name).name
    elif isinstance(step, int) and not isinstance(step, bool):
        path = root / f"step_{step:08d}"
    else:
        raise InputError(f"{record_file} names no checkpoint (no 'checkpoint' or 'step' key); "
                         f"use --checkpoint last or a step_NNNNNNNN directory")
    if not path.is_dir():
        raise InputError(f"{record_file} names {path}, which no longer exists; use "
                         f"--checkpoint last or another step_NNNNNNNN directory")
    return path


def checkpoint_weights(ckpt: Path) -> tuple[dict, dict]:
    """(the fp32 model weights, what the checkpoint records)."""
    from rapidformer.accelerators.table import checkpoint_weights as weights

    with reading.named_if_pruned(ckpt, "rapidformer"):
        saved = read_state(ckpt)
        return weights(ckpt, saved), saved


def load_weights(model, state: dict, ckpt: Path) -> None:
    """Every weight of `model` from `state` (tied copies, such as an LM head that shares the
    embedding table, may be missing from the file: they are tied again after loading)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if missing or unexpected:
        raise InputError(f"checkpoint {ckpt} does not fit the model this config builds: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}; were model.* keys "
                         f"overridden? Use the run's own model settings")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
