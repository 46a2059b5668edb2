"""Pretraining data: Megatron's split rule, megatron-core BERT and GPT samples under Hugging Face
keys, the checks on .bin/.idx files, the pretraining sampler, and mpu.broadcast_data."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from rapidformer.data.megatron import (MegatronTokenizer, build_bert_datasets,
                                       build_gpt_datasets, open_indexed)
from rapidformer.data.sampler import PretrainingBatchSampler
from rapidformer.data.splits import split_boundaries, split_ranges
from rapidformer.errors import ConfigError, InputError
from rapidformer.data.preprocess_tokenizers import build_tokenizer
from rapidformer.templates.pretrainer import train_valid_test_num_samples


@pytest.fixture(scope="module")
def bert_tokenizer(pretraining_data):
    hf, eod, _ = build_tokenizer("BertWordPieceLowerCase", str(pretraining_data["vocab"]), None,
                                 None)
    return MegatronTokenizer.from_hf(hf, eod)


@pytest.fixture(scope="module")
def gpt_tokenizer(pretraining_data):
    hf, eod, _ = build_tokenizer("GPT2BPETokenizer", str(pretraining_data["gpt2_vocab"]),
                                 str(pretraining_data["merges"]), None)
    return MegatronTokenizer.from_hf(hf, eod)


# --- splits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("split,size,expected", [
    ("980,20", 1000, [0, 980, 1000, 1000]),
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("98/2", 100, [0, 98, 100, 100]),
    ("1,1,1", 7, [0, 2, 5, 7]),      # 7/3 and 14/3 round to 2 and 5
    ("1,1,1", 8, [0, 3, 5, 8]),
    ("100", 5, [0, 5, 5, 5]),
])
def test_split_boundaries(split, size, expected):
    assert split_boundaries(split, size) == expected


@pytest.mark.parametrize("split", ["980,20", "969,30,1", "98/2", "1,1,1", "7,2,1", "1,0,3"])
@pytest.mark.parametrize("size", [1, 7, 10, 333, 1000, 123457])
def test_split_boundaries_equal_megatron_cores(split, size):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    ranges = split_ranges(split, size)
    for bookends, ours in zip(matrix, ranges):
        theirs = None
        if bookends is not None:
            begin, end = (int(round(b * float(size))) for b in bookends)
            theirs = range(begin, end) if end > begin else None
        assert ours == theirs


def test_an_empty_split_is_no_dataset():
    assert split_ranges("980,20", 1000) == [range(0, 980), range(980, 1000), None]


@pytest.mark.parametrize("split", ["abc", "0,0", "1,-1", "1,2,3,4"])
def test_bad_split_strings(split):
    with pytest.raises(ConfigError, match="split"):
        split_boundaries(split, 10)


def test_datasets_use_the_split_ranges(pretraining_data, gpt_tokenizer, tmp_path):
    documents = len(open_indexed(pretraining_data["gpt"]))
    train, valid, test = build_gpt_datasets(pretraining_data["gpt"], gpt_tokenizer, "80,15,5",
                                            [64, 16, 16], 32, seed=1, path_to_cache=tmp_path)
    for dataset, expected in zip((train, valid, test), split_ranges("80,15,5", documents)):
        indices = dataset.dataset.indices
        assert (int(indices[0]), int(indices[-1]) + 1) == (expected.start, expected.stop)
    _, _, none = build_gpt_datasets(pretraining_data["gpt"], gpt_tokenizer, "98,2", [64, 16, 16],
                                    32, seed=1, path_to_cache=tmp_path)
    assert none is None
    with pytest.raises(InputError, match="leaves no training documents"):
        build_gpt_datasets(pretraining_data["gpt"], gpt_tokenizer, "0,1", [64, 16, 0], 32,
                           seed=1, path_to_cache=tmp_path)


# --- BERT samples ------------------------------------------------------------------------------
def test_bert_samples(pretraining_data, bert_tokenizer, tmp_path):
    t = bert_tokenizer
    train, valid, test = build_bert_datasets(pretraining_data["bert"], t, "980,20", [400, 40, 0],
                                             seq_length=64, masked_lm_prob=0.15,
                                             short_seq_prob=0.1, seed=5, path_to_cache=tmp_path)
    assert test is None and len(train) >= 400 and len(valid) >= 40
    masked, real, nsp, mask_token = 0, 0, [], 0
    for i in range(300):
        s = train[i]
        assert set(s) == {"input_ids", "attention_mask", "token_type_ids", "labels",
                          "next_sentence_label"}
        assert all(v.dtype == torch.int64 for v in s.values())
        assert s["input_ids"].shape == (64,)
        n = int(s["attention_mask"].sum())
        assert s["attention_mask"][:n].all() and not s["attention_mask"][n:].any()
        ids, types, labels = s["input_ids"], s["token_type_ids"], s["labels"]
        # (a masked position may show any random token, [SEP] included: skip those)
        seps = ((ids[:n] == t.sep) & (labels[:n] == -100)).nonzero().flatten().tolist()
        assert ids[0] == t.cls and len(seps) == 2 and seps[1] == n - 1
        # segment A through its [SEP] is 0, segment B through the last [SEP] is 1, padding 0
        assert not types[:seps[0] + 1].any() and types[seps[0] + 1:n].all()
        assert not types[n:].any() and (ids[n:] == t.hf_pad).all()
        is_masked = labels != -100
        assert not is_masked[n:].any() and not is_masked[[0, *seps]].any()
        assert all(int(x) not in (t.cls, t.sep, t.mask, t.hf_pad) for x in labels[is_masked])
        masked += int(is_masked.sum())
        mask_token += int((ids[is_masked] == t.mask).sum())
        real += n - 3
        nsp.append(int(s["next_sentence_label"]))
    assert 0.12 < masked / real < 0.18            # 15 % of the word pieces
    assert 0.7 < mask_token / masked < 0.9         # 80 % of them shown as [MASK]
    assert 0.35 < np.mean(nsp) < 0.65 and set(nsp) == {0, 1}  # both kinds of pairs
    # random replacement tokens are drawn by position in inv_vocab: it must not depend on the
    # process (a Rust tokenizer's vocab comes in hash order)
    assert list(t.inv_vocab) == sorted(t.inv_vocab)
    # deterministic: the same seed gives the same samples (from the index cache)
    again, _, _ = build_bert_datasets(pretraining_data["bert"], t, "980,20", [400, 40, 0], 64,
                                      0.15, 0.1, seed=5, path_to_cache=tmp_path)
    for i in (0, 17, 399):
        assert all(torch.equal(train[i][k], again[i][k]) for k in train[i])


def test_bert_needs_sentence_level_data(pretraining_data, bert_tokenizer, tmp_path):
    from rapidformer.data.preprocess_data import main as preprocess

    preprocess(["--input", str(pretraining_data["dir"] / "corpus.json"), "--output-prefix",
                str(tmp_path / "docs"), "--vocab-file", str(pretraining_data["vocab"]),
                "--tokenizer-type", "BertWordPieceLowerCase"])
    with pytest.raises(InputError, match="--split-sentences"):
        build_bert_datasets(str(tmp_path / "docs_text_document"), bert_tokenizer, "98,2",
                            [100, 10, 0], 64, 0.15, 0.1, 1, path_to_cache=tmp_path)


# --- BERT data made with Megatron-LM's [BOS]/[EOS] ---------------------------------------------
@pytest.fixture(scope="module")
def megatron_bert(pretraining_data, tmp_path_factory) -> str:
    """Sentence-level BERT data whose documents end with Megatron-LM's [EOS] (id V + 1 of a
    V-line vocab.txt), as its tools/preprocess_data.py --append-eod writes it
    (tests/test_preprocess.py checks the bytes against Megatron's)."""
    from rapidformer.data.preprocess_data import main as preprocess

    out = tmp_path_factory.mktemp("megatron_bert")
    preprocess(["--input", str(pretraining_data["dir"] / "corpus.json"), "--output-prefix",
                str(out / "bert"), "--vocab-file", str(pretraining_data["vocab"]),
                "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences",
                "--append-eod"])
    return str(out / "bert_text_sentence")


def _model_config(data: dict):
    from rapidformer.config.schema import ModelConfig

    return ModelConfig(tokenizer_type="BertWordPieceLowerCase", tokenizer=str(data["vocab"]))


def test_the_tokenizer_follows_the_data_s_end_of_document(pretraining_data, megatron_bert,
                                                          tmp_path):
    from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer

    size = len(pretraining_data["vocab"].read_text().split())
    m = _model_config(pretraining_data)
    # the earlier files (no end of document, or [SEP]) keep the vocab.txt's entries
    plain = load_pretraining_tokenizer(m, pretraining_data["bert"])
    assert (plain.vocab_size, plain.eod, plain.added) == (size, plain.sep, ())
    assert load_pretraining_tokenizer(m) is plain
    # Megatron's: [BOS] and [EOS] after them, [EOS] the end of document; a blend with both too
    for path in (megatron_bert, f"1 {pretraining_data['bert']} 1 {megatron_bert}"):
        wide = load_pretraining_tokenizer(m, path)
        assert (wide.vocab_size, wide.eod, wide.added) == (size + 2, size + 1,
                                                           ("[BOS]", "[EOS]"))
        assert wide.inv_vocab[size] == "[BOS]" and wide.inv_vocab[size + 1] == "[EOS]"
        assert len(wide.hf) == size + 2 and wide.hf.eos_token_id == size + 1
        # the text's tokens are the vocab.txt's either way
        assert wide.tokenize("the doctor bought a car") == plain.tokenize("the doctor bought a car")
    # the vocabulary check still stops data past Megatron's two entries
    with pytest.raises(InputError, match=f"holds token id {size + 1}, but the tokenizer has "
                                         f"only {size + 1} entries"):
        open_indexed(megatron_bert, size + 1)
    # a pretrained BERT's embeddings end at its vocab.txt: such data cannot train it
    from transformers import BertConfig

    from rapidformer.tasks.pretraining import check_pretrained_vocabulary

    BertConfig(vocab_size=size, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
               intermediate_size=8).save_pretrained(tmp_path / "pretrained")
    pretrained = dataclasses.replace(m, source="pretrained",
                                     name_or_path=str(tmp_path / "pretrained"))
    with pytest.raises(InputError, match=f"has {size} embeddings, but data.path ends documents "
                                         f"with Megatron's \\[EOS\\].*--bert-eod sep"):
        check_pretrained_vocabulary(pretrained, wide)
    train, _, _ = build_bert_datasets(megatron_bert, wide, "98,2", [64, 8, 0], 64, 0.15, 0.1, 1,
                                      path_to_cache=tmp_path)
    assert len(train) >= 64 and int(train[0]["input_ids"].max()) < size + 2
    # the id V + 1 inside a document, or V anywhere, is no Megatron end of document but another
    # vocabulary's token
    from rapidformer.data.indexed_writer import IndexedWriter

    for name, tokens in (("inside", [5, size + 1, 6]), ("bos", [5, 6, size])):
        writer = IndexedWriter(str(tmp_path / f"{name}.bin"), size)
        writer.add(np.array(tokens, np.int32), np.array([3], np.int32), np.array([1], np.int32))
        writer.finalize(str(tmp_path / f"{name}.idx"))
        assert load_pretraining_tokenizer(m, str(tmp_path / name)) is plain
        with pytest.raises(InputError, match="made with another vocabulary"):
            open_indexed(str(tmp_path / name), plain.vocab_size)


def test_megatron_convention_bert_data_trains_and_exports(tmp_path, pretraining_data,
                                                          megatron_bert):
    """Two steps of a tiny BERT, in this process, on data ending documents with [EOS]: the
    embeddings cover it, the export's tokenizer has it, and resuming the checkpoint of a run on
    the earlier data (V embeddings) is refused with the reason, not loaded into the wrong shape."""
    from transformers import AutoTokenizer, BertConfig

    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.engine import RapidformerEngine
    from rapidformer.tasks.pretraining import BertPretrainer

    size = len(pretraining_data["vocab"].read_text().split())

    def train(run, data, *extra):
        overrides = ["+recipe=bert_pretrain", "model=bert_tiny", "model.num_layers=1",
                     f"data.path={data}", f"model.tokenizer={pretraining_data['vocab']}",
                     "data.max_seq_length=32", "data.num_workers=0", "trainer.device=cpu",
                     "trainer.micro_batch_size=4", "trainer.global_batch_size=4",
                     "trainer.eval_iters=1", "trainer.progress_bar=false",
                     "trainer.tensorboard=false", "trainer.log_interval=1",
                     f"trainer.output_dir={run}", *extra]
        _, cfg = settle(compose(overrides), str(run))
        return BertPretrainer(engine=RapidformerEngine(cfg, run)).train()

    run = tmp_path / "megatron"
    assert train(run, megatron_bert, "trainer.train_iters=2").step == 2
    assert BertConfig.from_pretrained(run / "hf_model").vocab_size == size + 2
    exported = AutoTokenizer.from_pretrained(run / "hf_model")
    assert len(exported) == size + 2 and exported.convert_tokens_to_ids("[EOS]") == size + 1
    earlier = tmp_path / "earlier"
    train(earlier, pretraining_data["bert"], "trainer.train_iters=2", "trainer.export_hf=false")
    with pytest.raises(InputError, match="holds a model of .* parameters, this run builds"):
        train(earlier, megatron_bert, "trainer.train_iters=4", "trainer.resume=auto")


# --- GPT samples -------------------------------------------------------------------------------
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_gpt_samples_are_shifted_and_honour_eod(pretraining_data, gpt_tokenizer, tmp_path,
                                                eod_mask_loss):
    train, _, _ = build_gpt_datasets(pretraining_data["gpt"], gpt_tokenizer, "98,2",
                                     [200, 20, 0], seq_length=48, seed=2,
                                     eod_mask_loss=eod_mask_loss, path_to_cache=tmp_path)
    eod, seen_eod = gpt_tokenizer.eod, 0
    for i in range(100):
        s = train[i]
        text, ids, labels = s["text"], s["input_ids"], s["labels"]
        assert text.shape == (49,) and ids.shape == labels.shape == (48,)
        assert torch.equal(ids, text[:-1])
        assert torch.equal(s["position_ids"], torch.arange(48))
        at_eod = ids == eod
        seen_eod += int(at_eod.sum())
        if eod_mask_loss:  # no loss for the token after an end of document
            assert torch.equal(labels == -100, at_eod)
            assert torch.equal(labels[~at_eod], text[1:][~at_eod])
        else:
            assert torch.equal(labels, text[1:])
    assert seen_eod > 0  # documents are packed across EOD tokens


# --- bad files ---------------------------------------------------------------------------------
def _copy(prefix: str, to) -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, str(to) + ext)
    return str(to)


def test_missing_corrupt_and_truncated_files(pretraining_data, tmp_path):
    with pytest.raises(InputError, match="does not exist; give the prefix"):
        open_indexed(str(tmp_path / "nothing"))
    with pytest.raises(InputError, match="drop the '.bin'"):
        open_indexed(pretraining_data["gpt"] + ".bin")

    bad_header = _copy(pretraining_data["gpt"], tmp_path / "header")
    with open(bad_header + ".idx", "r+b") as f:
        f.write(b"NOTMEGAT")
    with pytest.raises(InputError, match="not a Megatron mmap index"):
        open_indexed(bad_header)

    cut_idx = _copy(pretraining_data["gpt"], tmp_path / "cut_idx")
    with open(cut_idx + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(InputError, match=r"cut_idx.idx is truncated or overwritten: 40 bytes, its "
                       r"header counts \d+ sequences"):
        open_indexed(cut_idx)

    cut_bin = _copy(pretraining_data["gpt"], tmp_path / "cut_bin")
    size = (tmp_path / "cut_bin.bin").stat().st_size
    with open(cut_bin + ".bin", "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(InputError, match=f"truncated: {size - 10} bytes, its index describes "
                                         f"{size}"):
        open_indexed(cut_bin)


def test_data_made_with_another_vocabulary(pretraining_data, bert_tokenizer, tmp_path):
    # GPT-2 ids run past the 300-entry WordPiece vocabulary
    with pytest.raises(InputError, match="made with another vocabulary"):
        build_gpt_datasets(pretraining_data["gpt"], bert_tokenizer, "98,2", [10, 0, 0], 32, 1,
                           path_to_cache=tmp_path)


# --- order of samples --------------------------------------------------------------------------
def test_pretraining_sampler_layout_and_resume():
    def batches(consumed, rank, count):
        it = iter(PretrainingBatchSampler(20, consumed, 2, rank, 2))
        return [next(it) for _ in range(count)]

    assert batches(0, 0, 3) == [[0, 1], [4, 5], [8, 9]]
    assert batches(0, 1, 3) == [[2, 3], [6, 7], [10, 11]]
    # resuming at a data position continues exactly where an uninterrupted run would be
    assert batches(8, 0, 2) == batches(0, 0, 4)[2:]
    # 20 samples: 5 rows of micro x dp, then it starts over
    assert batches(0, 0, 6)[5] == [0, 1]


def test_megatron_sample_counts():
    # Megatron: train iters x global batch; (iters // eval interval + 1) evaluations of eval_iters
    # batches; eval_iters batches of test
    assert train_valid_test_num_samples(100, 10, 5, 8) == [800, 11 * 5 * 8, 40]
    assert train_valid_test_num_samples(100, None, 5, 8) == [800, 2 * 5 * 8, 40]


# --- mpu ---------------------------------------------------------------------------------------
def test_broadcast_data_with_data_parallelism_only():
    from rapidformer import mpu

    batch = {"text": torch.arange(6).reshape(2, 3), "other": torch.zeros(1)}
    out = mpu.broadcast_data(["text"], batch, torch.int64)
    assert list(out) == ["text"] and torch.equal(out["text"].cpu(), batch["text"])
    with pytest.raises(InputError, match="'text' is torch.int64, expected torch.float32"):
        mpu.broadcast_data(["text"], batch, torch.float32)
    with pytest.raises(InputError, match="no key 'labels'"):
        mpu.broadcast_data(["labels"], batch, torch.int64)
