"""How N busy processes scale on this machine: the ceiling any N-worker tool meets.

    python benchmarks/cpu_ceiling.py                     # a pure-Python loop in each process
    python benchmarks/cpu_ceiling.py --work tokenize     # GPT-2 BPE tokenization (one thread each)

Each of N forked processes runs the same task at once; a row is the mean seconds a task took
and the efficiency (one process's seconds over N's: 1.0 is linear scaling). The Python loop
touches little memory; the tokenize task is what preprocess_data's workers do (the generated
corpus's documents through the Rust GPT-2 tokenizer, TOKENIZERS_PARALLELISM=false), so its
efficiency is the ceiling of preprocessing's scaling on the machine. Writes
$OUT/cpu_ceiling.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

_TOKENIZER = None
_TEXTS: list[str] = []


def _loop(_) -> float:
    started, total = time.perf_counter(), 0
    for i in range(12_000_000):
        total += i * i
    return time.perf_counter() - started


def _tokenize(_) -> float:
    started = time.perf_counter()
    for at in range(0, len(_TEXTS), 256):
        _TOKENIZER.encode_batch_fast(_TEXTS[at:at + 256], add_special_tokens=False)
    return time.perf_counter() - started


def _prepare_tokenize(documents: int) -> None:
    global _TOKENIZER, _TEXTS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from rapidformer.data.corpus import VOCAB_SAMPLE_DOCS, iter_documents, write_gpt2_bpe
    from rapidformer.data.preprocess_tokenizers import build_rust_tokenizer

    with tempfile.TemporaryDirectory() as work:
        vocab, merges = write_gpt2_bpe(list(iter_documents(VOCAB_SAMPLE_DOCS)), work)
        _TOKENIZER, _, _ = build_rust_tokenizer("GPT2BPETokenizer", str(vocab), str(merges),
                                                None)
    _TEXTS = list(iter_documents(documents, seed=7))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", choices=["loop", "tokenize"], default="loop")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--documents", type=int, default=20000, help="tokenize: per task")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "cpu_ceiling.json"))
    args = parser.parse_args()
    task = _loop
    if args.work == "tokenize":
        _prepare_tokenize(args.documents)  # before the fork: every process has it
        task = _tokenize
    rows = {}
    for n in args.processes:
        with mp.get_context("fork").Pool(n) as pool:
            seconds = pool.map(task, range(n))
        rows[n] = round(sum(seconds) / n, 3)
        print(n, rows[n], "s a task; efficiency", round(rows[args.processes[0]] / rows[n], 3),
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"work": args.work, "cpus": os.cpu_count(), "seconds_per_task": rows}, f)


if __name__ == "__main__":
    main()
