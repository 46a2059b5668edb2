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

from rapidformer.config.splits import parse_split


def split_boundaries(splits_string: str, size: int) -> list[int]:
    """[0, end of train, end of valid, size]; split i covers documents [b[i], b[i+1])."""
    cumulative = functools.reduce(lambda a, b: a + [a[-1] + b], parse_split(splits_string), [0])
    return [int(round(c * float(size))) for c in cumulative]


def split_ranges(splits_string: str, size: int) -> list[range | None]:
    """The three document ranges; an empty split is None (no dataset), not an error."""
    b = split_boundaries(splits_string, size)
    return [range(b[i], b[i + 1]) if b[i + 1] > b[i] else None for i in range(3)]
