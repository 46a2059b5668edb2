"""Tensor, pipeline and data parallelism for a megatron-core GPT, side by side with one GPU.

    python benchmarks/megatron_layouts.py                  # GPT 1.3B shape, bf16, 2 GPUs
    python benchmarks/megatron_layouts.py --layouts one tp2 --model megatron_gpt_tiny \
        --hidden 64 --layers 4 --heads 4 --seq 64 --iters 4   # a smoke run (CPU)
    python benchmarks/megatron_layouts.py --model gpt2_small --layouts one dp2 \
        --out docs/benchmarks/ddp_scaling.json   # DDP scaling, the same shape as a HF GPT-2
    python benchmarks/megatron_layouts.py --model megatron_llama --layouts one --layers 16 \
        --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 2048 \
        --micro 8 --global-batch 64 --iters 30 --set graph=compile \
        --out docs/benchmarks/megatron_llama_1b.json   # Llama 3.2 1B's shape on one GPU

Each layout is one real run of `python -m rapidformer +recipe=gpt_pretrain model=megatron_gpt`
on generated document-level mmap data: one process on one GPU (the baseline), TP=2, PP=2, and
DP=2 over 2 GPUs; also DP=2 with megatron-core's distributed optimizer (`dp2_zero1`) and fp16
with dynamic loss scaling (`one_fp16`, `tp2_fp16`). Reads tokens/s, peak memory (rank 0) and the
loss from metrics.jsonl, and
computes MFU from the model's FLOPs per token (6 x parameters + attention) against the GPU's
dense bf16 peak. Writes docs/benchmarks/megatron_layouts.json.

`--model megatron_llama` (with --kv-heads, --ffn) measures the Llama-family decoder; --vocab pads
the generated tokenizer to a real model's output size (Llama 3's 128,256), since the output
layer is a large share of a 1B model's step. Its FLOPs count the matrices a token multiplies
through: every block and the output layer, not the input embedding (a lookup: with an untied
128,256-entry vocabulary, counting it would add 17 % to a 1B model's MFU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from _data import gpt_mmap_data
from _report import finish, write_report

from rapidformer.observability.flops import flops_per_token, peak_flops

# layout -> (processes, overrides)
LAYOUTS = {"one": (1, ["parallelism=dp"]), "tp2": (2, ["parallelism=tp2"]),
           "pp2": (2, ["parallelism=pp2"]), "dp2": (2, ["parallelism=dp"]),
           "dp2_zero1": (2, ["parallelism=dp", "memory=zero1"]),
           "one_fp16": (1, ["parallelism=dp", "precision=fp16"]),
           "tp2_fp16": (2, ["parallelism=tp2", "precision=fp16"])}


def gpt_parameters(layers: int, hidden: int, vocab: int) -> int:
    """Transformer blocks (12 x hidden^2 each) plus the tied embedding."""
    return 12 * layers * hidden ** 2 + vocab * hidden


def llama_matmul_parameters(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                            vocab: int) -> int:
    """The weights a token multiplies through in megatron_llama: q/k/v (kv_heads key/value
    heads), the attention output, SwiGLU's three matrices per block, and the output layer."""
    kv = hidden // heads * kv_heads
    return layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * ffn) \
        + vocab * hidden


def flop_parameters(args, vocab: int) -> int:
    if "llama" in args.model:
        return llama_matmul_parameters(args.layers, args.hidden, args.heads,
                                       args.kv_heads or args.heads, args.ffn, vocab)
    return gpt_parameters(args.layers, args.hidden, vocab)


def run(name: str, work: Path, args, data: dict) -> dict:
    nproc, layout = LAYOUTS[name]
    out = work / f"run_{name}"
    command = [sys.executable, "-m", "rapidformer", "+recipe=gpt_pretrain",
               f"model={args.model}", f"model.hidden_size={args.hidden}",
               f"model.num_layers={args.layers}", f"model.num_attention_heads={args.heads}",
               f"model.intermediate_size={args.ffn}",
               *([f"model.num_key_value_heads={args.kv_heads}"] if args.kv_heads else []),
               f"model.max_position_embeddings={args.seq}", f"data.max_seq_length={args.seq}",
               f"data.path={data['prefix']}", f"model.tokenizer={data['vocab']}",
               f"model.merge_file={data['merges']}",
               *([] if any(o.startswith("precision=") for o in layout)
                 else [f"precision={args.precision}"]),
               *layout, f"launcher.nproc_per_node={nproc}",
               f"trainer.micro_batch_size={args.micro}",
               f"trainer.global_batch_size={args.global_batch}",
               f"trainer.train_iters={args.iters}", "trainer.log_interval=5",
               "trainer.eval_iters=0", "trainer.export_hf=false", "trainer.progress_bar=false",
               "trainer.save_last=false", f"trainer.output_dir={out}", *args.set]
    log_path = Path(args.logs or work) / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # its own session: a layout that hangs is killed with all its worker processes
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"layout": name, "error": f"no result within {args.run_timeout} s "
                                             f"(log: {log_path})"}
    if returncode != 0:
        lines = log_path.read_text().strip().splitlines() or ["?"]
        return {"layout": name, "error": lines[-1][:300]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][1:]  # the first window holds warm-up
    tokens_per_s = sum(r["tokens_per_s"] for r in steps) / len(steps)
    return {"layout": name, "gpus": nproc, "tokens_per_s": round(tokens_per_s),
            "tokens_per_s_per_gpu": round(tokens_per_s / nproc),
            "peak_mem_gb_rank0": round(max(r.get("peak_mem_gb", 0.0) for r in steps), 2),
            "final_loss": round(steps[-1]["loss"], 4),
            **({"skipped_steps": steps[-1]["skipped_steps"]} if "skipped_steps" in steps[-1] else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", nargs="+", default=["one", "tp2", "pp2", "dp2"],
                        choices=list(LAYOUTS))
    parser.add_argument("--model", default="megatron_gpt")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads (megatron_llama); default: one per head")
    parser.add_argument("--ffn", type=int, default=None, help="MLP width; default 4 x hidden")
    parser.add_argument("--vocab", type=int, default=None,
                        help="pad the generated tokenizer to this many entries (e.g. 128256)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--mb", type=float, default=30.0, help="generated corpus, MiB")
    parser.add_argument("--out", default="docs/benchmarks/megatron_layouts.json")
    parser.add_argument("--logs", default=None, help="keep each layout's log here")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds per layout")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more overrides for every layout, e.g. graph=compile")
    args = parser.parse_args()
    args.ffn = args.ffn or 4 * args.hidden
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-megatron-") as temp:
        work = Path(temp)
        data = gpt_mmap_data(work, args.mb, vocab_size=args.vocab)
        vocab_size = len(json.loads(Path(data["vocab"]).read_text()))
        params = flop_parameters(args, vocab_size)
        per_token = flops_per_token(params, args.layers, args.hidden, args.seq)
        result = {"date": datetime.date.today().isoformat(), "device": device,
                  "model_config": args.model, "overrides": args.set,
                  "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                            "kv_heads": args.kv_heads or args.heads, "ffn": args.ffn,
                            "seq": args.seq, "vocab": vocab_size, "params": params},
                  "micro_batch": args.micro, "global_batch": args.global_batch,
                  "iterations": args.iters, "precision": args.precision,
                  "flops_per_token": per_token, "rows": rows}
        for name in args.layouts:
            row = run(name, work, args, data)
            if peak and "tokens_per_s" in row:
                row["mfu"] = round(row["tokens_per_s_per_gpu"] * per_token / peak, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            # after every layout: a run cut short still leaves the rows it measured
            write_report(args.out, result)
    finish(args.out, result)


if __name__ == "__main__":
    main()
