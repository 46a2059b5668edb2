"""Sentence-pair fine-tuning at real lengths: rapidformer through its CLI against plain Hugging
Face loops, in one call on one machine.

The data are paraphrase-like pairs whose lengths follow real paraphrase corpora (MRPC: mean
about 50 tokens a pair, a long tail to 128), 4,076 training pairs as in MRPC; the label (is the
second sentence the first, reworded?) is learnable. The models are saved as local Hugging Face
checkpoints (random weights, BERT's 30,522-entry vocabulary) and read by both systems the way a
pretrained encoder is read: `model=hf model.name_or_path=DIR`.

    python benchmarks/finetune_padding.py                          # GPU: small and base encoders
    python benchmarks/finetune_padding.py --models small --rows hf-eager rf-unpad
    python benchmarks/finetune_padding.py --smoke                  # CPU, tiny, a few steps

Each row reports samples/s and real (non-padding) tokens/s after the first epoch (compile and
warm-up excluded), the wall seconds of each epoch, the first step's seconds (compile), the
graphs compiled after warm-up (recompiles), the mean training loss of the last epoch and the
validation accuracy. Writes docs/benchmarks/finetune_padding.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from _report import finish, keep_log, portable_command

MODELS = {"small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536),
          "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       intermediate_size=3072)}
# rapidformer rows: the CLI overrides of each
RF_ROWS = {
    "rf-eager-fp32": ["precision=fp32"],
    "rf-eager-bf16": ["precision=bf16"],
    "rf-compile-longest": ["precision=bf16", "graph=compile", "data.pad_to=longest"],
    "rf-compile": ["precision=bf16", "graph=compile"],
    "rf-compile-cudagraphs": ["precision=bf16", "graph=compile", "graph.mode=reduce-overhead"],
    "rf-unpad": ["precision=bf16", "trainer.unpad=true"],
    "rf-unpad-compile": ["precision=bf16", "trainer.unpad=true", "graph=compile"],
    "rf-unpad-compile-cudagraphs": ["precision=bf16", "trainer.unpad=true", "graph=compile",
                                    "graph.mode=reduce-overhead"],
}
HF_ROWS = {"hf-eager": dict(compiled=False, bf16=False), "hf-eager-bf16": dict(compiled=False, bf16=True),
           "hf-compile": dict(compiled=True, bf16=True)}
VOCAB_SIZE = 30522
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# --- data ------------------------------------------------------------------------------------
def _words(count: int) -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = set()
    while len(words) < count:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    return sorted(words)


def pair_lengths(rng: random.Random, limit: int = 125) -> tuple[int, int]:
    """Word counts of a pair: log-normal around 24 words a sentence (MRPC's pairs are about 50
    tokens with [CLS]/[SEP], a tail to 128)."""
    total = min(limit, max(8, int(rng.lognormvariate(math.log(44), 0.35))))
    first = max(3, int(total * rng.uniform(0.4, 0.6)))
    return first, max(3, total - first)


def write_pairs(work: Path, train: int, valid: int) -> tuple[Path, list[str]]:
    words = _words(8000)
    rng = random.Random(1)
    out = work / "pairs"
    out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("validation", valid)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                n1, n2 = pair_lengths(rng)
                first = [rng.choice(words) for _ in range(n1)]
                label = rng.random() < 0.68  # MRPC's share of paraphrases
                if label:  # the first sentence reworded: some words replaced, resized to n2
                    second = [w if rng.random() < 0.8 else rng.choice(words) for w in first]
                    second = (second * 2)[:n2] if n2 > len(second) else second[:n2]
                else:
                    second = [rng.choice(words) for _ in range(n2)]
                f.write(json.dumps({"sentence1": " ".join(first), "sentence2": " ".join(second),
                                    "label": int(label)}) + "\n")
    return out, words


def write_checkpoints(work: Path, words: list[str], models: list[str]) -> dict[str, Path]:
    """A local Hugging Face checkpoint per model shape: BERT, random weights, a WordPiece
    vocabulary of the data's words padded to BERT's 30,522 entries."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = SPECIAL + words + [f"[unused{i}]" for i in range(VOCAB_SIZE - len(SPECIAL) - len(words))]
    (work / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(work / "vocab.txt"), do_lower_case=True)
    paths = {}
    for name in models:
        config = BertConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=512, num_labels=2,
                            **MODELS[name])
        path = work / f"bert_{name}"
        BertForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


# --- rapidformer through its CLI ----------------------------------------------------------------
def rapidformer_row(row: str, model: Path, data: Path, args, work: Path) -> dict:
    out = work / f"{model.name}_{row}"
    command = [sys.executable, "-m", "rapidformer", "task=sequence_classification", "model=hf",
               f"model.name_or_path={model}", "data=pairs_local", f"data.path={data}",
               "data.max_seq_length=128", f"trainer.micro_batch_size={args.batch}",
               f"trainer.epochs={args.epochs}", "trainer.lr=5e-5", "trainer.log_interval=8",
               "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.keep_last=1",
               f"trainer.output_dir={out}", *RF_ROWS[row], *args.overrides]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    keep_log(row, result)
    wall = time.perf_counter() - started
    base = {"row": row, "model": model.name, "command": portable_command(
        " ".join(command[1:]), {str(work): "WORK"})}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    log = result.stderr + result.stdout
    first = re.search(r"first step compiled and ran in ([\d.]+) s", log)
    graphs = re.search(r"(\d+) graphs compiled, (\d+) of them after", log)
    return {**base, **summarize(records, args), "process_wall_s": round(wall, 1),
            "first_step_s": float(first.group(1)) if first else None,
            "recompiles": int(graphs.group(2)) if graphs else 0}


def summarize(records: list[dict], args) -> dict:
    """Steady speed (log windows of the epochs after the first), each epoch's seconds from the
    windows' throughput, the last epoch's mean loss, the last validation accuracy."""
    steps_per_epoch = args.train // args.batch
    windows = [r for r in records if "samples_per_s" in r]
    later = [r for r in windows if r["step"] > steps_per_epoch + 8] or windows[1:] or windows
    epoch_s = []
    for e in range(args.epochs):
        inside = [r for r in windows if e * steps_per_epoch < r["step"] <= (e + 1) * steps_per_epoch]
        epoch_s.append(round(sum(8 * args.batch / r["samples_per_s"] for r in inside), 2))
    evals = [r for r in records if "validation/accuracy" in r]
    mean = lambda key, rows: sum(r[key] for r in rows) / max(len(rows), 1)
    return {"samples_per_s": round(mean("samples_per_s", later), 1),
            "real_tokens_per_s": round(mean("tokens_per_s", later)),
            "padding_frac": round(mean("padding_frac", later), 3),
            "epoch_s": epoch_s,
            "last_epoch_loss": round(mean("loss", [r for r in windows if r["step"] > (
                args.epochs - 1) * steps_per_epoch]), 4),
            "val_accuracy": round(evals[-1]["validation/accuracy"], 4) if evals else None}


# --- the plain Hugging Face loop ------------------------------------------------------------
def hf_row(row: str, model: Path, data: Path, args, work: Path) -> dict:
    command = [sys.executable, __file__, "--hf-child", row, "--hf-model", str(model),
               "--hf-data", str(data), "--batch", str(args.batch), "--epochs", str(args.epochs),
               "--train", str(args.train)]
    result = subprocess.run(command, capture_output=True, text=True)
    base = {"row": row, "model": model.name, "command": f"plain Hugging Face loop ({row})"}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return {**base, **json.loads(result.stdout.strip().splitlines()[-1])}


def hf_child(args) -> None:
    """What a user writes with transformers alone: tokenizer, DataCollatorWithPadding, AdamW,
    a linear schedule, clipping, (optionally) bf16 autocast and torch.compile."""
    import torch
    from datasets import load_dataset
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                              DataCollatorWithPadding, get_linear_schedule_with_warmup)

    spec = HF_ROWS[args.hf_child]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(42)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_model)
    data = load_dataset("json", data_files={s: str(Path(args.hf_data) / f"{s}.jsonl")
                                            for s in ("train", "validation")})
    data = data.map(lambda b: tokenizer(b["sentence1"], b["sentence2"], truncation=True,
                                        max_length=128), batched=True,
                    remove_columns=["sentence1", "sentence2"])
    collate = DataCollatorWithPadding(tokenizer)
    loader = torch.utils.data.DataLoader(data["train"], batch_size=args.batch, shuffle=True,
                                         collate_fn=collate, drop_last=True, pin_memory=True)
    model = AutoModelForSequenceClassification.from_pretrained(args.hf_model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01, fused=device.type == "cuda")
    schedule = get_linear_schedule_with_warmup(optimizer, 0, len(loader) * args.epochs)
    forward = torch.compile(model) if spec["compiled"] else model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if spec["bf16"]
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    epoch_s, losses, tokens, samples, first_step = [], [], 0, 0, None
    for epoch in range(args.epochs):
        sync()
        started = time.perf_counter()
        epoch_losses = []
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast:
                loss = forward(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            epoch_losses.append(loss.detach())
            if first_step is None:
                sync()
                first_step = time.perf_counter() - started
            if epoch > 0:
                tokens += int(batch["attention_mask"].sum())
                samples += batch["input_ids"].shape[0]
        sync()
        epoch_s.append(round(time.perf_counter() - started, 2))
        losses = [float(x) for x in epoch_losses]
    model.eval()
    right = seen = 0
    with torch.no_grad(), autocast:
        for batch in torch.utils.data.DataLoader(data["validation"], batch_size=64, collate_fn=collate):
            batch = {k: v.to(device) for k, v in batch.items()}
            right += int((forward(**batch).logits.argmax(-1) == batch["labels"]).sum())
            seen += len(batch["labels"])
    later = sum(epoch_s[1:]) or epoch_s[0]
    print(json.dumps({"samples_per_s": round(samples / later, 1) if samples else None,
                      "real_tokens_per_s": round(tokens / later) if tokens else None,
                      "epoch_s": epoch_s, "first_step_s": round(first_step, 2),
                      "last_epoch_loss": round(sum(losses) / len(losses), 4),
                      "val_accuracy": round(right / seen, 4)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["small", "base"], choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", default=[*HF_ROWS, *RF_ROWS])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train", type=int, default=4076)
    parser.add_argument("--valid", type=int, default=408)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny data, fp32 rows only")
    parser.add_argument("--out", default="docs/benchmarks/finetune_padding.json")
    parser.add_argument("--work", default=None)
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--hf-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hf-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hf-data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_child:
        return hf_child(args)
    if args.smoke:
        args.train, args.valid, args.epochs, args.models = 256, 64, 2, ["small"]
        args.rows = ["hf-eager", "rf-eager-fp32", "rf-unpad"]
        args.overrides = [*args.overrides, "precision=fp32", "trainer.device=cpu"]
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="finetune_padding_"))
    data, words = write_pairs(work, args.train, args.valid)
    checkpoints = write_checkpoints(work, words, args.models)
    rows = []
    for name in args.models:
        for row in args.rows:
            runner = hf_row if row in HF_ROWS else rapidformer_row
            rows.append(runner(row, checkpoints[name], data, args, work))
            print(json.dumps(rows[-1]), flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    finish(args.out, {"date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "cpus": os.cpu_count(),
                      "command": portable_command(" ".join(sys.argv)), "rows": rows})


if __name__ == "__main__":
    main()
