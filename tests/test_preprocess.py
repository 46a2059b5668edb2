"""preprocess_data: JSON lines -> Megatron's .bin/.idx, read back through megatron-core."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from rapidformer.data.preprocess_data import main as preprocess_main
from tests.conftest import run_cli

TEXTS = ["The doctor bought a car. It was red!", "A teacher found the boat near the river.",
         "Police cleaned the shop. The kid lost a bag? Yes."]


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return path


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory):
    from rapidformer.data.tokenizers import train_wordpiece

    out = tmp_path_factory.mktemp("bert_vocab")
    train_wordpiece(TEXTS * 3, out, vocab_size=200, lowercase=True, max_length=64)
    return out / "vocab.txt"


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 3, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out))
    return out / "vocab.json", out / "merges.txt"


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def test_gpt2_round_trip_and_eod(tmp_path, corpus, gpt2_files):
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "gpt_small"),
                     "--vocab", str(vocab), "--merge-file", str(merges), "--dataset-impl", "mmap",
                     "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "2"])
    tokenizer = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
    eod = tokenizer.get_vocab()["<|endoftext|>"]
    dataset = _read(tmp_path / "gpt_small_text_document")
    assert len(dataset) == 3 and list(dataset.document_indices) == [0, 1, 2, 3]
    for i, text in enumerate(TEXTS):
        assert dataset[i].tolist() == tokenizer.encode(text, add_special_tokens=False) + [eod]
    assert not list(tmp_path.glob(".tmp-*"))


def test_sentence_level_bert_and_the_idx_layout(tmp_path, corpus, bert_vocab):
    from transformers import BertTokenizer

    preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "bert"),
                     "--vocab-file", str(bert_vocab), "--tokenizer-type",
                     "BertWordPieceLowerCase", "--split-sentences"])
    prefix = tmp_path / "bert_text_sentence"
    tokenizer = BertTokenizer(vocab=str(bert_vocab), do_lower_case=True)
    sentences = ["The doctor bought a car.", "It was red!",
                 "A teacher found the boat near the river.",
                 "Police cleaned the shop.", "The kid lost a bag?", "Yes."]
    expected = [tokenizer.encode(s, add_special_tokens=False) for s in sentences]
    dataset = _read(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert list(dataset.document_indices) == [0, 2, 3, 6]

    # Megatron's .idx layout, byte by byte: magic, version, dtype code, counts, then arrays
    raw = (tmp_path / "bert_text_sentence.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack("<Q", raw[9:17])
    dtype_code, = struct.unpack("<B", raw[17:18])
    n_sequences, n_documents = struct.unpack("<QQ", raw[18:34])
    assert (version, dtype_code, n_sequences, n_documents) == (1, 8, 6, 4)  # 8 = uint16
    offset = 34
    lengths = np.frombuffer(raw, np.int32, n_sequences, offset)
    offset += 4 * n_sequences
    pointers = np.frombuffer(raw, np.int64, n_sequences, offset)
    offset += 8 * n_sequences
    documents = np.frombuffer(raw, np.int64, n_documents, offset)
    assert offset + 8 * n_documents == len(raw)
    assert lengths.tolist() == [len(e) for e in expected]
    assert pointers.tolist() == (np.cumsum([0] + [2 * len(e) for e in expected[:-1]])).tolist()
    assert documents.tolist() == [0, 2, 3, 6]
    assert (tmp_path / "bert_text_sentence.bin").stat().st_size == 2 * sum(map(len, expected))


def test_malformed_line_fails_or_is_skipped(tmp_path, corpus, bert_vocab, capsys):
    corpus.write_text(corpus.read_text() + "{not json\n" + json.dumps({"body": "x"}) + "\n")
    args = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--vocab-file",
            str(bert_vocab), "--tokenizer-type", "BertWordPieceCase"]
    with pytest.raises(SystemExit) as info:
        preprocess_main(args)
    assert info.value.code == 2
    assert "line 4:" in capsys.readouterr().err
    assert not list(tmp_path.glob("out_*")) and not list(tmp_path.glob(".tmp-*"))
    preprocess_main([*args, "--on-error", "skip"])
    err = capsys.readouterr().err
    assert "line 5: no key 'text'" in err and "2 malformed lines skipped" in err
    assert len(_read(tmp_path / "out_text_document")) == 3


@pytest.mark.parametrize("setup,extra,message", [
    (lambda p: p.write_text("\n\n"), [], "holds no documents"),
    (lambda p: None, ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"],
     "needs --merge-file"),
])
def test_empty_corpus_and_missing_files(tmp_path, corpus, bert_vocab, setup, extra, message,
                                        capsys):
    setup(corpus)
    args = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--vocab-file",
            str(bert_vocab), "--tokenizer-type", "BertWordPieceLowerCase", *extra]
    with pytest.raises(SystemExit):
        preprocess_main(args)
    assert message in capsys.readouterr().err


def test_vocab_that_does_not_match_the_tokenizer_type(tmp_path, corpus, gpt2_files, capsys):
    vocab, _ = gpt2_files
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                         "--vocab-file", str(vocab), "--tokenizer-type", "BertWordPieceLowerCase"])
    assert "is a JSON vocabulary (GPT-2 style), not a WordPiece vocab.txt" in capsys.readouterr().err


def test_module_command_line_and_dataset_impl(tmp_path, corpus, bert_vocab):
    result = run_cli(["--input", str(corpus), "--output-prefix", str(tmp_path / "x"),
                      "--vocab-file", str(bert_vocab), "--tokenizer-type", "BertWordPieceCase",
                      "--dataset-impl", "lazy"], cwd=tmp_path, module="rapidformer.data.preprocess_data")
    assert result.returncode == 2
    assert "megatron-core writes and reads only mmap" in " ".join(result.stderr.split())
    ok = run_cli(["--input", str(corpus), "--output-prefix", str(tmp_path / "x"),
                  "--vocab-file", str(bert_vocab), "--tokenizer-type", "BertWordPieceCase"],
                 cwd=tmp_path, module="rapidformer.data.preprocess_data")
    assert ok.returncode == 0 and "docs/s" in ok.stderr and "MB/s" in ok.stderr
