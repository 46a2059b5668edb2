"""Megatron's split semantics and the seed's mpu.broadcast_data (data-parallel only)."""
from __future__ import annotations

import pytest
import torch

from rapidformer.data.splits import split_boundaries, split_ranges
from rapidformer.errors import ConfigError, InputError


@pytest.mark.parametrize("split,size,expected", [
    ("980,20", 1000, [0, 980, 1000, 1000]),
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("98/2", 100, [0, 98, 100, 100]),
    ("1,1,1", 7, [0, 3, 5, 7]),      # 2.33 rounds to 2 three times; shifted so the end is 7
    ("1,1,1", 8, [0, 2, 5, 8]),      # 2.67 rounds to 3: 9 > 8, shifted back by one
    ("100", 5, [0, 5, 5, 5]),
])
def test_split_boundaries_follow_megatron(split, size, expected):
    assert split_boundaries(split, size) == expected


def test_an_empty_split_is_no_dataset():
    train, valid, test = split_ranges("980,20", 1000)
    assert (train, valid, test) == (range(0, 980), range(980, 1000), None)


@pytest.mark.parametrize("split", ["abc", "0,0", "1,-1", "1,2,3,4"])
def test_bad_split_strings(split):
    with pytest.raises(ConfigError, match="split"):
        split_boundaries(split, 10)


def test_broadcast_data_with_data_parallelism_only():
    from rapidformer import mpu

    batch = {"text": torch.arange(6).reshape(2, 3), "other": torch.zeros(1)}
    out = mpu.broadcast_data(["text"], batch, torch.int64)
    assert list(out) == ["text"] and torch.equal(out["text"].cpu(), batch["text"])
    with pytest.raises(InputError, match="'text' is torch.int64, expected torch.float32"):
        mpu.broadcast_data(["text"], batch, torch.float32)
    with pytest.raises(InputError, match="no key 'labels'"):
        mpu.broadcast_data(["labels"], batch, torch.int64)
