"""BERT's masked-LM predictions (data/bert_masking.py) equal megatron-core's own, sample for
sample and draw for draw, on every masking setting megatron-core offers and on token lists made
to be awkward; the BERT datasets the project builds use them."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset  # noqa: E402

from rapidformer.data.bert_masking import (FastMaskingBERTDataset,  # noqa: E402
                                           masked_lm_predictions)
from rapidformer.data.megatron import MegatronTokenizer, build_bert_datasets  # noqa: E402
from rapidformer.data.preprocess_tokenizers import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def bert(pretraining_data, tmp_path_factory):
    hf, eod, _ = build_tokenizer("BertWordPieceLowerCase", str(pretraining_data["vocab"]), None,
                                 None)
    tokenizer = MegatronTokenizer.from_hf(hf, eod)
    train, _, _ = build_bert_datasets(pretraining_data["bert"], tokenizer, "980,20",
                                      [300, 20, 0], seq_length=128, masked_lm_prob=0.15,
                                      short_seq_prob=0.1, seed=3,
                                      path_to_cache=tmp_path_factory.mktemp("bert_cache"))
    return train.dataset, tokenizer


def token_lists(dataset, tokenizer, count: int = 60):
    """Real samples' token lists, and lists made to be awkward: a continuation first, only
    [CLS]/[SEP], words of many pieces, one token, continuations after a [SEP]."""
    rng = np.random.RandomState(0)
    pieces = [i for i, t in tokenizer.inv_vocab.items() if t.startswith("##")]
    words = [i for i, t in tokenizer.inv_vocab.items()
             if not t.startswith("##") and i not in (tokenizer.cls, tokenizer.sep)]
    cls, sep = tokenizer.cls, tokenizer.sep
    lists = [[cls, pieces[0], pieces[1], words[0], sep], [cls, sep], [cls, sep, sep],
             [cls, words[3], sep], [cls, words[1], sep, pieces[2], pieces[3], sep],
             [cls] + [words[4]] + pieces[:40] + [sep]]
    for _ in range(count):
        n = rng.randint(1, 126)
        body = [int(rng.choice(pieces if rng.rand() < 0.3 else words)) for _ in range(n)]
        lists.append([cls, *body[: n // 2], sep, *body[n // 2:], sep])
    for idx in range(count):
        beg, end, _ = dataset.sample_index[idx]
        tokens = [cls]
        for i in range(beg, end):
            tokens += [int(t) for t in dataset.dataset[i]][:60]
        lists.append(tokens[:127] + [sep])
    return lists


SETTINGS = [dict(masking_do_full_word=w, masking_max_ngram=n, masking_use_longer_ngrams=longer,
                 masking_use_geometric_distribution=geometric, masking_probability=p)
            for w, n, longer, geometric, p in itertools.product(
                (True, False), (1, 3), (False, True), (False, True), (0.15, 0.5))
            if not (geometric and longer)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(
    f"{k.split('_')[-1]}={v}" for k, v in s.items()))
def test_the_predictions_and_the_draws_equal_megatron_cores(bert, setting):
    dataset, tokenizer = bert
    dataset = copy.copy(dataset)
    dataset.config = copy.copy(dataset.config)
    for key, value in setting.items():
        setattr(dataset.config, key, value)
    for seed, tokens in enumerate(token_lists(dataset, tokenizer)):
        for target in (len(tokens), 128):
            theirs_rng, ours_rng = np.random.RandomState(seed), np.random.RandomState(seed)
            theirs = BERTMaskedWordPieceDataset._create_masked_lm_predictions(
                dataset, list(tokens), target, theirs_rng)
            ours = masked_lm_predictions(dataset, list(tokens), target, ours_rng)
            assert [list(map(int, x)) for x in theirs[:4]] == [list(map(int, x)) for x in ours[:4]]
            assert [(list(a), list(map(int, b))) for a, b in theirs[4]] == \
                [(list(a), list(map(int, b))) for a, b in ours[4]]
            assert theirs_rng.randint(1 << 30) == ours_rng.randint(1 << 30)  # same draws


def test_the_project_s_bert_samples_are_megatron_cores(bert, tmp_path):
    dataset, _ = bert
    assert type(dataset) is FastMaskingBERTDataset
    theirs = copy.copy(dataset)
    theirs.__class__ = BERTMaskedWordPieceDataset
    for idx in range(len(dataset)):
        a, b = dataset[idx], theirs[idx]
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a), idx


def test_the_permutation_option_runs_megatron_cores_code(bert, monkeypatch):
    dataset, tokenizer = bert
    dataset = copy.copy(dataset)
    dataset.config = copy.copy(dataset.config)
    dataset.config.masking_do_permutation = True
    called = []
    monkeypatch.setattr(BERTMaskedWordPieceDataset, "_create_masked_lm_predictions",
                        lambda self, *args: called.append(args) or "megatron-core's")
    assert dataset._create_masked_lm_predictions([tokenizer.cls], 8, None) == "megatron-core's"
    assert called


def with_tokenizer(dataset, **changes):
    import dataclasses

    dataset = copy.copy(dataset)
    dataset.config = copy.copy(dataset.config)
    dataset.config.tokenizer = dataclasses.replace(dataset.config.tokenizer, **changes)
    return dataset


def both(dataset, tokens, target=20, seed=0):
    """(megatron-core's result or its exception type, ours), each with the next draw."""
    out = []
    for call in (BERTMaskedWordPieceDataset._create_masked_lm_predictions,
                 FastMaskingBERTDataset._create_masked_lm_predictions):
        rng = np.random.RandomState(seed)
        try:
            result = call(dataset, list(tokens), target, rng)
            out.append(([list(map(int, x)) for x in result[:4]], rng.randint(1 << 30)))
        except Exception as exc:  # noqa: BLE001 - the exception's type is compared
            out.append(type(exc))
    return out


def test_a_token_the_vocabulary_lacks_is_megatron_cores_key_error(bert):
    dataset, tokenizer = bert
    words = [i for i, t in tokenizer.inv_vocab.items() if not t.startswith("##")][5:8]
    cls, sep = tokenizer.cls, tokenizer.sep
    gap = dict(tokenizer.inv_vocab)
    del gap[words[1]]
    cases = [(dataset, [cls, words[0], -1, sep]), (dataset, [cls, words[0], 10**6, sep]),
             (with_tokenizer(dataset, inv_vocab=gap), [cls, *words, sep])]
    for data, tokens in cases:
        theirs, ours = both(data, tokens)
        assert theirs is KeyError and ours is KeyError


def test_special_tokens_outside_the_vocabulary_and_a_changed_tokenizer(bert):
    dataset, tokenizer = bert
    words = [i for i, t in tokenizer.inv_vocab.items() if not t.startswith("##")][5:12]
    # [CLS]/[SEP] ids the vocabulary lacks: megatron-core checks them before any lookup
    outside = with_tokenizer(dataset, cls=10**6, sep=10**6 + 1)
    theirs, ours = both(outside, [10**6, *words, 10**6 + 1])
    assert theirs == ours and not isinstance(theirs, type)
    # a copy given another tokenizer (a word that now continues one): its own tables
    both(dataset, [tokenizer.cls, *words, tokenizer.sep])  # the original's tables are built
    changed = dict(tokenizer.inv_vocab)
    changed[words[2]] = "##zz"
    other = with_tokenizer(dataset, inv_vocab=changed)
    theirs, ours = both(other, [tokenizer.cls, *words, tokenizer.sep], target=100, seed=4)
    assert theirs == ours


def test_the_index_cache_and_pickling_are_megatron_cores(bert):
    import pickle

    dataset, _ = bert
    # megatron-core names the cache's files after the class: the same samples, the same cache
    assert type(dataset).__name__ == "BERTMaskedWordPieceDataset"
    assert dataset.unique_identifiers["class"] == "BERTMaskedWordPieceDataset"
    again = pickle.loads(pickle.dumps(dataset))
    assert type(again) is FastMaskingBERTDataset
    assert all(np.array_equal(again[3][k], dataset[3][k]) for k in dataset[3])
