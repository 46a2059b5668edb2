"""The memory plan's estimates against measured peaks: for each memory mode, one real
`python -m rapidformer` run (GPT pretraining on generated data, a few steps) and the estimate
`rapidformer plan` gives for the same config, side by side.

    python benchmarks/memory_plan.py                       # one GPU: GPT ~350M, bf16, 11 modes
    python benchmarks/memory_plan.py --concurrent 3        # 3 runs at a time on the GPU
    python benchmarks/memory_plan.py --smoke               # CPU: 2 tiny runs, estimates only
    python benchmarks/memory_plan.py --reestimate docs/benchmarks/memory_plan.json   # new formula, old peaks

The measured peak is torch's max_memory_allocated on rank 0 over the training steps (what the
run logs as peak_mem_gb); the estimate counts the same thing (not the CUDA context, which the
fit check adds separately). Writes docs/benchmarks/memory_plan.json and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _report import portable_command

GB = 2**30
GPT_350M = ["model.hidden_size=1024", "model.num_layers=24", "model.num_attention_heads=16",
            "model.intermediate_size=4096", "model.max_position_embeddings=1024"]
MODES = [  # (memory, offload optimizer, offload params, activation checkpointing)
    ("none", False, False, False), ("zero1", False, False, False),
    ("zero2", False, False, False), ("zero3", False, False, False),
    ("fsdp", False, False, False), ("none", False, False, True),
    ("zero3", False, False, True), ("fsdp", False, False, True),
    ("zero2", True, False, True), ("zero3", True, True, True), ("fsdp", True, True, True)]


def make_data(work: Path, vocab_size: int, docs: int) -> list[str]:
    from rapidformer.data.corpus import iter_documents, write_corpus, write_gpt2_bpe
    from rapidformer.data.preprocess_data import main as preprocess

    write_corpus(work / "corpus.json", num_docs=docs, seed=5)
    vocab, merges = write_gpt2_bpe(list(iter_documents(docs, seed=5)), work / "gpt2",
                                   vocab_size=vocab_size)
    preprocess(["--input", str(work / "corpus.json"), "--output-prefix", str(work / "gpt"),
                "--vocab-file", str(vocab), "--merge-file", str(merges),
                "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "4"])
    return ["+recipe=gpt_pretrain", "data=megatron", f"data.path={work}/gpt_text_document",
            "model.tokenizer_type=GPT2BPETokenizer", f"model.tokenizer={vocab}",
            f"model.merge_file={merges}"]


def mode_overrides(memory, offload_optimizer, offload_params, checkpointing) -> list[str]:
    from rapidformer.planning.memory_plan import Mode

    return Mode(memory, offload_optimizer, offload_params, checkpointing).overrides()


def estimate_gb(overrides: list[str]) -> tuple[float, int, int]:
    from rapidformer.config.compose import compose, resolve
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import model_shape

    _, cfg = resolve(compose(overrides))
    mode = Mode(cfg.memory.name, cfg.memory.offload_optimizer, cfg.memory.offload_params,
                cfg.trainer.checkpoint_activations)
    shape = model_shape(cfg)
    import torch

    return estimate(shape, cfg, mode, on_gpu=torch.cuda.is_available()).total / GB, \
        shape.parameters, shape.vocab


def reestimate(path: Path, vocab: int) -> None:
    """Recompute a results file's estimates with this version of the plan (the estimates are
    arithmetic; the measured peaks stay those of the GPU run)."""
    meta = json.loads(path.read_text())
    placeholders = ["+recipe=gpt_pretrain", "data.path=DATA", "model.tokenizer=VOCAB",
                    "model.merge_file=MERGES"]
    from rapidformer.config.compose import compose, resolve
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import model_shape

    for row in meta["rows"]:
        # the tokenizer the data was made with (its files are gone): its size
        size = f"model.vocab_size={row.get('vocab', vocab)}"
        _, cfg = resolve(compose([*placeholders, size, *row["overrides"].split()]))
        mode = Mode(cfg.memory.name, cfg.memory.offload_optimizer, cfg.memory.offload_params,
                    cfg.trainer.checkpoint_activations)
        row["estimate_gb"] = estimate(model_shape(cfg), cfg, mode, on_gpu=True).total / GB
        if row.get("measured_gb"):
            row["error_pct"] = 100 * (row["estimate_gb"] - row["measured_gb"]) / row["measured_gb"]
    meta["estimates"] = "recomputed by benchmarks/memory_plan.py --reestimate"
    path.write_text(json.dumps(meta, indent=1))
    print_table(meta["rows"])


def print_table(rows: list[dict]) -> None:
    print("| mode | estimate GB | measured peak GB | error |\n|---|---|---|---|")
    for r in rows:
        measured = f"{r['measured_gb']:.2f}" if r.get("measured_gb") else r.get("error", "-")
        error = f"{r['error_pct']:+.0f} %" if "error_pct" in r else "-"
        print(f"| {r['mode']} | {r['estimate_gb']:.2f} | {measured} | {error} |")


def run_one(overrides: list[str], out: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "rapidformer", *overrides,
                             f"trainer.output_dir={out}"], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [l for l in result.stderr.splitlines() if l.strip()]
        return {"error": next((l for l in lines if "rapidformer: error" in l), lines[-1][:300])}
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_mem_gb"] for r in records if r.get("peak_mem_gb")]
    return {"measured_gb": max(peaks) if peaks else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", default="bf16")
    # BPE merges to learn; the generated corpus stops far below (the size used is recorded)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--concurrent", type=int, default=1)
    parser.add_argument("--out", default="docs/benchmarks/memory_plan.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reestimate", type=Path, help="recompute this results file's estimates")
    args = parser.parse_args()
    if args.reestimate:
        return reestimate(args.reestimate, args.vocab)
    work = Path(tempfile.mkdtemp(prefix="rapidformer-memplan-"))
    base = make_data(work, 400 if args.smoke else args.vocab, 300 if args.smoke else 3000)
    shape = ["model=gpt2_tiny", "data.max_seq_length=64"] if args.smoke else \
        [*GPT_350M, f"data.max_seq_length={args.seq}"]
    common = [*base, *shape, f"precision={args.precision}", "trainer.train_iters=6",
              "trainer.log_interval=2", "trainer.eval_iters=0", f"trainer.micro_batch_size={args.micro}",
              f"trainer.global_batch_size={args.micro}", "trainer.save_last=false",
              "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.tensorboard=false"]
    modes = MODES[:2] if args.smoke else MODES
    jobs = [(m, [*common, *mode_overrides(*m)]) for m in modes]

    rows = []
    for mode, overrides in jobs:  # Hydra's compose state is global: estimates one at a time
        row = {"mode": "+".join(
            [mode[0], *[n for n, on in zip(("offload_optimizer", "offload_params", "ckpt"),
                                          mode[1:]) if on]]),
               "overrides": " ".join(o for o in overrides if o not in base)}
        row["estimate_gb"], row["parameters"], row["vocab"] = estimate_gb(overrides)
        rows.append((row, overrides))

    def measure(job):
        row, overrides = job
        row.update(run_one(overrides, work / f"run_{row['mode']}"))
        if row.get("measured_gb"):
            row["error_pct"] = 100 * (row["estimate_gb"] - row["measured_gb"]) / row["measured_gb"]
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(args.concurrent) as pool:
        rows = list(pool.map(measure, rows))
    import torch

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": portable_command("python benchmarks/memory_plan.py " + " ".join(sys.argv[1:])), "rows": rows}
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(meta, indent=1))
    print_table(rows)


if __name__ == "__main__":
    main()
