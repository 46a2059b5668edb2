"""The seed's 4-GPU white-box Megatron GPT example: TP=2 x PP=2, against TP=1 PP=1 DP=4 on the
same data, through the `rapidformer` console script (the seed's flags) and `python -m rapidformer`.

    python benchmarks/seed_megatron_4gpu.py                 # 4 GPUs: the seed's shape, 100 iterations
    python benchmarks/seed_megatron_4gpu.py --tiny          # 4 CPU processes (gloo), a tiny GPT

The seed's command (its docs): --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
--num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size 16
--global-batch-size 128 --seq-length 512 --data-impl mmap --split 980,20
--zero-2-memory-optimization --checkpoint-activations --mixed-precision, with its white-box
script (examples/rapidformer_pretrain_megatron_gpt_trainer_pp.py: the seed's, with its loss
in a loss_func so that pipeline stages work) on mmap data made with
preprocess_data from a generated corpus. Each row records the loss at every iteration (it must
fall and stay finite), tokens/s, MFU (on GPUs) and rank 0's peak memory. Writes
docs/benchmarks/seed_megatron_4gpu.json (--tiny: ..._cpu.json) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _data import gpt_mmap_data
from _report import finish, portable_command

from rapidformer.observability.flops import flops_per_token, peak_flops

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "rapidformer_pretrain_megatron_gpt_trainer_pp.py"
SHAPE = {"layers": 12, "hidden": 768, "heads": 12, "micro": 16, "global": 128, "seq": 512}
TINY = {"layers": 4, "hidden": 64, "heads": 4, "micro": 4, "global": 32, "seq": 64}


def seed_flags(shape: dict, tp: int, pp: int, data: dict, iters: int, tiny: bool) -> list[str]:
    """The seed's command line (mixed precision: fp16 on GPUs; the CPU run uses bf16)."""
    return ["--user-script", str(SCRIPT),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
            "--num-attention-heads", str(shape["heads"]),
            "--micro-batch-size", str(shape["micro"]), "--global-batch-size", str(shape["global"]),
            "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
            "--train-iters", str(iters), "--data-path", data["prefix"], "--data-impl", "mmap",
            "--split", "980,20", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--lr", "1.5e-4", "--min-lr", "1.0e-5", "--lr-decay-style", "linear",
            "--lr-warmup-fraction", ".01", "--weight-decay", "1e-2", "--clip-grad", "1.0",
            "--log-interval", "1", "--eval-iters", "1",
            "--zero-2-memory-optimization", "--checkpoint-activations",
            *(["--bf16"] if tiny else ["--mixed-precision"])]


def run(name: str, entry: str, tp: int, pp: int, args, data: dict, work: Path) -> dict:
    out = work / name
    flags = seed_flags(args.shape, tp, pp, data, args.iters, args.tiny)
    common = ["model=megatron_gpt", "launcher.nproc_per_node=4", "trainer.export_hf=false",
              "trainer.save_last=false", "trainer.progress_bar=false", "data.num_workers=0",
              f"trainer.output_dir={out}"]
    if entry == "console":  # the seed's flags through the console script
        command = [sys.executable, "-m", "rapidformer.cli.console", *flags, *common]
    else:  # the same run as Hydra overrides: translated by the console script, run by -m
        from rapidformer.cli.console import translate

        _, overrides, _ = translate(flags)
        command = [sys.executable, "-m", "rapidformer", *overrides, *common]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    row = {"layout": name, "entry": entry, "tensor_parallel": tp, "pipeline_parallel": pp,
           "data_parallel": 4 // (tp * pp), "wall_s": round(time.perf_counter() - started, 1),
           "command": portable_command(shlex.join(["python", "-m", command[2], *command[3:-1]]),
                                       {work: "DATA"})}
    if result.returncode != 0:
        lines = [l for l in result.stderr.splitlines() if l.strip()]
        row["error"] = next((l for l in lines if "rapidformer: error" in l), lines[-1][:300])
        return row
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    losses = [r["loss"] for r in steps]
    timed = steps[len(steps) // 5:] or steps  # past the first iterations' warm-up
    row.update({"losses": [round(l, 4) for l in losses],
                "finite": all(math.isfinite(l) for l in losses),
                "falls": sum(losses[-5:]) / 5 < sum(losses[:5]) / 5,
                "tokens_per_s": round(sum(r["tokens_per_s"] for r in timed) / len(timed), 1),
                "peak_mem_gb_rank0": max((r.get("peak_mem_gb") or 0.0) for r in steps) or None})
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="4 CPU processes, a tiny GPT")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--mb", type=float, default=20.0, help="generated corpus, MiB")
    parser.add_argument("--run-timeout", type=int, default=1800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.shape = TINY if args.tiny else SHAPE
    name = f"seed_megatron_4gpu{'_cpu' if args.tiny else ''}.json"
    out = args.out or REPO / "docs" / "benchmarks" / name
    import torch

    gpu = torch.cuda.is_available() and not args.tiny
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-seed4-") as temp:
        work = Path(temp)
        data = gpt_mmap_data(work, args.mb)
        vocab_size = len(json.loads(Path(data["vocab"]).read_text()))
        s = args.shape
        params = 12 * s["layers"] * s["hidden"] ** 2 + vocab_size * s["hidden"]
        per_token = flops_per_token(params, s["layers"], s["hidden"], s["seq"])
        peak = peak_flops(torch.device("cuda")) if gpu else None
        for name, entry, tp, pp in (("tp2_pp2", "console", 2, 2), ("tp2_pp2", "module", 2, 2),
                                    ("dp4", "module", 1, 1)):
            row = run(f"{name}_{entry}", entry, tp, pp, args, data, work)
            if peak and "tokens_per_s" in row:
                row["mfu"] = round(row["tokens_per_s"] / 4 * per_token / peak, 3)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    result = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if gpu else "CPU, 4 gloo processes",
              "shape": args.shape, "vocab": vocab_size, "params": params,
              "iterations": args.iters, "rows": rows}
    print("| layout | entry | final loss | falls, finite | tokens/s (4 procs) | MFU | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r['entry']} | failed: {r['error']} | | | | |")
            continue
        print(f"| {r['layout']} | {r['entry']} | {r['losses'][-1]:.3f} | {r['falls']}, "
              f"{r['finite']} | {r['tokens_per_s']:.0f} | {r.get('mfu', '-')} | "
              f"{r['peak_mem_gb_rank0'] or '-'} |")
    finish(out, result)


if __name__ == "__main__":
    main()
