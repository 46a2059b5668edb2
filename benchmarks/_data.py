"""Benchmark data: a generated corpus, a GPT-2 BPE vocabulary trained on it, and its Megatron
mmap files, made as a user would make them (`rapidformer.data.preprocess_data`)."""
from __future__ import annotations

import os
from pathlib import Path

from rapidformer.data.corpus import VOCAB_SAMPLE_DOCS, iter_documents, write_corpus, write_gpt2_bpe
from rapidformer.data.preprocess_data import main as preprocess


def gpt_mmap_data(work: Path, mb: float) -> dict:
    """{"prefix", "vocab", "merges"} of document-level GPT data of about `mb` MiB under `work`."""
    corpus = write_corpus(work / "corpus.json", target_bytes=int(mb * 2**20))
    vocab, merges = write_gpt2_bpe(list(iter_documents(VOCAB_SAMPLE_DOCS)), work / "gpt2")
    preprocess(["--input", corpus["path"], "--output-prefix", str(work / "gpt"),
                "--vocab-file", str(vocab), "--merge-file", str(merges),
                "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                "--workers", str(min(8, os.cpu_count() or 1))])
    return {"prefix": str(work / "gpt_text_document"), "vocab": str(vocab), "merges": str(merges)}
