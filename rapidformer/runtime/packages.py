"""Whether an optional library is installed, without importing it: the refusal pass runs
before any work, and some libraries print when imported (bitsandbytes, megatron-core)."""
from __future__ import annotations

import importlib.util


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails, or a module set to None
        return False
