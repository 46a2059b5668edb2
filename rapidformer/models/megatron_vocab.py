"""The padded vocabulary of the megatron-core models: how many embedding rows a run's
tokenizer becomes, the same for every tensor-parallel layout (used by the model builders, the
GPT-2 importer and the memory plan)."""
from __future__ import annotations

import math

# the embedding table is padded so that it splits evenly over tensor-parallel ranks and keeps
# GEMMs aligned (Megatron's --make-vocab-size-divisible-by); the padded ids never occur in data
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """A multiple of 128 and of the tensor-parallel size. Megatron pads to 128 x TP, so its
    vocabulary (and its losses) change with the layout; this size is the same for any TP that
    divides 128, so a layout reproduces another."""
    step = math.lcm(VOCAB_MULTIPLE, tensor_parallel)
    return -(-vocab_size // step) * step
