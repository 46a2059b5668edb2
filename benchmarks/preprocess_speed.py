"""Speed of `python -m rapidformer.data.preprocess_data` on a synthetic corpus: MB/s of input JSON,
documents/s and tokens/s, for GPT-2 BPE (document level, --append-eod) and lower-case BERT
WordPiece (--split-sentences).

    python benchmarks/preprocess_speed.py                  # 100 MB corpus, --workers 2
    python benchmarks/preprocess_speed.py --workers 1 2 4 8 16   # scaling, one row each
    python benchmarks/preprocess_speed.py --mb 5           # a quick check of the plumbing

The corpus and both vocabularies come from rapidformer.data.corpus, so nothing is downloaded.
Each row is one real run of the CLI in a subprocess and is timed from the outside, so the time
includes interpreter start-up and imports, as a user's run does; the CLI's own rate (from its
`done:` line) is recorded too. Every output is opened with megatron-core's IndexedDataset and
its documents and tokens counted. Writes docs/benchmarks/preprocess_speed.json and prints a
markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from rapidformer.data.corpus import (VOCAB_SAMPLE_DOCS, iter_documents, write_corpus,
                                     write_gpt2_bpe, write_wordpiece_vocab)


def run_one(name: str, flags: list[str], level: str, corpus: dict, workers: int,
            work: Path) -> dict:
    prefix = work / f"{name}_w{workers}"
    command = ["--input", corpus["path"], "--output-prefix", str(prefix), "--dataset-impl", "mmap",
               "--workers", str(workers), "--log-interval", "1000000", *flags]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "rapidformer.data.preprocess_data", *command],
                            capture_output=True, text=True)
    seconds = time.perf_counter() - started
    row = {"name": name, "workers": workers, "seconds": round(seconds, 2),
           # the work directory is temporary: record the command relative to it
           "command": ("python -m rapidformer.data.preprocess_data " + " ".join(command)).replace(
               str(work), "WORK")}
    if result.returncode != 0:
        row["error"] = (result.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return row
    done = re.search(r"done: \d+ documents \(([\d.]+) docs/s, ([\d.]+) MB/s\)", result.stderr)
    dataset = open_dataset(f"{prefix}_text_{level}")
    documents, tokens = len(dataset.document_indices) - 1, int(dataset.sequence_lengths.sum())
    if documents != corpus["documents"]:
        row["error"] = f"{documents} documents in the output, {corpus['documents']} in the input"
    row.update({"documents": documents, "sequences": len(dataset), "tokens": tokens,
                "mb_per_s": corpus["bytes"] / 2**20 / seconds, "docs_per_s": documents / seconds,
                "tokens_per_s": tokens / seconds, "tokens_per_doc": tokens / documents,
                "output_bytes": sum(Path(f"{prefix}_text_{level}{e}").stat().st_size
                                    for e in (".bin", ".idx"))})
    if done:
        row["cli_docs_per_s"], row["cli_mb_per_s"] = float(done[1]), float(done[2])
    return row


def open_dataset(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def machine() -> dict:
    import torch

    versions = {}
    for package in ("torch", "transformers", "tokenizers", "megatron-core"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), **versions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="worker counts: a row per tokenizer and count")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work-dir", help="keep the corpus and outputs here (default: a temporary "
                                           "directory, removed at the end)")
    parser.add_argument("--out", default="docs/benchmarks/preprocess_speed.json")
    args = parser.parse_args()
    if args.mb <= 0 or min(args.workers) < 1:
        parser.error("--mb must be positive and --workers at least 1")
    with tempfile.TemporaryDirectory(prefix="rapidformer-preprocess-") as temp:
        work = Path(args.work_dir or temp)
        work.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        corpus = write_corpus(work / "corpus.json", target_bytes=int(args.mb * 2**20),
                              seed=args.seed)
        corpus["seconds"] = round(time.perf_counter() - started, 2)
        print(f"corpus: {corpus['documents']} documents, {corpus['bytes'] / 2**20:.1f} MiB in "
              f"{corpus['seconds']} s", flush=True)
        sample = list(iter_documents(VOCAB_SAMPLE_DOCS, args.seed))
        wordpiece = write_wordpiece_vocab(sample, work / "wordpiece")
        vocab, merges = write_gpt2_bpe(sample, work / "gpt2")
        runs = [("gpt2_bpe_document", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                       str(vocab), "--merge-file", str(merges), "--append-eod"],
                 "document"),
                ("bert_wordpiece_sentence", ["--tokenizer-type", "BertWordPieceLowerCase",
                                             "--vocab-file", str(wordpiece), "--split-sentences"],
                 "sentence")]
        rows = []
        for name, flags, level in runs:
            for workers in args.workers:
                rows.append(run_one(name, flags, level, corpus, workers, work))
                print(json.dumps(rows[-1]), flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(),
              "corpus": {**corpus, "path": None if not args.work_dir else corpus["path"],
                         "mb": corpus["bytes"] / 2**20, "seed": args.seed}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{corpus['bytes'] / 2**20:.1f} MiB, {corpus['documents']} documents, "
          f"{os.cpu_count()} CPUs; wrote {args.out}\n")
    print("| tokenizer | workers | seconds | MB/s | docs/s | tokens | tokens/s | sequences |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r and "tokens" not in r:
            print(f"| {r['name']} | {r['workers']} | failed: {r['error']} | | | | | |")
            continue
        print(f"| {r['name']} | {r['workers']} | {r['seconds']:.1f} | {r['mb_per_s']:.2f} "
              f"| {r['docs_per_s']:.0f} "
              f"| {r['tokens']} | {r['tokens_per_s']:.0f} | {r['sequences']} |")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
