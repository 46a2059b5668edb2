"""Megatron's train/valid/test split of documents: `--split 980,20` (or `969,30,1`, `98/2`).

The weights are normalised and summed cumulatively; split i covers documents
[round(c_i * N), round(c_{i+1} * N)), so the last boundary is N. These are the ranges that
megatron-core's dataset builder uses (the same floating-point steps, checked against it in the
tests), so a dataset splits identically here and in Megatron-LM. Megatron-LM before
megatron-core (the seed's era) rounded each share and then shifted the boundaries to end at N;
the two rules can differ by one document at a boundary.
"""
from __future__ import annotations

import functools

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


def split_boundaries(splits_string: str, size: int) -> list[int]:
    """[0, end of train, end of valid, size]; split i covers documents [b[i], b[i+1])."""
    cumulative = functools.reduce(lambda a, b: a + [a[-1] + b], parse_split(splits_string), [0])
    return [int(round(c * float(size))) for c in cumulative]


def split_ranges(splits_string: str, size: int) -> list[range | None]:
    """The three document ranges; an empty split is None (no dataset), not an error."""
    b = split_boundaries(splits_string, size)
    return [range(b[i], b[i + 1]) if b[i + 1] > b[i] else None for i in range(3)]
