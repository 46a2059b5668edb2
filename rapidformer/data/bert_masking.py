"""BERT's masked-LM predictions as megatron-core makes them, sample for sample, faster.

megatron-core's `MaskedWordPieceDataset._create_masked_lm_predictions` walks a sample's tokens in
Python: a word boundary per token through the vocabulary's strings, every candidate's 1- to
3-grams built as nested lists, a `RandomState.choice` call per candidate tried. That is about
5 ms a 512-token sample on a laptop core, and on one H200 host 12 loader workers delivered
550-600 samples a second of long-document BERT pretraining, less than the GPU trains
(docs/benchmarks.md). Here the boundaries and candidates come from NumPy (a per-vocabulary table
of word-continuation tokens), an n-gram is a slice of the candidates' positions, and the random
state is drawn exactly in megatron-core's order: the shuffle of the candidates (shuffling their
indices draws the same numbers), `choice`'s one uniform draw against the same cumulative
probabilities, each token's mask from the dataset's own `_get_token_mask`, the second shuffle.
tests/test_bert_masking.py compares every sample with megatron-core's own, for the settings this
project uses and the others megatron-core offers; its permutation option (off in Megatron-LM's
pretrain_bert.py and here) and a token the vocabulary lacks (its KeyError) run megatron-core's
code.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset


class FastMaskingBERTDataset(BERTMaskedWordPieceDataset):
    """megatron-core's BERT dataset with the masked-LM predictions computed here."""

    def _create_masked_lm_predictions(self, token_ids, target_sequence_length,
                                      numpy_random_state):
        result = None if self.config.masking_do_permutation else masked_lm_predictions(
            self, token_ids, target_sequence_length, numpy_random_state)
        if result is None:
            # megatron-core's own code: its permutation option, and its KeyError for an id
            # the vocabulary lacks
            return super()._create_masked_lm_predictions(token_ids, target_sequence_length,
                                                         numpy_random_state)
        return result


# megatron-core names the index cache's files after the class: the samples are the same, so is
# the cache (a run of either class reuses the other's; pickling goes by the qualified name)
FastMaskingBERTDataset.__name__ = BERTMaskedWordPieceDataset.__name__


def _word_tables(dataset) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: whether the vocabulary has it, and whether it continues a word
    (WordPiece's "##"); built once per tokenizer."""
    tokenizer = dataset.config.tokenizer
    cached = getattr(dataset, "_word_tables", None)
    if cached is None or cached[0] is not tokenizer:
        inv = tokenizer.inv_vocab
        known = np.zeros(max(inv, default=-1) + 1, dtype=bool)
        continues = np.zeros_like(known)
        for token_id, token in inv.items():
            if token_id >= 0:
                known[token_id] = True
                continues[token_id] = token.startswith("##")
        cached = dataset._word_tables = (tokenizer, known, continues)
    return cached[1], cached[2]


def _ngram_cdf(config) -> tuple[np.ndarray, np.ndarray]:
    """The n values and the cumulative probabilities `RandomState.choice` searches, as it
    computes them from megatron-core's probabilities."""
    values = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
    probabilities = 1.0 / values
    probabilities = probabilities / probabilities.sum(keepdims=True)
    if config.masking_use_longer_ngrams:
        probabilities = probabilities[::-1]
    # megatron-core passes p[:n] / p[:n].sum() with n = all the values (every candidate has
    # them all: a slice past the last candidate is shorter, never empty)
    p = probabilities / probabilities.sum(keepdims=True)
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return values, cdf


def masked_lm_predictions(dataset, token_ids, target_sequence_length, rng):
    """(masked token ids, masked positions, their labels, boundaries, masked spans): what
    megatron-core's `_create_masked_lm_predictions` returns for the same arguments; None, with
    nothing drawn, where a token but [CLS] and [SEP] has no vocabulary entry (megatron-core
    looks each up and raises KeyError)."""
    config = dataset.config
    tokenizer = config.tokenizer
    ids = np.asarray(token_ids, dtype=np.int64)
    special = (ids == tokenizer.cls) | (ids == tokenizer.sep)
    words = ids[~special]
    known, continuation = _word_tables(dataset)
    if words.size and not (words.min() >= 0 and words.max() < known.size and known[words].all()):
        return None
    continues = np.zeros(ids.size, dtype=bool)
    continues[~special] = continuation[words]
    starts = ~special & ~continues
    boundaries = (special | starts).astype(np.int64).tolist()
    eligible = np.flatnonzero(~special)  # the candidates' positions, in order
    if config.masking_do_full_word:
        # a candidate begins at each word start, and at the first position when a
        # continuation comes before any word start
        begins = starts[eligible]
        if eligible.size:
            begins[0] = True
    else:
        begins = np.ones(eligible.size, dtype=bool)
    offsets = np.append(np.flatnonzero(begins), eligible.size)  # candidate c: [c], [c + 1]
    count = offsets.size - 1

    n_maskings = min(config.masking_probability * target_sequence_length,
                     max(1, int(round(len(token_ids) * config.masking_probability))))
    values, cdf = _ngram_cdf(config)
    max_n, geometric = config.masking_max_ngram, config.masking_use_geometric_distribution
    order = np.arange(count)
    rng.shuffle(order)

    # the loop meets every candidate while the maskings fall short (each draws a number):
    # plain Python on lists, a few microseconds a candidate
    positions, offsets = eligible.tolist(), offsets.tolist()
    values, cdf = values.tolist(), cdf.tolist()
    uniform = rng.random_sample
    masked_token_ids = list(token_ids)
    masked, spans = [], []
    taken = [False] * len(token_ids)
    for candidate in order.tolist():
        if len(masked) >= n_maskings:
            break
        # RandomState.choice(values, p=...): one uniform against the cumulative probabilities
        n = min(rng.geometric(0.2), max_n) if geometric else values[bisect_right(cdf, uniform())]
        start = offsets[candidate]
        while True:
            end = offsets[min(candidate + n, count)]
            n -= 1
            if n_maskings >= len(masked) + end - start:
                break
            if n == 0:
                end = None
                break
        if end is None:
            continue
        indices = positions[start:end]
        if any(taken[index] for index in indices):
            continue
        for index in indices:
            taken[index] = True
            mask = dataset._get_token_mask(rng)
            masked_token_ids[index] = token_ids[index] if mask is None else mask
            masked.append((index, token_ids[index]))
        spans.append((indices, [token_ids[index] for index in indices]))
    rng.shuffle(order)  # megatron-core shuffles its candidates again; later draws follow it

    masked.sort(key=lambda pair: pair[0])
    spans.sort(key=lambda span: span[0][0])
    return (masked_token_ids, [p for p, _ in masked], [label for _, label in masked],
            boundaries, spans)
