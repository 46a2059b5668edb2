"""Compile time of graph=compile by scope: each transformer block (regional, the default) or the
whole model, as the number of layers grows; eager as the baseline, in the same run.

    python benchmarks/compile_time.py                       # BERT, hidden 256, 2 and 8 layers
    python benchmarks/compile_time.py --layers 4 12 --hidden 768

Each row is a real `python -m rapidformer` run (the quickstart task on the generated pair data,
one process) with a fresh inductor cache; the first step's time is read from metrics.jsonl
(log_interval=1: the first window is the first step, compile included), and the steady step time
is the median of the later steps. Writes docs/benchmarks/compile_time.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _report import finish

BATCH = 16


def run(layers: int, hidden: int, scope: str | None, work: Path, steps: int) -> dict:
    out = work / f"{scope or 'eager'}_{layers}"
    graph = ["graph=eager"] if scope is None else ["graph=compile", f"graph.scope={scope}"]
    command = [sys.executable, "-m", "rapidformer", "model=bert_tiny",
               f"model.num_layers={layers}", f"model.hidden_size={hidden}",
               f"model.intermediate_size={4 * hidden}", "model.num_attention_heads=4", *graph,
               f"trainer.train_iters={steps}", f"trainer.micro_batch_size={BATCH}",
               f"trainer.global_batch_size={BATCH}", "trainer.log_interval=1",
               "trainer.export_hf=false",
               "trainer.progress_bar=false", "trainer.tensorboard=false",
               "trainer.eval_interval=1000000", f"trainer.output_dir={out}"]
    # a fresh inductor cache per run: otherwise the second run reuses the first one's kernels
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor_{out.name}")}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"layers": layers, "scope": scope or "eager",
                "error": (result.stderr.strip().splitlines() or ["?"])[-1][:300]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [BATCH / r["samples_per_s"] for r in records if "loss" in r]
    first, steady = step_s[0], statistics.median(step_s[2:])
    return {"layers": layers, "scope": scope or "eager", "first_step_s": round(first, 2),
            "steady_step_ms": round(1000 * steady, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="docs/benchmarks/compile_time.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-compile-") as temp:
        for layers in args.layers:
            for scope in (None, "blocks", "model"):
                row = run(layers, args.hidden, scope, Path(temp), args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() \
        or "cpu"
    result = {"date": datetime.date.today().isoformat(), "device": device,
              "cpus": os.cpu_count(), "torch": torch.__version__, "hidden": args.hidden,
              "steps": args.steps, "rows": rows}
    finish(args.out, result)


if __name__ == "__main__":
    main()
