"""preprocess_data: JSON lines -> Megatron's .bin/.idx, read back through megatron-core."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rapidformer.data.preprocess_data import main as preprocess_main
from tests.conftest import OFFLINE_ENV, run_cli

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
    assert f"{corpus} line 4, column 2: not valid JSON" in capsys.readouterr().err
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


# --- tokenizer files that cannot be used -------------------------------------------------------

def _fails(args: list[str], capsys) -> str:
    """The one message of a run that must stop with exit code 2 (an InputError, no traceback)."""
    with pytest.raises(SystemExit) as info:
        preprocess_main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    return " ".join(err.split())


def _gpt2_args(corpus, out, vocab, merges) -> list[str]:
    return ["--input", str(corpus), "--output-prefix", str(out), "--vocab-file", str(vocab),
            "--merge-file", str(merges), "--tokenizer-type", "GPT2BPETokenizer"]


def test_merges_of_another_vocabulary(tmp_path, corpus, gpt2_files, capsys):
    from tokenizers import ByteLevelBPETokenizer

    other = ByteLevelBPETokenizer()
    other.train_from_iterator(["zzzz qqqq xxxx"] * 3, vocab_size=270, min_frequency=1,
                              show_progress=False)
    other.save_model(str(tmp_path))
    vocab, _ = gpt2_files
    message = _fails(_gpt2_args(corpus, tmp_path / "o", vocab, tmp_path / "merges.txt"), capsys)
    assert f"{tmp_path / 'merges.txt'} (--merge-file) does not match {vocab} (--vocab-file): " \
           f"line 2," in message
    assert "pass the merges.txt saved together with this vocab.json" in message
    assert not list(tmp_path.glob("o_*")) and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("kind,content,fragment", [
    ("merges", b"\xff\xfe binary\n", "(--merge-file) is not UTF-8 text: line 1, byte column 1 "
                                     "is 0xff"),
    ("merges", b'{"a": 0}', "(--merge-file) is JSON, not a GPT-2 merges.txt: were --vocab-file "
                            "and --merge-file swapped?"),
    ("merges", "#version: 0.2\nĠ t h\n".encode(), "(--merge-file), line 2: 'Ġ t h' is not two "
                                                  "tokens separated by one space"),
    ("vocab", b'["a", "b"]', "(--vocab-file) is JSON but not a GPT-2 vocabulary: it is an array"),
    ("vocab", b'{"<|endoftext|>": "0"}', "(--vocab-file), key '<|endoftext|>': its id is a "
                                         "string, expected an integer"),
    ("vocab", b'{"<|endoftext|>": 0, ', "its JSON breaks at line 1, column 22"),
])
def test_unusable_gpt2_files(tmp_path, corpus, gpt2_files, kind, content, fragment, capsys):
    vocab, merges = gpt2_files
    bad = tmp_path / f"bad_{kind}"
    bad.write_bytes(content)
    files = (vocab, bad) if kind == "merges" else (bad, merges)
    message = _fails(_gpt2_args(corpus, tmp_path / "o", *files), capsys)
    assert message.startswith(f"rapidformer-preprocess-data: error: {bad}") and fragment in message


def test_unusable_wordpiece_vocab_and_tokenizer_directory(tmp_path, corpus, capsys):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("hello\nworld\n[UNK]\n")
    message = _fails(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                      "--vocab-file", str(vocab), "--tokenizer-type", "BertWordPieceCase"], capsys)
    assert f"{vocab} (--vocab-file) has no [CLS] [SEP] [PAD] [MASK]" in message
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{broken")
    message = _fails(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-model", str(directory), "--tokenizer-type",
                      "HuggingFaceTokenizer"], capsys)
    assert f"{directory} (--tokenizer-model) does not load as a Hugging Face tokenizer" in message


# --- input lines: UTF-8, JSON, the type of `text` -------------------------------------------------

def test_non_utf8_byte_is_named_at_its_line_and_column(tmp_path, bert_vocab, capsys):
    path = tmp_path / "latin1.json"
    # a long first line: the old message gave the byte's offset in an 8 KiB read buffer
    path.write_bytes((json.dumps({"text": "a " * 5000}) + "\n").encode()
                     + b'{"text": "ok"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    args = ["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--vocab-file",
            str(bert_vocab), "--tokenizer-type", "BertWordPieceLowerCase"]
    message = _fails(args, capsys)
    assert f"{path} line 3, byte column 14: byte 0xe9 is not valid UTF-8" in message
    assert "re-encode the file as UTF-8" in message
    preprocess_main([*args, "--on-error", "skip"])
    assert "skipping" in capsys.readouterr().err
    assert len(_read(tmp_path / "o_text_document").document_indices) - 1 == 2


@pytest.mark.parametrize("value,fragment", [
    (5, "line 2, key 'text': a number (5), expected a string or a list of strings"),
    ({"a": "b"}, "line 2, key 'text': an object, expected a string"),
    (None, "line 2, key 'text': null, expected a string"),
    (True, "line 2, key 'text': true (a boolean), expected a string"),
    (["fine.", 3], "line 2, key 'text', item 1: a number (3), expected a string (a sentence)"),
])
def test_text_that_is_not_a_string(tmp_path, bert_vocab, value, fragment, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    message = _fails(["--input", str(path), "--output-prefix", str(tmp_path / "o"),
                      "--vocab-file", str(bert_vocab), "--tokenizer-type",
                      "BertWordPieceLowerCase"], capsys)
    assert f"{path} {fragment}" in message


# --- documents numbered as Megatron numbers them ---------------------------------------------

MIXED = ["The doctor bought a car.", ["It was red!", "A teacher found the boat."], "", [],
         ["", "Police cleaned the shop."], "The kid lost a bag? Yes."]


def _megatron_reference(prefix: Path, texts, vocab, merges) -> None:
    """What Megatron-LM's tools/preprocess_data.py writes (megatron-core builder, no
    --split-sentences, --append-eod): a list is the document's sentences, each tokenized
    alone; sentences without tokens are left out; the EOD goes on the last sentence of a
    document with tokens; every document is added, an empty one too."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from transformers import GPT2Tokenizer

    tokenizer = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
    eod = tokenizer.get_vocab()["<|endoftext|>"]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(len(tokenizer)))
    for text in texts:
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            tokens = tokenizer.encode(sentence, add_special_tokens=False)
            if tokens:
                ids += tokens
                lengths.append(len(tokens))
        if ids:
            ids.append(eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")


def test_list_and_empty_texts_match_megatron_byte_for_byte(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    path = tmp_path / "mixed.json"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in MIXED))
    preprocess_main([*_gpt2_args(path, tmp_path / "ours", vocab, merges), "--append-eod"])
    _megatron_reference(tmp_path / "megatron", MIXED, vocab, merges)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == \
            (tmp_path / f"megatron{ext}").read_bytes()
    dataset = _read(tmp_path / "ours_text_document")
    # six lines, six documents: the empty ones (lines 3, 4) have no sequence and no EOD, and
    # the lists' sentences are sequences of their own
    assert dataset.document_indices.tolist() == [0, 1, 3, 3, 3, 4, 5]
    assert len(dataset) == 5


def test_a_list_is_the_sentences_of_one_document(tmp_path, corpus, bert_vocab):
    """Megatron's sentence-split form gives the same files as splitting the text here."""
    from rapidformer.data.preprocess_encode import split_sentences

    split = tmp_path / "split.json"
    split.write_text("".join(json.dumps({"text": split_sentences(t)}) + "\n" for t in TEXTS))
    common = ["--vocab-file", str(bert_vocab), "--tokenizer-type", "BertWordPieceLowerCase",
              "--split-sentences"]
    preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "a"), *common])
    preprocess_main(["--input", str(split), "--output-prefix", str(tmp_path / "b"), *common])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_sentence{ext}").read_bytes() == \
            (tmp_path / f"b_text_sentence{ext}").read_bytes()
    assert _read(tmp_path / "b_text_sentence").document_indices.tolist() == [0, 2, 3, 6]


def _megatron_core_bert_tokenizer(vocab: Path, where: Path, monkeypatch):
    """megatron-core's own BertWordPieceLowerCase tokenizer, as Megatron-LM's
    tools/preprocess_data.py builds it by default: MegatronHFTokenizer loads Hugging Face's
    'bert-large-uncased' with our vocab.txt, which Hugging Face reads from a local directory of
    that name in the working directory before the hub (here one with the hub's settings)."""
    from megatron.core.tokenizers import MegatronTokenizer

    local = where / "bert-large-uncased"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (local / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True,
                                                             "model_max_length": 512}))
    (local / "vocab.txt").write_bytes(vocab.read_bytes())
    monkeypatch.chdir(where)
    return MegatronTokenizer.from_pretrained(
        tokenizer_path="BertWordPieceLowerCase", metadata_path={"library": "megatron"},
        vocab_file=str(vocab), merges_file=None, additional_special_tokens=[], use_fast=False,
        trust_remote_code=False, include_special_tokens=False)


@pytest.mark.parametrize("convention", ["eos", "sep"])
def test_bert_end_of_document_is_megatrons(tmp_path, bert_vocab, monkeypatch, convention):
    """--append-eod with a WordPiece vocab.txt of V entries writes what Megatron-LM's
    tools/preprocess_data.py writes, byte for byte. eos (the default): its BERT tokenizer
    (`_BertWordPieceTokenizer`, Megatron-LM up to core 0.14 and with --legacy-tokenizer in
    0.15-0.16) adds [BOS] and [EOS] as ids V and V + 1, its eod is [EOS], its vocab_size V + 2
    (which sets the dtype). sep: its newer tokenizer system (megatron-core's MegatronTokenizer,
    built here) ends documents with [SEP], its eos, in a vocabulary of V."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    megatron = _megatron_core_bert_tokenizer(bert_vocab, tmp_path, monkeypatch)
    words = [w.strip() for w in bert_vocab.read_text().splitlines()]
    size = len(words)
    if convention == "eos":
        # _BertWordPieceTokenizer.add_token: the next id, len(vocab), for each token it lacks
        eod, vocab_size = size + 1, size + 2
        assert "[BOS]" not in words and "[EOS]" not in words
    else:
        eod, vocab_size = megatron.eod, megatron.vocab_size
        assert (eod, vocab_size) == (words.index("[SEP]"), size)
    path = tmp_path / "mixed.json"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in MIXED))
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"),
                                    dtype=DType.optimal_dtype(vocab_size))
    for text in MIXED:  # Megatron's Encoder.encode, without --split-sentences
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            tokens = megatron.tokenize(sentence)
            if tokens:
                ids, lengths = ids + tokens, lengths + [len(tokens)]
        if ids:
            ids, lengths[-1] = ids + [eod], lengths[-1] + 1
        builder.add_document(ids, lengths)
    builder.finalize(str(tmp_path / "megatron.idx"))
    option = ["--bert-eod", "sep"] if convention == "sep" else []
    preprocess_main(["--input", str(path), "--output-prefix", str(tmp_path / "ours"),
                     "--vocab-file", str(bert_vocab), "--tokenizer-type",
                     "BertWordPieceLowerCase", "--append-eod", *option])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == \
            (tmp_path / f"megatron{ext}").read_bytes()
    dataset = _read(tmp_path / "ours_text_document")
    assert dataset[0].tolist()[-1] == eod  # the first document's end


def test_bert_eod_is_for_wordpiece_only(tmp_path, corpus, gpt2_files, capsys):
    vocab, merges = gpt2_files
    with pytest.raises(SystemExit) as info:
        preprocess_main([*_gpt2_args(corpus, tmp_path / "o", vocab, merges), "--bert-eod", "sep"])
    assert info.value.code == 2
    assert "--bert-eod is for the BertWordPiece tokenizer types" in capsys.readouterr().err


def test_a_corpus_of_empty_texts_is_refused(tmp_path, bert_vocab, capsys):
    path = tmp_path / "empty.json"
    path.write_text('{"text": ""}\n{"text": []}\n')
    message = _fails(["--input", str(path), "--output-prefix", str(tmp_path / "o"),
                      "--vocab-file", str(bert_vocab), "--tokenizer-type", "BertWordPieceCase"],
                     capsys)
    assert "every one of its 2 documents has an empty 'text' (no tokens)" in message


# --- SIGTERM / SIGINT and stale temporary files ----------------------------------------------

def _big_corpus(tmp_path: Path, lines: int = 20000) -> Path:
    """Large enough that preprocessing is still running when the signal comes."""
    path = tmp_path / "big.json"
    words = " ".join(TEXTS).split()
    path.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % len(words)]
                                                         for j in range(60))}) + "\n"
                            for i in range(lines)))
    return path


def _writing(tmp_path: Path) -> bool:
    """A temporary .bin with documents in it: the run is mid-way."""
    for path in tmp_path.glob(".tmp-*.bin"):
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
    return False


def _bin_size(tmp_path: Path) -> int:
    sizes = []
    for path in tmp_path.glob(".tmp-*.bin"):
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            pass
    return max(sizes, default=0)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.serial  # signals a subprocess at a moment: run alone
def test_sigterm_mid_way_removes_the_temporary_files(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    command = [sys.executable, "-m", "rapidformer.data.preprocess_data",
               *_gpt2_args(_big_corpus(tmp_path), tmp_path / "out", vocab, merges),
               "--append-eod", "--workers", "2"]
    process = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, **OFFLINE_ENV},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not _writing(tmp_path) and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[1][-3000:]
        workers = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    message = " ".join(err.split())
    assert "rapidformer-preprocess-data: stopped by SIGTERM after" in message
    assert f"removed its temporary files .tmp-out_text_document-{process.pid}.bin/.idx and " \
           f"wrote nothing to {tmp_path / 'out_text_document'}.bin/.idx" in message
    assert "Traceback" not in err
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob("out_*"))
    if Path("/proc").is_dir():
        time.sleep(0.5)
        assert workers and not [pid for pid in workers if _alive(pid)]


def test_sigint_in_process_cleans_up_and_restores_the_handler(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    args = _gpt2_args(_big_corpus(tmp_path), tmp_path / "out", vocab, merges)

    def interrupt():
        # the .bin grows at each batch after the count of the one before was taken: a size
        # past the first one seen means documents were counted (a loaded machine let the
        # signal land between the first batch's write and its count)
        deadline = time.time() + 120
        while not _writing(tmp_path) and time.time() < deadline:
            time.sleep(0.01)
        first = _bin_size(tmp_path)
        while _bin_size(tmp_path) <= first and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    def ignore(signum, frame):  # a late SIGINT must not stop pytest
        pass

    previous = signal.signal(signal.SIGINT, ignore)
    thread = threading.Thread(target=interrupt, daemon=True)
    try:
        thread.start()
        with pytest.raises(SystemExit) as info:
            preprocess_main(args)
        thread.join()
        assert signal.getsignal(signal.SIGINT) is ignore
    finally:
        signal.signal(signal.SIGINT, previous)
    assert info.value.code == 128 + signal.SIGINT
    assert "stopped by SIGINT after" in capsys.readouterr().err
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob("out_*"))


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path, corpus, bert_vocab, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()
    files = {name: tmp_path / name for name in (
        f".tmp-o_text_document-{dead.pid}.bin", f".tmp-o_text_document-{dead.pid}.idx",
        f".tmp-o_text_sentence-{dead.pid}.bin",
        f".tmp-o_text_document-{live}.bin",          # a live writer's: kept
        f".tmp-other_text_document-{dead.pid}.bin",  # another prefix's: kept
    )}
    for path in files.values():
        path.write_bytes(b"x")
    preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                     "--vocab-file", str(bert_vocab), "--tokenizer-type", "BertWordPieceCase"])
    assert "removed 3 temporary files of earlier runs" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == sorted(
        [f".tmp-o_text_document-{live}.bin", f".tmp-other_text_document-{dead.pid}.bin"])
    assert len(_read(tmp_path / "o_text_document")) == 3


# --- chunks and workers --------------------------------------------------------------------------

def test_chunks_and_workers_write_the_same_bytes_and_skip_the_same_lines(tmp_path, gpt2_files,
                                                                         capsys):
    from rapidformer.data.preprocess_encode import CHUNK_LINES

    vocab, merges = gpt2_files
    lines = [json.dumps({"text": MIXED[i % len(MIXED)]}) for i in range(2 * CHUNK_LINES + 7)]
    lines[CHUNK_LINES - 1] = "{not json"  # the last line of the first chunk
    lines[CHUNK_LINES + 3] = json.dumps({"txt": "no text key"})
    path = tmp_path / "many.json"
    path.write_text("\n".join(lines) + "\n")
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess_main([*_gpt2_args(path, prefix, vocab, merges), "--append-eod",
                         "--on-error", "skip", "--workers", str(workers)])
        outputs[workers] = [Path(f"{prefix}_text_document{e}").read_bytes() for e in (".bin", ".idx")]
        err = capsys.readouterr().err
        assert err.index(f"line {CHUNK_LINES}") < err.index(f"line {CHUNK_LINES + 4}")
        assert "2 malformed lines skipped" in err
    assert outputs[1] == outputs[2]
    dataset = _read(tmp_path / "w2_text_document")
    assert len(dataset.document_indices) - 1 == len(lines) - 2


def test_a_worker_imports_neither_torch_nor_transformers(tmp_path, gpt2_files):
    """The worker's tokenizer is the main process's Rust tokenizer, sent serialized."""
    import pickle

    from rapidformer.data.preprocess_data import parse_args
    from rapidformer.data.preprocess_encode import Encoder
    from rapidformer.data.preprocess_tokenizers import build_tokenizer

    vocab, merges = gpt2_files
    source = tmp_path / "in.json"
    source.write_text('{"text": "The kid."}\n')
    args = parse_args(_gpt2_args(source, tmp_path / "out", vocab, merges) + ["--append-eod"])
    tokenizer, eod, _ = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, None)
    pickled = tmp_path / "encoder.pkl"
    pickled.write_bytes(pickle.dumps(Encoder(args, tokenizer, eod)))
    probe = ("import pickle, sys\n"
             "from rapidformer.data.preprocess_encode import _encode_range_in_worker, "
             "_start_worker\n"
             f"_start_worker(pickle.loads(open({str(pickled)!r}, 'rb').read()))\n"
             f"errors, nbytes, docs, arrays, _ = _encode_range_in_worker((0, "
             f"{source.stat().st_size}))\n"
             "print(arrays['text'][0].tolist(), 'torch' in sys.modules, "
             "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, **OFFLINE_ENV}, timeout=120)
    assert out.returncode == 0, out.stderr
    ids = tokenizer.encode("The kid.", add_special_tokens=False) + [eod]
    assert out.stdout.strip() == f"{ids} False False"


def test_byte_range_tasks_write_the_same_bytes_and_number_lines_alike(tmp_path, gpt2_files,
                                                                       monkeypatch, capsys):
    """Many small byte ranges (a task per few lines): the output and every reported line
    number are those of one range, with blank lines, CRLF and no final newline."""
    import rapidformer.data.preprocess_encode as encode

    vocab, merges = gpt2_files
    lines = [json.dumps({"text": MIXED[i % len(MIXED)]}) for i in range(300)]
    lines[17], lines[101], lines[250] = "{not json", "", "  \r"
    lines[150] = json.dumps({"txt": "no text key"}) + "\r"
    path = tmp_path / "ranges.json"
    path.write_text("\n".join(lines))  # no newline at the end
    outputs, errors = {}, {}
    for workers, task_bytes in ((1, 1 << 30), (1, 200), (3, 200)):
        monkeypatch.setattr(encode, "MIN_TASK_BYTES", task_bytes)
        monkeypatch.setattr(encode, "MAX_TASK_BYTES", max(task_bytes, 1 << 20))
        prefix = tmp_path / f"w{workers}_{task_bytes}"
        preprocess_main([*_gpt2_args(path, prefix, vocab, merges), "--append-eod",
                         "--on-error", "skip", "--workers", str(workers)])
        outputs[workers, task_bytes] = [Path(f"{prefix}_text_document{e}").read_bytes()
                                        for e in (".bin", ".idx")]
        errors[workers, task_bytes] = [line for line in capsys.readouterr().err.splitlines()
                                       if line.startswith("skipping")]
    assert len(set(map(tuple, outputs.values()))) == 1
    assert len(set(map(tuple, errors.values()))) == 1
    assert [e.split(" line ")[1].split(",")[0].split(":")[0] for e in errors[1, 200]] == \
        ["18", "151"]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "BertWordPieceLowerCase",
                                  "BertWordPieceCase"])
def test_the_rust_tokenizer_built_without_transformers_gives_the_same_ids(kind, gpt2_files,
                                                                          bert_vocab):
    from rapidformer.data.preprocess_tokenizers import build_rust_tokenizer, build_tokenizer

    vocab, merges = gpt2_files if kind.startswith("GPT2") else (bert_vocab, None)
    texts = [t for t in TEXTS] + ["<|endoftext|> [SEP] [MASK] Café  naïve\u00a0x\t\n 日本語 🙂",
                                  "", "   "]
    for eod in ("sep", "eos"):
        ours, our_eod, our_size = build_rust_tokenizer(kind, str(vocab), merges and str(merges),
                                                       None, eod)
        theirs, eod_id, size = build_tokenizer(kind, str(vocab), merges and str(merges), None, eod)
        assert (our_eod, our_size) == (eod_id, size)
        assert [e.ids for e in ours.encode_batch(texts, add_special_tokens=False)] == \
            [e.ids for e in theirs.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def test_ids_past_the_vocabularys_entry_count_are_written_as_they_are(tmp_path, gpt2_files,
                                                                      bert_vocab):
    """A vocab.json whose <|endoftext|> id is 70,000 (a few hundred entries) and a vocab.txt
    whose repeated lines put [SEP] past 70,000: the output holds int32 ids, the ids
    themselves (uint16 outputs wrapped them to id - 65,536)."""
    vocab, merges = gpt2_files
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    entries = json.loads(vocab.read_text())
    entries["<|endoftext|>"] = 70000
    (sparse / "vocab.json").write_text(json.dumps(entries))
    source = tmp_path / "in.json"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    preprocess_main([*_gpt2_args(source, tmp_path / "gpt", sparse / "vocab.json", merges),
                     "--append-eod"])
    gpt = _read(tmp_path / "gpt_text_document")
    assert gpt[0].dtype == np.int32 and [int(gpt[i][-1]) for i in range(3)] == [70000] * 3

    repeated = tmp_path / "vocab.txt"
    repeated.write_text(bert_vocab.read_text() + "zzz\n" * 70000 + "[SEP]\n")
    preprocess_main(["--input", str(source), "--output-prefix", str(tmp_path / "bert"),
                     "--vocab-file", str(repeated), "--tokenizer-type", "BertWordPieceLowerCase",
                     "--append-eod", "--bert-eod", "sep"])
    bert = _read(tmp_path / "bert_text_document")
    from tokenizers import Tokenizer, models

    sep = Tokenizer(models.WordPiece.from_file(str(repeated))).token_to_id("[SEP]")
    assert sep > 65535 and bert[0].dtype == np.int32 and int(bert[0][-1]) == sep


def test_a_half_surrogate_pair_is_a_bad_line(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    source = tmp_path / "in.json"
    source.write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n{"text": ["ok", "x\\udfff"]}\n')
    args = _gpt2_args(source, tmp_path / "out", vocab, merges)
    with pytest.raises(SystemExit) as info:
        preprocess_main(args)
    assert info.value.code == 2
    assert (f"{source} line 2, key 'text', character 2: \\ud800 is half of a UTF-16 surrogate "
            f"pair") in capsys.readouterr().err
    assert not list(tmp_path.glob("out_*"))
    preprocess_main([*args, "--on-error", "skip"])
    skipped = [line for line in capsys.readouterr().err.splitlines() if line.startswith("skip")]
    assert [s.split(": ")[0] for s in skipped] == [
        f"skipping {source} line 2, key 'text', character 2",
        f"skipping {source} line 3, key 'text', item 1, character 2"]
    assert len(_read(tmp_path / "out_text_document")) == 1


def test_an_input_that_changes_while_it_is_read_is_an_error(tmp_path, gpt2_files):
    """Each process opens the input once and checks it is the file the run started on: a
    file removed after that is still read; one replaced or written to before, or cut short
    after, is an error naming the input (no other data is read as if it were)."""
    from rapidformer.data.preprocess_data import parse_args
    from rapidformer.data.preprocess_encode import Encoder, file_identity
    from rapidformer.data.preprocess_errors import PreprocessError
    from rapidformer.data.preprocess_tokenizers import build_rust_tokenizer

    vocab, merges = gpt2_files
    source = tmp_path / "in.json"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    size = source.stat().st_size
    args = parse_args(_gpt2_args(source, tmp_path / "out", vocab, merges))
    tokenizer, eod, _ = build_rust_tokenizer(args.tokenizer_type, args.vocab_file,
                                             args.merge_file, None)

    def encoder():
        return Encoder(args, tokenizer, eod, identity=file_identity(source.stat()))

    removed = encoder()
    removed.open_input()
    source.unlink()
    assert removed.encode_range((0, size))[2] == 3  # three documents

    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    replaced = encoder()
    source.write_text(source.read_text() + json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(PreprocessError, match=f"--input {source} was replaced or written to "
                                              f"while the run read it; nothing was written"):
        replaced.open_input()

    shortened = encoder()
    shortened.open_input()
    with open(source, "r+b") as f:
        f.truncate(10)
    with pytest.raises(PreprocessError, match="became shorter while the run read it"):
        shortened.encode_range((0, size))


@pytest.mark.parametrize("workers", [1, 2, 3, 16])
@pytest.mark.parametrize("layout", ["even", "uneven", "long line", "no final newline",
                                    "one line", "empty"])
def test_byte_ranges_start_at_lines_cover_the_input_and_shrink_at_its_end(
        tmp_path, monkeypatch, workers, layout):
    import random

    import rapidformer.data.preprocess_encode as encode

    monkeypatch.setattr(encode, "MIN_TASK_BYTES", 1000)
    monkeypatch.setattr(encode, "MAX_TASK_BYTES", 4000)
    rng = random.Random(workers)
    lines = {"even": [b"x" * 49] * 4000,
             "uneven": [b"y" * rng.choice([0, 3, 40, 400, 2500]) for _ in range(800)],
             "long line": [b"a" * 10] * 300 + [b"b" * 50000] + [b"c" * 20] * 300,
             "no final newline": [b"z" * rng.randint(1, 90) for _ in range(3000)],
             "one line": [b"w" * 7000], "empty": []}[layout]
    data = b"\n".join(lines) + (b"" if layout == "no final newline" or not lines else b"\n")
    path = tmp_path / "in.json"
    path.write_bytes(data)
    ranges = encode.byte_ranges(path, workers)
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]]
    assert (ranges[0][0], ranges[-1][1]) == (0, len(data)) if data else ranges == []
    assert all(data[a - 1:a] == b"\n" for a, _ in ranges[1:])  # no line is cut
    per = encode.task_bytes(len(data), workers)
    if layout == "even":  # lines of 50 bytes: sizes within a line of their target
        sizes = [b - a for a, b in ranges]
        assert max(sizes) <= per + 50
        if workers > 1:  # the end of the input comes in short ranges
            assert sizes[-1] <= max(per // 16, 50) + 50 and sizes[-2] < per // 2
            assert len(ranges) < 3 * len(data) // per
        else:
            assert all(size >= per for size in sizes[:-1])
