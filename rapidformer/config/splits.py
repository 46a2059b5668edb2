"""The data.split string as Megatron writes it (`980,20`, `969,30,1`, `98/2`): parsed and
checked with the config; rapidformer.data.splits turns it into document ranges."""
from __future__ import annotations

import numpy as np

from rapidformer.errors import ConfigError


def parse_split(splits_string: str) -> list[float]:
    """Three weights (train, valid, test) summing to 1; missing ones are 0."""
    separator = "," if "," in splits_string else "/"
    try:
        weights = [float(part) for part in splits_string.split(separator)]
    except ValueError as exc:
        raise ConfigError([f"split '{splits_string}': expected numbers separated by ',' or '/', "
                           f"e.g. 980,20 or 969,30,1"]) from exc
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError([f"split '{splits_string}': give up to three non-negative weights "
                           f"(train, valid, test) that are not all zero"])
    weights += [0.0] * (3 - len(weights))
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()
