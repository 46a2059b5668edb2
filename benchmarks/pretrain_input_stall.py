"""Does the pretraining loader keep a GPU step fed? Runs the bert_pretrain recipe (BERT-base
shape, seq 512, micro 16, global 128) through the real CLI on generated sentence-level mmap data,
and reads the share of each rank's time spent blocked waiting for input (`data_wait_frac` in
metrics.jsonl) — side by side for the plain baseline (data.num_workers=0: samples are built in
the training process, between steps) and the PreTrainer's default (worker processes, prefetch,
pinned memory).

    python benchmarks/pretrain_input_stall.py                        # GPU: bf16, 40 iterations
    python benchmarks/pretrain_input_stall.py --iters 40 --workers 0 2 4

The goal is below 1 % blocked for the default. Writes docs/benchmarks/pretrain_input_stall.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import finish

from rapidformer.data.corpus import VOCAB_SAMPLE_DOCS, iter_documents, write_corpus
from rapidformer.data.corpus import write_wordpiece_vocab
from rapidformer.data.preprocess_data import main as preprocess


def run(work: Path, prefix: str, vocab: Path, workers: int, args) -> dict:
    out = work / f"run_{workers}w"
    command = [sys.executable, "-m", "rapidformer", "+recipe=bert_pretrain",
               f"data.path={prefix}", f"model.tokenizer={vocab}", f"precision={args.precision}",
               f"trainer.train_iters={args.iters}", "trainer.log_interval=5",
               "trainer.eval_iters=1", "trainer.export_hf=false", "trainer.progress_bar=false",
               f"data.num_workers={workers}", f"trainer.output_dir={out}", *args.overrides]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"workers": workers, "error": result.stderr.strip().splitlines()[-1][:300]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][1:]  # the first window holds compile/warm-up
    mean = lambda key: sum(r[key] for r in steps) / len(steps)
    return {"workers": workers, "windows": len(steps),
            "data_wait_pct": round(100 * mean("data_wait_frac"), 3),
            "max_window_data_wait_pct": round(100 * max(r["data_wait_frac"] for r in steps), 3),
            "samples_per_s": round(mean("samples_per_s"), 1),
            "step_ms": round(1000 * args.global_batch / mean("samples_per_s"), 1),
            "peak_mem_gb": round(max(r.get("peak_mem_gb", 0) for r in steps), 2),
            "final_loss": round(steps[-1]["loss"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=40.0, help="corpus size in MiB")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--global-batch", type=int, default=128, help="the recipe's")
    parser.add_argument("--out", default="docs/benchmarks/pretrain_input_stall.json")
    parser.add_argument("overrides", nargs="*", help="more config overrides (a smoke run on a "
                                                     "CPU: model=bert_tiny data.max_seq_length=64)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-stall-") as temp:
        work = Path(temp)
        corpus = write_corpus(work / "corpus.json", target_bytes=int(args.mb * 2**20))
        vocab = write_wordpiece_vocab(list(iter_documents(VOCAB_SAMPLE_DOCS)), work / "wordpiece")
        preprocess(["--input", corpus["path"], "--output-prefix", str(work / "bert"),
                    "--vocab-file", str(vocab), "--tokenizer-type", "BertWordPieceLowerCase",
                    "--split-sentences", "--workers", str(min(8, os.cpu_count() or 1))])
        for workers in args.workers:
            rows.append(run(work, str(work / "bert_text_sentence"), vocab, workers, args))
            print(json.dumps(rows[-1]), flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"date": datetime.date.today().isoformat(), "device": device,
              "cpu_count": os.cpu_count(), "recipe": "bert_pretrain", "precision": args.precision,
              "iterations": args.iters, "corpus_mb": args.mb, "rows": rows}
    finish(args.out, result)


if __name__ == "__main__":
    main()
