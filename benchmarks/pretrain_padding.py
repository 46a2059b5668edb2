"""BERT pretraining where the padding is: long documents and short ones, rapidformer through its
CLI (`+recipe=bert_pretrain`) against a plain Hugging Face + torch.compile loop on the same
samples, in one call on one machine.

The corpora are the project's generated documents (rapidformer.data.corpus): long ones of
1,000-4,000 tokens (books, articles: Megatron's samples fill all 512 positions) and short ones
of 3-12 sentences (most samples are one short document: much padding). The vocabulary is the
corpus's WordPiece padded with BERT's [unused] entries to bert-base's 30,522, so the MLM head is
bert-base's. Model: bert-base's shape, seq 512, micro batch 32, bf16, constant lr 1e-4.

    python benchmarks/pretrain_padding.py                              # GPU
    python benchmarks/pretrain_padding.py --corpora short --rows hf-compile rf-unpad-compile
    python benchmarks/pretrain_padding.py --smoke                      # CPU, tiny, a few steps

Each row: samples/s and real tokens/s over the log windows after the first 20 iterations,
padding_frac, the first step's seconds, recompiles, the loss after the run's iterations (the
mean of the last log window: every row sees the same samples in the same order). Writes
docs/benchmarks/pretrain_padding.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import finish, keep_log, portable_command

from rapidformer.data.corpus import VOCAB_SAMPLE_DOCS, iter_documents, write_corpus
from rapidformer.data.corpus import write_wordpiece_vocab
from rapidformer.data.preprocess_data import main as preprocess

CORPORA = {"long": (1000, 4000), "short": None}
RF_ROWS = {"rf-compile-full-head": ["graph=compile", "task.mlm_head=all"],
           "rf-compile": ["graph=compile"],
           "rf-unpad": ["trainer.unpad=true"],
           "rf-unpad-compile": ["trainer.unpad=true", "graph=compile"],
           "rf-unpad-compile-cudagraphs": ["trainer.unpad=true", "graph=compile",
                                           "graph.mode=reduce-overhead"]}
HF_ROWS = ("hf-compile",)
VOCAB_SIZE = 30522
LOG_INTERVAL = 10


def make_data(work: Path, name: str, mb: float) -> tuple[str, Path]:
    corpus = write_corpus(work / f"{name}.json", target_bytes=int(mb * 2**20),
                          doc_tokens=CORPORA[name])
    vocab_dir = work / "wordpiece"
    if not (vocab_dir / "vocab.txt").exists():
        vocab = write_wordpiece_vocab(list(iter_documents(VOCAB_SAMPLE_DOCS)), vocab_dir)
        entries = vocab.read_text().split("\n")
        entries = [e for e in entries if e]
        entries += [f"[unused{i}]" for i in range(VOCAB_SIZE - len(entries))]
        vocab.write_text("\n".join(entries) + "\n")
    preprocess(["--input", corpus["path"], "--output-prefix", str(work / name),
                "--vocab-file", str(vocab_dir / "vocab.txt"), "--tokenizer-type",
                "BertWordPieceLowerCase", "--split-sentences",
                "--workers", str(min(8, os.cpu_count() or 1))])
    return str(work / f"{name}_text_sentence"), vocab_dir / "vocab.txt"


def common(prefix: str, vocab: Path, args) -> list[str]:
    return ["+recipe=bert_pretrain", f"data.path={prefix}", f"model.tokenizer={vocab}",
            f"precision={args.precision}", f"trainer.train_iters={args.iters}",
            f"trainer.micro_batch_size={args.batch}", f"trainer.global_batch_size={args.batch}",
            "trainer.lr=1e-4", "scheduler=constant", f"trainer.log_interval={LOG_INTERVAL}",
            "trainer.eval_iters=1", "trainer.export_hf=false", "trainer.progress_bar=false",
            "trainer.save_last=false", f"data.num_workers={args.workers}", *args.overrides]


def rapidformer_row(row: str, corpus: str, prefix: str, vocab: Path, args, work: Path) -> dict:
    out = work / f"{corpus}_{row}"
    profile = ([f"trainer.profile_steps=[{args.profile_steps[0]},{args.profile_steps[1]}]"]
               if args.profile_steps else [])
    command = [sys.executable, "-m", "rapidformer", *common(prefix, vocab, args), *RF_ROWS[row],
               *profile, f"trainer.output_dir={out}"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    keep_log(row, result)
    base = {"row": row, "corpus": corpus, "process_wall_s": round(time.perf_counter() - started, 1),
            "command": portable_command(" ".join(command[1:]), {str(work): "WORK"})}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "samples_per_s" in r]
    profile = out / "profile" / "kernels_rank0.json"
    profiled = json.loads(profile.read_text()) if profile.exists() else None
    # the profiled steps run slower (the profiler's own cost): not in the mean
    later = [r for r in windows if r["step"] > 20 and not (
        profiled and r["step"] - LOG_INTERVAL < profiled["last"] and r["step"] >= profiled["first"])]
    later = later or windows[1:] or windows
    mean = lambda key: sum(r[key] for r in later) / len(later)
    log = result.stderr + result.stdout
    first = re.search(r"first step compiled and ran in ([\d.]+) s", log)
    graphs = re.search(r"(\d+) graphs compiled, (\d+) of them after", log)
    return {**base, "samples_per_s": round(mean("samples_per_s"), 1),
            "real_tokens_per_s": round(mean("tokens_per_s")),
            "padding_frac": round(mean("padding_frac"), 3),
            "peak_mem_gb": round(max(r.get("peak_mem_gb", 0) for r in windows), 2),
            "first_step_s": float(first.group(1)) if first else None,
            "recompiles": int(graphs.group(2)) if graphs else 0,
            "loss_at_end": round(windows[-1]["loss"], 4),
            # each log window: where a mean below the steady rate comes from (a recording, a
            # wait for the loader)
            "windows": [[r["step"], round(r["samples_per_s"], 1),
                         round(r.get("data_wait_frac", 0), 3)] for r in windows],
            **({"profile": profiled} if profiled else {})}


def hf_row(row: str, corpus: str, prefix: str, vocab: Path, args, work: Path) -> dict:
    command = [sys.executable, __file__, "--hf-child", "--hf-prefix", prefix, "--hf-vocab",
               str(vocab), "--iters", str(args.iters), "--batch", str(args.batch),
               "--precision", args.precision, "--workers", str(args.workers),
               *(["--smoke"] if args.smoke else [])]
    result = subprocess.run(command, capture_output=True, text=True)
    base = {"row": row, "corpus": corpus,
            "command": "plain Hugging Face BertForPreTraining + torch.compile, same samples"}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return {**base, **json.loads(result.stdout.strip().splitlines()[-1])}


def hf_child(args) -> None:
    """BertForPreTraining compiled, fused AdamW at a constant lr, bf16 autocast, clipping, on
    the megatron-core samples rapidformer reads (full 512-token rows, as Megatron makes them)."""
    import contextlib

    import torch
    from transformers import BertConfig, BertForPreTraining

    from rapidformer.config.compose import compose, resolve
    from rapidformer.data.megatron import build_bert_datasets
    from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer

    _, cfg = resolve(compose(common(args.hf_prefix, Path(args.hf_vocab), args)), tempfile.mkdtemp())
    tokenizer = load_pretraining_tokenizer(cfg.model, cfg.data.path)
    d = cfg.data
    train, _, _ = build_bert_datasets(d.path, tokenizer, d.split, [args.iters * args.batch, 0, 0],
                                      d.max_seq_length, d.mask_prob, d.short_seq_prob,
                                      cfg.trainer.seed, binary_head=True, skip_warmup=True,
                                      path_to_cache=tempfile.mkdtemp())
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, num_workers=args.workers,
                                         pin_memory=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = cfg.model
    torch.manual_seed(cfg.trainer.seed)
    model = BertForPreTraining(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings, pad_token_id=tokenizer.hf_pad,
        attn_implementation="sdpa")).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=device.type == "cuda")
    forward = model if args.smoke else torch.compile(model)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, tokens, slots, started, first_step = [], 0, 0, None, None
    t0 = time.perf_counter()
    for step, batch in enumerate(loader, 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast:
            loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 1:
            sync()
            first_step = time.perf_counter() - t0
        if step == 20:
            sync()
            started = time.perf_counter()
        elif step > 20:
            tokens += int(batch["attention_mask"].sum())
            slots += batch["attention_mask"].numel()
        if step == args.iters:
            break
    sync()
    elapsed = time.perf_counter() - (started or t0)
    done = max(len(losses) - 20, 1)
    print(json.dumps({"samples_per_s": round(done * args.batch / elapsed, 1),
                      "real_tokens_per_s": round(tokens / elapsed),
                      "padding_frac": round(1 - tokens / slots, 3) if slots else None,
                      "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if device.type == "cuda" else None,
                      "first_step_s": round(first_step, 1),
                      "loss_at_end": round(float(sum(losses[-10:]) / len(losses[-10:])), 4)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    parser.add_argument("--rows", nargs="+", default=[*HF_ROWS, *RF_ROWS])
    parser.add_argument("--iters", type=int, default=80)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                        help="loader worker processes, for every system (BERT samples are "
                             "built in Python: 2 workers hand out about 1,300 a second)")
    parser.add_argument("--mb", type=float, default=20.0, help="each corpus's MiB")
    parser.add_argument("--smoke", action="store_true", help="CPU: bert_tiny, seq 64, eager")
    parser.add_argument("--out", default="docs/benchmarks/pretrain_padding.json")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--profile-steps", nargs=2, type=int, metavar=("FIRST", "LAST"),
                        help="rapidformer rows: trainer.profile_steps; the kernel table goes "
                             "into the row, and those steps' log windows out of the mean")
    parser.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--hf-vocab", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.overrides = [*args.overrides, "model=bert_tiny", "data.max_seq_length=64",
                          "trainer.device=cpu"]
        args.precision, args.mb = "fp32", min(args.mb, 1.0)
        if not args.hf_child:
            args.iters, args.batch = 30, 8
            args.rows = [r for r in args.rows if "compile" not in r or r == "hf-compile"]
    if args.hf_child:
        return hf_child(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-pretrain-padding-") as temp:
        work = Path(temp)
        for corpus in args.corpora:
            prefix, vocab = make_data(work, corpus, args.mb)
            for row in args.rows:
                runner = hf_row if row in HF_ROWS else rapidformer_row
                rows.append(runner(row, corpus, prefix, vocab, args, work))
                print(json.dumps(rows[-1]), flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    finish(args.out, {"date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "cpus": os.cpu_count(),
                      "iterations": args.iters, "micro_batch": args.batch,
                      "command": portable_command(" ".join(sys.argv)), "rows": rows})


if __name__ == "__main__":
    main()
