"""What a training batch holds, in the three numbers the metrics window counts: samples (the
examples it trains on), real tokens, and slots (token positions computed, padding included).

A collate that lays examples out in its own way (several examples a row, one row of real tokens)
knows them and attaches them under `COUNTS`; every other batch is counted from the padded
layout (a row of `input_ids` per example, `attention_mask` marking the real tokens). The loop's
input iterator takes them off the batch before the batch reaches the model.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

COUNTS = "rapidformer_counts"


class BatchCounts(NamedTuple):
    samples: int
    tokens: int | torch.Tensor  # a device tensor where counting it on the host would sync
    slots: int


def with_counts(batch: dict, samples: int, tokens: int, slots: int) -> dict:
    batch[COUNTS] = {"samples": int(samples), "tokens": int(tokens), "slots": int(slots)}
    return batch


def take_counts(batch) -> BatchCounts | None:
    """The batch's counts, taken off it when a collate attached them; from the padded layout
    otherwise; None for a batch that is not a dict with input_ids."""
    if not isinstance(batch, dict):
        return None
    attached = batch.pop(COUNTS, None)
    if attached is not None:
        return BatchCounts(attached["samples"], attached["tokens"], attached["slots"])
    ids = batch.get("input_ids")
    if ids is None:
        return None
    mask = batch.get("attention_mask")
    return BatchCounts(ids.shape[0], mask.sum() if mask is not None else ids.numel(),
                       ids.numel())
