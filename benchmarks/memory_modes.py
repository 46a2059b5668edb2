"""Memory modes side by side: samples/s and GPU memory of a bert-base-shaped fine-tuning run
under memory=none (DDP), zero1, zero2, zero3 and fsdp, in bf16 and fp16, on N GPUs.

    python benchmarks/memory_modes.py --nproc 2 --steps 40
    python benchmarks/memory_modes.py --smoke            # CPU, tiny model, 2 modes: checks the plumbing

Each row is one real `python -m rapidformer` run; the numbers come from its metrics.jsonl
(samples/s averaged over the log windows after the first; memory read on rank 0 between steps
and at the peak). Writes docs/benchmarks/memory_modes.json and prints a markdown table, with the
ZeRO model-state formula for comparison: (2 + 2 + 12) bytes per parameter for mixed-precision
Adam, of which ZeRO-1 shards the 12, ZeRO-2 the 12 + 2 and ZeRO-3 all 16 over N ranks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BERT_BASE = ["model.hidden_size=768", "model.num_layers=12", "model.num_attention_heads=12",
             "model.intermediate_size=3072", "model.max_position_embeddings=512",
             "model.initializer_range=0.02", "data.max_seq_length=128"]


def zero_formula_gb(params: int, mode: str, ranks: int) -> float | None:
    shards = {"none": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16),
              "fsdp": (0, 16)}
    if mode not in shards:
        return None
    whole, sharded = shards[mode]
    return params * (whole + sharded / ranks) / 2**30


def run_one(mode: str, precision: str, args, work: Path) -> dict:
    run = work / f"{mode}_{precision}"
    # --smoke keeps the default tiny model
    overrides = [*([] if args.smoke else BERT_BASE), f"memory={mode}", f"precision={precision}",
                 f"launcher.nproc_per_node={args.nproc}", f"trainer.train_iters={args.steps}",
                 f"trainer.micro_batch_size={args.micro}",
                 f"trainer.global_batch_size={args.micro * args.nproc}",
                 "trainer.log_interval=10", "trainer.lr=1e-4", "trainer.export_hf=false",
                 "trainer.progress_bar=false", "trainer.tensorboard=false",
                 f"data.synthetic_train_size={args.micro * args.nproc * (args.steps + 1)}",
                 "data.synthetic_eval_size=64", f"trainer.output_dir={run}"]
    result = subprocess.run([sys.executable, "-m", "rapidformer", *overrides],
                            capture_output=True, text=True)
    row = {"mode": mode, "precision": precision, "nproc": args.nproc,
           "command": "python -m rapidformer " + " ".join(overrides[:-1])}
    if result.returncode != 0:
        error = [l for l in result.stderr.splitlines() if "rapidformer: error" in l]
        row["error"] = error[-1] if error else result.stderr.strip().splitlines()[-1][:300]
        return row
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    steady = train[1:] or train
    row.update({"samples_per_s": sum(r["samples_per_s"] for r in steady) / len(steady),
                "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
                "final_loss": train[-1]["loss"],
                "model_state_gb": train[-1].get("mem_allocated_gb"),
                "peak_mem_gb": max((r.get("peak_mem_gb") or 0) for r in train) or None})
    counts = [int(l.split("model parameters: ")[1].split()[0])
              for l in result.stdout.splitlines() + result.stderr.splitlines()
              if "model parameters: " in l]
    row["parameters"] = counts[-1] if counts else None
    if row["parameters"]:
        row["zero_formula_gb"] = zero_formula_gb(row["parameters"], mode, args.nproc)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--modes", default="none,zero1,zero2,zero3,fsdp")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--out", default="docs/benchmarks/memory_modes.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.micro, args.modes, args.precisions = 10, 8, "none,zero2", "fp32"
    work = Path(tempfile.mkdtemp(prefix="rapidformer-bench-"))
    rows = []
    for precision in args.precisions.split(","):
        for mode in args.modes.split(","):
            row = run_one(mode, precision, args, work)
            rows.append(row)
            print(json.dumps(row), flush=True)
    import torch

    meta = {"date": datetime.date.today().isoformat(), "rows": rows, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=1))
    print("| memory | precision | samples/s | tokens/s | model states GB (measured) | formula GB | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | {r['precision']} | refused: {r['error']} | | | | |")
            continue
        f = r.get("zero_formula_gb")
        print(f"| {r['mode']} | {r['precision']} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} "
              f"| {r['model_state_gb'] or 0:.3f} | {f'{f:.3f}' if f else '-'} | {r['peak_mem_gb'] or 0:.2f} |")


if __name__ == "__main__":
    main()
