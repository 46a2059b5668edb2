"""What the backends and the model transforms refuse in a config: the config's part of the one
refusal pass (rapidformer/preflight.py), which the memory plan also asks of each mode it
considers, so that it never offers one the run refuses."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rapidformer import transforms
from rapidformer.accelerators.table import backend_problems

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig


def config_problems(cfg: RunConfig) -> list[str]:
    """The backend table's refusals and those of each strategy the config asks for, and every
    model transform's."""
    return [*backend_problems(cfg), *transforms.config_problems(cfg)]
