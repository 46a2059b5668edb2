"""Benchmark data: a generated corpus, a GPT-2 BPE vocabulary trained on it, and its Megatron
mmap files, made as a user would make them (`rapidformer.data.preprocess_data`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from rapidformer.data.corpus import VOCAB_SAMPLE_DOCS, iter_documents, write_corpus, write_gpt2_bpe
from rapidformer.data.preprocess_data import main as preprocess


def gpt_mmap_data(work: Path, mb: float, vocab_size: int | None = None) -> dict:
    """{"prefix", "vocab", "merges"} of document-level GPT data of about `mb` MiB under `work`;
    with `vocab_size`, the vocabulary padded with unused entries to that many (GPT-2's 50,257:
    the output head of a real model, on the generated language's few thousand tokens)."""
    corpus = write_corpus(work / "corpus.json", target_bytes=int(mb * 2**20))
    vocab, merges = write_gpt2_bpe(list(iter_documents(VOCAB_SAMPLE_DOCS)), work / "gpt2")
    if vocab_size:
        pad_vocab(vocab, vocab_size)
    preprocess(["--input", corpus["path"], "--output-prefix", str(work / "gpt"),
                "--vocab-file", str(vocab), "--merge-file", str(merges),
                "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                "--workers", str(min(8, os.cpu_count() or 1))])
    return {"prefix": str(work / "gpt_text_document"), "vocab": str(vocab), "merges": str(merges)}


def pad_vocab(vocab_json: Path, size: int) -> None:
    """vocab.json with unused entries appended up to `size` (no merge produces them)."""
    vocab = json.loads(vocab_json.read_text())
    for i in range(len(vocab), size):
        vocab[f"<|unused_{i}|>"] = i
    vocab_json.write_text(json.dumps(vocab))
