"""Megatron's train/valid/test split of documents: `--split 980,20` (or `969,30,1`, `98/2`).

The weights are normalised, each boundary is the cumulative rounded share of the documents, and
all boundaries are then shifted so that the last is exactly the number of documents — the same
ranges Megatron-LM computes, so a dataset splits identically in both.
"""
from __future__ import annotations

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
    total = sum(weights)
    return [w / total for w in weights]


def split_boundaries(splits_string: str, size: int) -> list[int]:
    """[0, end of train, end of valid, size]; split i covers documents [b[i], b[i+1])."""
    boundaries = [0]
    for weight in parse_split(splits_string):
        boundaries.append(boundaries[-1] + int(round(weight * float(size))))
    diff = boundaries[-1] - size
    return [boundaries[0]] + [b - diff for b in boundaries[1:]]


def split_ranges(splits_string: str, size: int) -> list[range | None]:
    """The three document ranges; an empty split is None (no dataset), not an error."""
    b = split_boundaries(splits_string, size)
    return [range(b[i], b[i + 1]) if b[i + 1] > b[i] else None for i in range(3)]
