"""A step's loss as the mean over every item of its global batch, however the items fall into
micro-batches and ranks.

A task's loss is a mean over its micro-batch's items (labelled tokens, or examples). Averaging
those means over a step's micro-batches (the backward divides by their number) and over ranks
(the strategy averages gradients) weighs an item of a micro-batch with few of them more than
one of a full micro-batch: the same rows gave another gradient at micro batch 1 than at 8 (an
SFT step of answers of 4 and 15 tokens). Each micro-batch's loss is scaled by
`items x micro-batches x ranks / the step's items`, so the two averages give the mean over every
item, as Hugging Face Trainer's `num_items_in_batch` does. The counts stay on the device: the
step's total is one small all-reduce, with no host synchronisation.
"""
from __future__ import annotations

import torch

IGNORE = -100


def loss_items(batch, unit: str):
    """How many items a task's loss averages over in `batch`: "examples" (one label each),
    "labels" (every label that is not IGNORE) or "next_labels" (a causal LM's labels, shifted by
    one position); None where the batch does not say."""
    if not isinstance(batch, dict):
        return None
    if unit == "examples":
        for key in ("labels", "start_positions", "input_ids"):
            if key in batch and torch.is_tensor(batch[key]):
                return batch[key].shape[0]
        return None
    labels = batch.get("labels")
    if not torch.is_tensor(labels):
        return None
    if unit == "next_labels":
        labels = labels[..., 1:]
    return (labels != IGNORE).sum()


def micro_batch_weights(counts: list, ranks: int, all_reduce_sum, device) -> list | None:
    """Each micro-batch's factor on its mean loss (the module docstring); None when a count is
    missing. `all_reduce_sum` sums a tensor over the ranks."""
    if any(c is None for c in counts):
        return None
    if all(isinstance(c, int) for c in counts):  # examples: one copy to the device, no wait
        items = torch.tensor(counts, dtype=torch.float32).to(device, non_blocking=True)
    else:  # labels counted on the device
        items = torch.stack([c.float() for c in counts])
    total = all_reduce_sum(items.sum())
    return list((items * (len(counts) * ranks) / total.clamp(min=1)).unbind())
