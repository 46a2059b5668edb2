"""How fast the pretraining loader hands out samples from mmap data: BERT (seq 512, masked LM +
NSP, built per sample by megatron-core) and GPT (seq 2048, packed documents).

    python benchmarks/loader_speed.py                     # 30 MB corpus, workers 0 and 2
    python benchmarks/loader_speed.py --workers 0 2 4 8   # on a machine with more cores

For each: the one-time index build, samples/s of plain `dataset[i]` (one process), and samples/s
through the PreTrainer's own loader (the pretraining batch sampler, `--micro` per batch, N
worker processes, prefetch) — what a training step waits on. The corpus and vocabularies come
from rapidformer.data.corpus; nothing is downloaded. Writes docs/benchmarks/loader_speed.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from _report import write_report

from rapidformer.data.corpus import (VOCAB_SAMPLE_DOCS, iter_documents, write_corpus,
                                     write_gpt2_bpe, write_wordpiece_vocab)
from rapidformer.data.megatron import MegatronTokenizer, build_bert_datasets, build_gpt_datasets
from rapidformer.data.sampler import PretrainingBatchSampler
from rapidformer.data.preprocess_tokenizers import build_tokenizer
from rapidformer.data.preprocess_data import main as preprocess


def make_data(work: Path, mb: float) -> dict:
    corpus = write_corpus(work / "corpus.json", target_bytes=int(mb * 2**20))
    sample = list(iter_documents(VOCAB_SAMPLE_DOCS))
    vocab = write_wordpiece_vocab(sample, work / "wordpiece")
    gpt2_vocab, merges = write_gpt2_bpe(sample, work / "gpt2")
    common = ["--input", corpus["path"], "--workers", str(min(8, os.cpu_count() or 1))]
    preprocess([*common, "--output-prefix", str(work / "bert"), "--vocab-file", str(vocab),
                "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences"])
    preprocess([*common, "--output-prefix", str(work / "gpt"), "--vocab-file", str(gpt2_vocab),
                "--merge-file", str(merges), "--tokenizer-type", "GPT2BPETokenizer", "--append-eod"])
    bert_tok, bert_eod, _ = build_tokenizer("BertWordPieceLowerCase", str(vocab), None, None)
    gpt_tok, gpt_eod, _ = build_tokenizer("GPT2BPETokenizer", str(gpt2_vocab), str(merges), None)
    return {"corpus": corpus, "bert": (str(work / "bert_text_sentence"),
                                       MegatronTokenizer.from_hf(bert_tok, bert_eod)),
            "gpt": (str(work / "gpt_text_document"), MegatronTokenizer.from_hf(gpt_tok, gpt_eod))}


def rate(dataset, count: int, workers: int, micro: int) -> float:
    """Samples/s through the PreTrainer's loader layout (after the first batch: start-up)."""
    if workers < 0:
        started = time.perf_counter()
        for i in range(count):
            dataset[i]
        return count / (time.perf_counter() - started)
    sampler = PretrainingBatchSampler(len(dataset), 0, micro, 0, 1)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    batches = iter(loader)
    next(batches)
    started = time.perf_counter()
    for _ in range(count // micro):
        next(batches)
    return (count // micro) * micro / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=30.0, help="corpus size in MiB")
    parser.add_argument("--samples", type=int, default=2048, help="samples timed per row")
    parser.add_argument("--micro", type=int, default=16, help="micro-batch size")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--bert-seq", type=int, default=512)
    parser.add_argument("--gpt-seq", type=int, default=2048)
    parser.add_argument("--out", default="docs/benchmarks/loader_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the loader's work is per-sample Python/NumPy, as in training
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-loader-") as temp:
        work = Path(temp)
        data = make_data(work, args.mb)
        kinds = {
            "bert": lambda prefix, tok: build_bert_datasets(
                prefix, tok, "980,20", [args.samples * 4, 0, 0], args.bert_seq, 0.15, 0.1, 1234,
                path_to_cache=work / "cache")[0],
            "gpt": lambda prefix, tok: build_gpt_datasets(
                prefix, tok, "980,20", [args.samples * 4, 0, 0], args.gpt_seq, 1234,
                eod_mask_loss=True, path_to_cache=work / "cache")[0]}
        for kind, build in kinds.items():
            started = time.perf_counter()
            dataset = build(*data[kind])
            index_s = time.perf_counter() - started
            seq = args.bert_seq if kind == "bert" else args.gpt_seq
            row = {"dataset": kind, "seq_length": seq, "samples_in_dataset": len(dataset),
                   "index_build_s": round(index_s, 2),
                   "getitem_samples_per_s": round(rate(dataset, args.samples, -1, args.micro), 1)}
            for workers in args.workers:
                row[f"loader_{workers}w_samples_per_s"] = round(
                    rate(dataset, args.samples, workers, args.micro), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"date": datetime.date.today().isoformat(),
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "corpus_mb": args.mb, "documents": data["corpus"]["documents"],
              "micro_batch_size": args.micro, "rows": rows}
    write_report(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
