"""The active run, and `get_args()`: its config under the seed's argument names.

The entrypoint calls `activate()` once per process before the template or user script runs;
the seed-compatible helpers (`get_args`, `get_tokenizer`, `mpu`, the dataset builders) are the
only readers of it.
"""
from __future__ import annotations

from dataclasses import dataclass

from rapidformer.config.schema import RunConfig
from rapidformer.config.args import Args
from rapidformer.errors import RapidformerError


@dataclass
class ActiveRun:
    cfg: RunConfig
    run_dir: str
    resolved: dict


_ACTIVE: ActiveRun | None = None


def activate(cfg: RunConfig, run_dir: str, resolved: dict) -> ActiveRun:
    global _ACTIVE
    _ACTIVE = ActiveRun(cfg=cfg, run_dir=run_dir, resolved=resolved)
    return _ACTIVE


def current() -> ActiveRun | None:
    """The active run, or None outside one (the seed-compatible helpers' fallback)."""
    return _ACTIVE


def active() -> ActiveRun:
    if _ACTIVE is None:
        raise RapidformerError(
            "no rapidformer run is active in this process: start the script through "
            "`python -m rapidformer user_script=PATH [overrides]` so that the config is composed "
            "and validated first")
    return _ACTIVE


def get_args() -> Args:
    run = active()
    return Args(run.cfg, run.run_dir)
