"""A synthetic pretraining corpus in synthetic.py's words, so that pretraining needs no download.

    python -m rapidformer.data.corpus corpus.json [--docs 10000 | --mb 100] [--seed 1234] \
        [--doc-tokens 1000 4000] [--wordpiece-vocab DIR] [--gpt2-bpe DIR] [--vocab-size 1000]

writes one JSON object per line, {"id": i, "text": ...}, the input of rapidformer.data.preprocess_data;
with --wordpiece-vocab, DIR/vocab.txt (for BertWordPiece*), with --gpt2-bpe, DIR/vocab.json and
DIR/merges.txt (for GPT2BPETokenizer), trained on the first 2000 documents: the word lists are
closed, so that covers every word of any corpus they make.

A document is 3-12 sentences about one subject, mostly in one place, each object often carried
on from the sentence before: a tiny model can learn both the language and whether two sentences
belong together (next-sentence prediction). With --doc-tokens MIN MAX a document holds sentences
until it has a number of tokens drawn uniformly from [MIN, MAX] (words and punctuation marks,
which is what a WordPiece vocabulary of these words makes of them), e.g. 1000-4000 for the long
documents of books or Wikipedia articles.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
from pathlib import Path
from typing import Iterable, Iterator

from rapidformer.data.synthetic import SLOTS, _realize

ENDINGS, ENDING_WEIGHTS = (".", "!", "?"), (8, 1, 1)
VOCAB_SAMPLE_DOCS = 2000


def count_tokens(text: str) -> int:
    """Words and punctuation marks: the tokens of a WordPiece vocabulary holding the words."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def _document(rng: random.Random, doc_tokens: tuple[int, int] | None = None) -> str:
    subject, place = rng.randrange(len(SLOTS[0])), rng.randrange(len(SLOTS[3]))
    obj = rng.randrange(len(SLOTS[2]))
    sentences = []
    target = rng.randint(*doc_tokens) if doc_tokens else None
    count = rng.randint(3, 12) if target is None else None
    tokens = 0
    for made in itertools.count():
        if made == count or (target is not None and tokens >= target):
            break
        # the subject is the thread of the document; place and object only mostly, so that a
        # sentence taken from another document is told apart by more than a single slot
        if rng.random() < 0.3:
            place = rng.randrange(len(SLOTS[3]))
        if rng.random() < 0.5:
            obj = rng.randrange(len(SLOTS[2]))
        concepts = (subject, rng.randrange(len(SLOTS[1])), obj, place,
                    rng.randrange(len(SLOTS[4])))
        text, _ = _realize(concepts, rng)
        # _realize writes tokenized text ("a , b ."): join the punctuation back as in prose
        text = text[:-2].replace(" ,", ",")
        sentences.append(text[0].upper() + text[1:]
                         + rng.choices(ENDINGS, ENDING_WEIGHTS)[0])
        if target is not None:
            tokens += count_tokens(sentences[-1])
    return " ".join(sentences)


def iter_documents(num_docs: int, seed: int = 1234,
                   doc_tokens: tuple[int, int] | None = None) -> Iterator[str]:
    rng = random.Random(seed)
    return (_document(rng, doc_tokens) for _ in range(num_docs))


def write_corpus(path: str | os.PathLike, num_docs: int | None = None,
                 target_bytes: int | None = None, seed: int = 1234,
                 doc_tokens: tuple[int, int] | None = None) -> dict:
    """Write num_docs documents, or documents until the file holds target_bytes. Atomically:
    a reader never sees half a corpus, and a failed run leaves nothing under `path`."""
    if (num_docs is None) == (target_bytes is None):
        raise ValueError("give exactly one of num_docs and target_bytes")
    if (num_docs if num_docs is not None else target_bytes) <= 0:
        raise ValueError("num_docs and target_bytes must be positive")
    if doc_tokens is not None and not 1 <= doc_tokens[0] <= doc_tokens[1]:
        raise ValueError(f"doc_tokens {doc_tokens}: give 1 <= MIN <= MAX")
    path = Path(path)
    rng = random.Random(seed)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    size = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for documents in itertools.count():
                if documents == num_docs or (target_bytes is not None and size >= target_bytes):
                    break
                line = json.dumps({"id": documents, "text": _document(rng, doc_tokens)}) + "\n"
                f.write(line)
                size += len(line.encode("utf-8"))
        os.replace(tmp, path)
    except OSError as exc:  # name the file the caller asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(path), "documents": documents, "bytes": size}


def write_wordpiece_vocab(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 1000,
                          lowercase: bool = True) -> Path:
    from rapidformer.data.tokenizers import train_wordpiece

    out = Path(out_dir)
    train_wordpiece(texts, out, vocab_size=vocab_size, lowercase=lowercase, max_length=512)
    return out / "vocab.txt"


def write_gpt2_bpe(texts: Iterable[str], out_dir: str | os.PathLike,
                   vocab_size: int = 1000) -> tuple[Path, Path]:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out))
    vocab, merges = out / "vocab.json", out / "merges.txt"
    # the files are only useful if the reader preprocess_data uses accepts them
    if "<|endoftext|>" not in GPT2Tokenizer(vocab=str(vocab), merges=str(merges)).get_vocab():
        raise RuntimeError(f"{vocab}: GPT2Tokenizer does not see <|endoftext|>")
    return vocab, merges


def write_pretraining_sample(out: Path, num_docs: int = 600, seed: int = 3) -> dict:
    """A generated corpus under `out`, its WordPiece and GPT-2 BPE vocabularies, and both
    preprocessed: sentence-level data for BERT, document-level data with EOD for GPT (what the
    tests and the fault campaign pretrain on). Paths by name; the data prefixes as strings."""
    from rapidformer.data.preprocess_data import main as preprocess

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_corpus(out / "corpus.json", num_docs=num_docs, seed=seed)
    sample = list(iter_documents(num_docs, seed=seed))
    vocab = write_wordpiece_vocab(sample, out / "wordpiece", vocab_size=300)
    gpt2_vocab, merges = write_gpt2_bpe(sample, out / "gpt2", vocab_size=400)
    preprocess(["--input", str(out / "corpus.json"), "--output-prefix", str(out / "bert"),
                "--vocab-file", str(vocab), "--tokenizer-type", "BertWordPieceLowerCase",
                "--split-sentences"])
    preprocess(["--input", str(out / "corpus.json"), "--output-prefix", str(out / "gpt"),
                "--vocab-file", str(gpt2_vocab), "--merge-file", str(merges),
                "--tokenizer-type", "GPT2BPETokenizer", "--append-eod"])
    return {"dir": out, "vocab": vocab, "gpt2_vocab": gpt2_vocab, "merges": merges,
            "bert": str(out / "bert_text_sentence"), "gpt": str(out / "gpt_text_document")}


def _positive(kind):
    def parse(value: str):
        number = kind(value)
        if number <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return number
    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rapidformer.data.corpus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the corpus, one JSON object per line")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--docs", type=_positive(int), help="number of documents (default 10000)")
    size.add_argument("--mb", type=_positive(float), help="write documents until this many MiB")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--doc-tokens", type=_positive(int), nargs=2, metavar=("MIN", "MAX"),
                        help="tokens per document, drawn uniformly (default: 3-12 sentences)")
    parser.add_argument("--wordpiece-vocab", metavar="DIR")
    parser.add_argument("--gpt2-bpe", metavar="DIR")
    parser.add_argument("--vocab-size", type=_positive(int), default=1000)
    args = parser.parse_args(argv)
    doc_tokens = tuple(args.doc_tokens) if args.doc_tokens else None
    if doc_tokens and doc_tokens[0] > doc_tokens[1]:
        parser.error(f"--doc-tokens {doc_tokens[0]} {doc_tokens[1]}: MIN is above MAX")
    try:
        if args.mb is not None:
            info = write_corpus(args.output, target_bytes=int(args.mb * 2**20), seed=args.seed,
                                doc_tokens=doc_tokens)
        else:
            info = write_corpus(args.output, num_docs=args.docs or 10000, seed=args.seed,
                                doc_tokens=doc_tokens)
        print(f"wrote {info['path']}: {info['documents']} documents, {info['bytes']} bytes")
        if args.wordpiece_vocab or args.gpt2_bpe:
            sample = list(iter_documents(VOCAB_SAMPLE_DOCS, args.seed))
        if args.wordpiece_vocab:
            print(f"wrote {write_wordpiece_vocab(sample, args.wordpiece_vocab, args.vocab_size)}")
        if args.gpt2_bpe:
            vocab, merges = write_gpt2_bpe(sample, args.gpt2_bpe, args.vocab_size)
            print(f"wrote {vocab} and {merges}")
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: cannot write {exc.filename}: "
                       f"{exc.strerror or exc}\n")


if __name__ == "__main__":
    main()
