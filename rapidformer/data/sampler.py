"""A sampler that can start mid-epoch: resume continues with exactly the samples that an
uninterrupted run would have seen next."""
from __future__ import annotations

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Indices of this rank's share of whole global batches, shuffled per epoch by (seed, epoch).

    Step s of an epoch uses permutation[s*G:(s+1)*G] (G = global batch); rank r takes the r-th
    contiguous slice of it. The tail that does not fill a global batch is dropped, so every
    optimizer step sees exactly G samples whatever the number of processes.
    """

    def __init__(self, num_samples: int, global_batch_size: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, seed: int = 0,
                 lengths: list[int] | None = None, micro_batch_size: int | None = None):
        if global_batch_size % world_size:
            raise ValueError("global_batch_size must be a multiple of world_size")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start_step = 0
        # length grouping: each micro-batch holds examples of similar length (less padding)
        self.lengths, self.micro = lengths, micro_batch_size
        if lengths is not None and (micro_batch_size is None or len(lengths) != num_samples):
            raise ValueError("length grouping needs one length per sample and the micro batch")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        if self.lengths is not None:
            order = self._group_by_length(order, torch.Generator().manual_seed(
                self.seed + self.epoch + 1))
        for step in range(self.start_step, self.steps_per_epoch):
            first = step * self.global_batch_size + self.rank * self.per_rank
            yield from order[first:first + self.per_rank]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.per_rank

    def _group_by_length(self, order: list[int], generator: torch.Generator) -> list[int]:
        """Within windows of GROUP_WINDOW global batches: sort by length, cut into micro-batches,
        and shuffle the micro-batches. Every micro-batch (the unit that is padded) holds
        neighbours in length, while each step still mixes micro-batches from the whole window —
        unlike sorting whole steps, the gradient of a step is not biased to one length."""
        window = GROUP_WINDOW * self.global_batch_size
        grouped = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda i: self.lengths[i])
            micros = [chunk[i:i + self.micro] for i in range(0, len(chunk), self.micro)]
            full = [m for m in micros if len(m) == self.micro]
            for position in torch.randperm(len(full), generator=generator).tolist():
                grouped.extend(full[position])
            grouped.extend(i for m in micros if len(m) < self.micro for i in m)
        return grouped


GROUP_WINDOW = 16  # global batches per length-grouping window (HF's megabatch is 50 micro)


class PretrainingBatchSampler:
    """Megatron's pretraining order: samples in dataset order (a Megatron dataset is shuffled
    already), one global batch after another, starting at `consumed_samples` — the data position
    a checkpoint keeps. Each global batch is `accumulation` micro-batches of `micro * dp`
    samples; rank r takes the r-th `micro` of each. When the dataset runs out, it starts over.
    """

    def __init__(self, num_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        self.num_samples = num_samples
        self.consumed = consumed_samples
        self.micro = micro_batch_size
        self.rank, self.dp = data_parallel_rank, data_parallel_size
        if num_samples < micro_batch_size * data_parallel_size:
            raise ValueError("fewer samples than one micro-batch per rank")

    def __iter__(self):
        step = self.micro * self.dp
        # whole micro-batch rows only: a tail shorter than micro * dp is skipped each pass
        usable = self.num_samples - self.num_samples % step
        position = self.consumed % usable
        while True:
            first = position + self.rank * self.micro
            yield list(range(first, first + self.micro))
            position = (position + step) % usable
