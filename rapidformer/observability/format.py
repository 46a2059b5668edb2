"""How metric values read in log lines and the end-of-run summary: counts as integers
(`validation/seen=400`, not `400.0000`), everything else with four decimals."""
from __future__ import annotations

import math


def format_value(value) -> str:
    """An integer, or a float with an integral value (evaluation returns every metric as a
    float, so a count arrives as 400.0), prints without decimals; other floats with four."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return str(int(value))
        return f"{value:.4f}"
    return str(value)


def format_metrics(metrics: dict) -> str:
    """`name=value, name=value` in the dict's order."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in metrics.items())


def precision_label(precision) -> str:
    """The precision a run computes in: its autocast dtype, and for fp8, which trains the
    layers it does not convert under that dtype, both ("fp8 (bf16 autocast)")."""
    if precision.name == "fp8":
        return f"fp8 ({precision.dtype} autocast)"
    return precision.dtype
