"""The lengths fine-tuning batches are padded to (`data.pad_to`).

Padding a batch to its longest row wastes the least compute, but a compiled model meets a new
shape with almost every batch: torch.compile recompiles (or falls back to a dynamic-shape graph
with slower kernels), and CUDA graphs record one graph per shape. Padding to a few bucket
lengths bounds the shapes for a few percent more padding; the share of padding is logged as
`padding_frac` either way.

`auto` is the batch's longest row in eager mode, and with graph=compile (or precision=fp8,
whose matmuls need a multiple of 16 tokens) the next multiple of 16: torch.compile's automatic dynamic shapes then cover every length with one graph after the
second, and no length-alignment guard of the attention kernels tells two lengths apart (on one
H200, plain Hugging Face + torch.compile at lengths of the longest row spent 90 s of a
3-epoch, 13-second fine-tune recompiling; docs/benchmarks.md). With
trainer.unpad the padded dimension is the packed row's token count, rounded up to a multiple
(`token_multiple`), and under CUDA graphs to a step that grows with the row (`packed_length`).
"""
from __future__ import annotations

import bisect

import torch

IGNORE = -100  # the label of a position without a loss
COMPILED_MULTIPLE = 16
# value of each key's padding; input_ids pad with the tokenizer's pad id, any other [B, S]
# tensor with 0
_FILLS = {"labels": IGNORE, "attention_mask": 0, "special_tokens_mask": 1}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fill_value(key: str, pad_id: int) -> int:
    return pad_id if key == "input_ids" else _FILLS.get(key, 0)


def bucket_lengths(pad_to, max_length: int, compiled: bool) -> list[int] | int | None:
    """data.pad_to resolved: a sorted list of bucket lengths, an int (pad to a multiple of
    it), or None (the batch's longest row)."""
    if pad_to == "auto":
        return COMPILED_MULTIPLE if compiled else None
    if pad_to == "longest":
        return None
    if pad_to == "max":
        return [max_length]
    if isinstance(pad_to, int):
        return pad_to
    return sorted({int(b) for b in pad_to if b < max_length} | {max_length})


def target_length(longest: int, rule) -> int:
    if rule is None:
        return longest
    if isinstance(rule, int):
        return round_up(longest, rule)
    return rule[min(bisect.bisect_left(rule, longest), len(rule) - 1)]


def expected_recompiles(pad_to) -> int:
    """The recompiles a compiled model's batch shapes explain: one per bucket length, or two
    (torch.compile's automatic dynamic shapes: the second length it meets compiles a graph for
    every length) where the lengths are the longest row's or a multiple's."""
    return len(pad_to) if isinstance(pad_to, list) else 2


def token_multiple(pad_to, compiled: bool) -> int:
    """trainer.unpad: the multiple the packed row's tokens are rounded up to."""
    if isinstance(pad_to, int):
        return pad_to
    return 256 if compiled and pad_to == "auto" else 8


# a packed row's lengths per doubling of its token count under CUDA graphs
STEPS_PER_DOUBLING = 8


def packed_step(tokens: int, multiple: int, most: int | None = None) -> int:
    """The step a packed row of `tokens` real tokens is rounded up to: `multiple`, or where the
    step grows (`most`: the most tokens a batch holds; CUDA graphs, which record a graph for
    every new shape) an eighth of the row's power of two when that is more. Rows of BERT-base
    pretraining on long documents (32 x 512 tokens a batch) then take 5 lengths in 200 batches
    instead of 27 at 3.5 % padding instead of 0.9 %: the recordings end within the run's first
    steps."""
    if most is None:
        return multiple
    return max(multiple, (1 << (max(tokens, 1).bit_length() - 1)) // STEPS_PER_DOUBLING)


def packed_length(tokens: int, multiple: int, most: int | None = None) -> int:
    """`tokens` rounded up to its step; never past `most` rounded up to `multiple` (what a
    full batch is rounded to without the growing step: the memory plan's tokens)."""
    length = round_up(max(tokens, 1), packed_step(tokens, multiple, most))
    return length if most is None else min(length, round_up(most, multiple))


def pad_batch(batch: dict, length: int, pad_id: int, left: bool = False) -> dict:
    """Every [B, S] tensor of a collated batch padded to [B, length]."""
    rows, width = batch["input_ids"].shape
    if length <= width:
        return batch
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (rows, width):
            extra = value.new_full((rows, length - width), fill_value(key, pad_id))
            value = torch.cat([extra, value] if left else [value, extra], dim=1)
        out[key] = value
    return out


class PadTo:
    """Collate step: the wrapped collate function's batch padded up to its bucket length."""

    def __init__(self, collate, rule, pad_id: int, left: bool = False):
        self.collate, self.rule, self.pad_id, self.left = collate, rule, pad_id, left

    def __call__(self, features):
        batch = dict(self.collate(features))
        width = batch["input_ids"].shape[1]
        return pad_batch(batch, target_length(width, self.rule), self.pad_id, self.left)
