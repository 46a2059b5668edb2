"""trainer.unpad under CUDA graphs: the packed row's length and the masked-position count take few
shapes (each new shape is a recording), on a table of batch streams, without a segment longer
than the attention is told and without losing a masked position."""
from __future__ import annotations

import random

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.data.lengths import packed_length, packed_step
from rapidformer.models.unpadded import Unpad, WithMaskedPositions, longest_segment
from rapidformer.preflight import settle
from rapidformer.transforms.packed import PackedSequences

from tests.test_padding_options import TINY

PAD = 0


FULL = 32 * 512


@pytest.mark.parametrize("tokens, multiple, most, length", [
    (100, 256, None, 256), (15000, 256, None, 15104), (15000, 8, None, 15000),
    (100, 256, FULL, 256), (2300, 256, FULL, 2304), (3000, 256, FULL, 3072),
    (4097, 256, FULL, 4608), (15000, 256, FULL, 15360), (16384, 256, FULL, 16384),
    (16385, 256, 20000, 18432), (0, 256, FULL, 256), (1, 8, 64, 8), (70, 8, 4096, 72),
    # never past a full batch rounded to the multiple (the memory plan's tokens)
    (15000, 256, 15100, 15104), (16000, 256, 16100, 16128), (16500, 256, 16896, 16896),
])
def test_a_packed_row_is_rounded_to_a_step_that_grows_with_it_under_cuda_graphs(
        tokens, multiple, most, length):
    assert packed_length(tokens, multiple, most) == length
    step = packed_step(tokens, multiple, most)
    assert length - max(tokens, 1) < step and length >= max(tokens, 1)
    if most is not None:
        assert length <= -(-most // multiple) * multiple


def stream(kind: str, batches: int, rows: int = 32, seq: int = 512, seed: int = 0):
    """Batches shaped like Megatron's BERT samples: long documents fill every position but for
    short-sequence samples; short documents are a few sentences; 15 % of each row masked."""
    rng = random.Random(seed)
    for _ in range(batches):
        if kind == "long":
            lengths = [rng.randint(2, seq) if rng.random() < 0.1 else rng.randint(seq - 60, seq)
                       for _ in range(rows)]
        elif kind == "short":
            lengths = [rng.randint(30, 150) for _ in range(rows)]
        else:  # uneven: any length, a random share masked
            lengths = [rng.randint(1, seq) for _ in range(rows)]
        mask = torch.zeros(rows, seq, dtype=torch.long)
        labels = torch.full((rows, seq), -100)
        for r, n in enumerate(lengths):
            mask[r, :n] = 1
            share = 0.15 if kind != "uneven" else rng.random() * 0.5
            for p in rng.sample(range(n), max(1, round(n * share))):
                labels[r, p] = 7
        yield {"input_ids": torch.randint(5, 90, (rows, seq)) * mask, "attention_mask": mask,
               "labels": labels}


@pytest.mark.parametrize("kind, most_shapes", [("long", 8), ("short", 8), ("uneven", 40)])
def test_packed_bert_batches_take_few_shapes_under_cuda_graphs(kind, most_shapes):
    seq, rows = 512, 32
    shapes = {}
    for grows in (False, True):
        most = rows * seq if grows else None
        longest = longest_segment(seq, 256, most)
        collate = Unpad(lambda b: b, PAD, 256, mlm_multiple=64, longest=longest,
                        most_tokens=most, max_length=seq)
        seen = set()
        for batch in stream(kind, 200, rows, seq):
            packed = collate(dict(batch))
            ends = packed["cu_seq_lens_q"]
            real = int(batch["attention_mask"].sum())
            assert int(ends[-2]) == real and int(ends[-1]) == packed["input_ids"].shape[1]
            assert int(ends[-1]) - real < max(longest, 256)
            positions = packed["masked_positions"]
            masked = int((batch["labels"] != -100).sum())
            assert int((positions >= 0).sum()) == masked  # no masked position lost
            assert packed["labels"].reshape(-1)[positions[:masked]].eq(7).all()
            seen.add((packed["input_ids"].shape[1], positions.numel()))
        shapes[grows] = len(seen)
    assert shapes[True] <= most_shapes and shapes[True] <= shapes[False]
    if kind == "long":  # the case that re-recorded graphs all run long
        assert shapes[False] >= 2 * shapes[True]


def test_the_attention_is_told_the_longest_grown_tail():
    assert longest_segment(512, 256) == 512 and longest_segment(128, 256) == 256
    assert longest_segment(512, 256, 32 * 512) == 2048  # 16,384 tokens: a step of 2,048
    assert longest_segment(128, 256, 32 * 128) == 512
    assert longest_segment(512, 256, 4 * 512) == 512


def test_the_masked_count_follows_the_batch_size_under_cuda_graphs():
    labels = torch.full((32, 512), -100)
    labels.view(-1)[torch.randperm(32 * 512)[:2300]] = 1
    plain = WithMaskedPositions(lambda b: b, 64)({"labels": labels})["masked_positions"]
    relative = WithMaskedPositions(lambda b: b, 64, relative=True)({"labels": labels})
    assert plain.numel() == 2304 and relative["masked_positions"].numel() == 2560
    assert sorted(relative["masked_positions"][:2300].tolist()) == sorted(plain[:2300].tolist())


def test_a_sequence_longer_than_the_data_s_is_refused_whatever_the_tail_may_be():
    from rapidformer.errors import InputError

    mask = torch.ones(2, 700, dtype=torch.long)
    batch = {"input_ids": torch.ones(2, 700, dtype=torch.long), "attention_mask": mask}
    collate = Unpad(lambda b: b, PAD, 256, longest=longest_segment(512, 256, FULL),
                    most_tokens=FULL, max_length=512)
    with pytest.raises(InputError, match="a segment of 700 tokens, longer than the 512"):
        collate(dict(batch))


@pytest.mark.parametrize("overrides, grows", [
    (["graph=compile", "graph.mode=reduce-overhead"], True),
    (["graph=compile", "graph.mode=max-autotune"], True),
    (["graph=compile", "+graph.options={triton.cudagraphs:true}"], True),
    (["graph=compile"], False),
    (["graph=eager"], False),
    (["graph=compile", "graph.mode=reduce-overhead", "data.pad_to=512"], False),
])
def test_only_cuda_graphs_on_a_gpu_with_pad_to_auto_grow_the_step(overrides, grows, tmp_path):
    _, cfg = settle(compose([*TINY, "trainer.unpad=true", *overrides]), str(tmp_path))
    compiled = cfg.graph.name == "compile"
    assert PackedSequences(cfg)._rounding(compiled)[1] is None  # a CPU run: no CUDA graphs
    cfg.trainer.device = "cuda"
    multiple, most = PackedSequences(cfg)._rounding(compiled)
    assert (most is not None) == grows
    if grows:
        assert most == cfg.trainer.micro_batch_size * cfg.data.max_seq_length
