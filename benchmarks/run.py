"""The speed suite: plain Hugging Face (eager, torch.compile) and rapidformer side by side, in one
process on one GPU, on the same models, batches and kernels.

    python benchmarks/run.py --suite h200          # the four workloads, bf16, on a GPU
    python benchmarks/run.py --smoke               # tiny shapes on a CPU in well under a minute
    # two GPUs, half the wall time: one process per GPU, then one result
    CUDA_VISIBLE_DEVICES=0 python benchmarks/run.py --workloads gpt_1p3b --out-dir a &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/run.py --workloads bert_mlm gpt2_124m bert_mrpc \
        --out-dir b; wait
    python benchmarks/run.py --merge a/benchmarks/results.json b/benchmarks/results.json

Workloads (models built from configs, random weights, random tokens: nothing is downloaded):
bert_mlm (BERT-base masked LM, seq 512), gpt2_124m (GPT-2 small, seq 1024), gpt_1p3b (GPT-2
shape at 24 x 2048, seq 2048), bert_mrpc (BERT-base sequence classification, seq 128).
Systems: `hf-eager` and `hf-compile` are hand-written loops (SDPA attention, fused AdamW, bf16
autocast, clipping); `rapidformer` is the same model through RapidformerEngine's own-loop API
(`compose`, `autocast`, `backward`, `step`) with `graph=compile` (its default scope: the whole
model here); `rapidformer-blocks` compiles per transformer block (the scope under FSDP2/ZeRO);
`rapidformer-cudagraphs` adds `graph.mode=reduce-overhead` (CUDA graphs: for launch-bound small
batches); `rapidformer-eager` isolates the framework's overhead against `hf-eager`,
`rapidformer-fp32` (TF32 off) gives the AMP speed-up, and `rapidformer-bf16-weights` keeps bf16
weights with fp32 master copies (DeepSpeed ZeRO-1 on one GPU) instead of casting fp32 weights;
`rapidformer-fsdp` does the same with FSDP2's mixed precision on one GPU (bf16 compute, fp32
master weights and gradient reduction), and `rapidformer-tuned` adds inductor's coordinate
descent tuning of its generated kernels (`graph.options.coordinate_descent_tuning=true`). Tokens/s counts every token of the batch
(no padding here); MFU follows rapidformer/observability/flops.py; warm-up s is the first steps' time, compile
included (the inductor cache is shared within a process, so a later system may reuse an earlier
one's kernels). Writes the rows to docs/benchmarks/results.json and the table between the suite
markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from _report import write_report

from rapidformer.observability.flops import flops_per_token, peak_flops

MARK_START, MARK_END = "<!-- suite:start -->", "<!-- suite:end -->"
# name -> (architecture, layers, hidden, heads, seq, micro batch, vocab)
WORKLOADS = {"bert_mlm": ("bert_mlm", 12, 768, 12, 512, 32, 30522),
             "gpt2_124m": ("gpt", 12, 768, 12, 1024, 16, 50257),
             "gpt_1p3b": ("gpt", 24, 2048, 16, 2048, 8, 50257),
             "bert_mrpc": ("bert_cls", 12, 768, 12, 128, 32, 30522)}
SMOKE = {name: (arch, 2, 64, 4, 64, 4, 500) for name, (arch, *_rest) in WORKLOADS.items()}
SYSTEMS = ["hf-eager", "hf-compile", "rapidformer", "rapidformer-blocks",
           "rapidformer-cudagraphs", "rapidformer-eager", "rapidformer-fp32",
           "rapidformer-bf16-weights", "rapidformer-fsdp", "rapidformer-tuned"]


def build_model(arch: str, layers: int, hidden: int, heads: int, seq: int, vocab: int):
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              GPT2Config, GPT2LMHeadModel)

    if arch == "gpt":
        config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                            vocab_size=vocab, attn_implementation="sdpa")
        return GPT2LMHeadModel(config)
    config = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=max(seq, 512),
                        vocab_size=vocab, attn_implementation="sdpa")
    return BertForMaskedLM(config) if arch == "bert_mlm" else BertForSequenceClassification(config)


def batch_for(arch: str, batch: int, seq: int, vocab: int, device) -> dict:
    """GPT batches are pretraining batches: packed documents, so no padding and no mask (as
    Megatron, nanoGPT and torchtitan feed them); BERT batches carry their padding mask."""
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if arch == "gpt":
        return {"input_ids": ids, "labels": ids}
    labels = torch.randint(0, 2, (batch,), device=device) if arch == "bert_cls" else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def measure(step, warmup: int, steps: int, device) -> tuple[float, float]:
    """(seconds of the `warmup` steps, where compile happens; seconds per step after them);
    syncs only at the ends."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmed = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return warmed - started, (time.perf_counter() - warmed) / steps


def hf_loop(model, batch: dict, device, compiled: bool, dtype):
    """The plain loop a careful user writes: fused AdamW, autocast, clipping, no host syncs."""
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())

    def step():
        with autocast:
            loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def rapidformer_loop(model, batch: dict, overrides: list[str], work: Path):
    from rapidformer.config.compose import compose, resolve
    from rapidformer.engine import RapidformerEngine

    _, cfg = resolve(compose(["model=bert_tiny", "trainer.train_iters=1000", "trainer.lr=1e-4",
                              "trainer.clip_grad=1.0", *overrides]), str(work))
    engine = RapidformerEngine(cfg=cfg, run_dir=work)
    model, _, _ = engine.compose(model, total_iters=1000)

    def step():
        with engine.autocast():
            loss = model(**batch).loss
        engine.backward(loss)
        engine.step()
    return step


def run_row(name: str, shape: tuple, system: str, args, device, work: Path) -> dict:
    arch, layers, hidden, heads, seq, micro, vocab = shape
    torch.manual_seed(0)
    model = build_model(arch, layers, hidden, heads, seq, vocab)
    parameters = sum(p.numel() for p in model.parameters())
    batch = batch_for(arch, micro, seq, vocab, device)
    dtype = torch.float32 if args.smoke and device.type == "cpu" else torch.bfloat16
    precision = "fp32" if dtype == torch.float32 else "bf16"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        # TF32 off for the fp32 row (the seed's AMP vs FP32 comparison); on elsewhere
        torch.backends.cuda.matmul.allow_tf32 = system != "rapidformer-fp32"
    if system.startswith("hf-"):
        step = hf_loop(model, batch, device, system == "hf-compile", dtype)
    else:
        overrides = {"rapidformer": [f"precision={precision}", "graph=compile"],
                     "rapidformer-blocks": [f"precision={precision}", "graph=compile",
                                            "graph.scope=blocks"],
                     "rapidformer-cudagraphs": [f"precision={precision}", "graph=compile",
                                                "graph.mode=reduce-overhead"],
                     "rapidformer-eager": [f"precision={precision}"],
                     # DeepSpeed's bf16 weights with fp32 masters (ZeRO-1 of one GPU): no
                     # per-step casts of fp32 weights under autocast
                     "rapidformer-bf16-weights": [f"precision={precision}", "graph=compile",
                                                  "memory=zero1"],
                     "rapidformer-fsdp": [f"precision={precision}", "graph=compile",
                                          "memory=fsdp"],
                     "rapidformer-tuned": [f"precision={precision}", "graph=compile",
                                           "graph.options.coordinate_descent_tuning=true"],
                     "rapidformer-fp32": ["precision=fp32"]}[system]
        step = rapidformer_loop(model, batch, [*overrides, f"trainer.device={device.type}"],
                                work / f"{name}_{system}")
    warmup_s, seconds = measure(step, args.warmup, args.steps, device)
    tokens_per_s = micro * seq / seconds
    peak = peak_flops(device)
    row = {"workload": name, "system": system, "precision": precision if system !=
           "rapidformer-fp32" else "fp32", "params": parameters, "seq": seq, "micro_batch": micro,
           "tokens_per_s": round(tokens_per_s, 1),
           "mfu": round(tokens_per_s * flops_per_token(parameters, layers, hidden, seq) / peak, 4)
           if peak else None,
           "peak_mem_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
           if device.type == "cuda" else None,
           "warmup_s": round(warmup_s, 1)}
    del model, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def command_of(argv: list[str]) -> str:
    """The command as a reader would type it: without --out-dir (a path on the run's machine)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--out-dir":
            skip = not skip
            continue
        kept.append(arg)
    return " ".join(["python benchmarks/run.py", *kept])


def markdown(rows: list[dict]) -> str:
    """One table per command (a run, or one of several runs merged with --merge); ratios are
    against hf-compile of the same workload in the same run."""
    lines = [MARK_START]
    for command in dict.fromkeys(r["command"] for r in rows):
        run = [r for r in rows if r["command"] == command]
        first = run[0]
        lines += ["", f"{first['date']}, {first['gpu']}, torch {first['versions']['torch']}, "
                      f"transformers {first['versions']['transformers']}; `{command}`"
                  + (" (smoke: tiny shapes, a plumbing check, not a speed result)"
                     if "--smoke" in command else "")
                  + (f". {first['note']}." if first.get("note") else ""), "",
                  "| workload | system | precision | tokens/s | vs hf-compile | MFU | peak GB | "
                  "warm-up s |", "|---|---|---|---|---|---|---|---|"]
        base = {r["workload"]: r["tokens_per_s"] for r in run if r["system"] == "hf-compile"
                and "error" not in r}
        for r in run:
            if "error" in r:
                lines.append(f"| {r['workload']} | {r['system']} | failed: {r['error']} "
                             f"| | | | | |")
                continue
            ratio = (f"{r['tokens_per_s'] / base[r['workload']]:.2f}x" if r["workload"] in base
                     else "-")
            mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
            mem = r["peak_mem_gb"] if r["peak_mem_gb"] is not None else "-"
            lines.append(f"| {r['workload']} | {r['system']} | {r['precision']} | "
                         f"{r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {mem} | "
                         f"{r.get('warmup_s', '-')} |")
        done = [r for r in run if "error" not in r]
        overhead = {r["workload"]: r["tokens_per_s"] for r in done
                    if r["system"] == "rapidformer-eager"}
        eager = {r["workload"]: r["tokens_per_s"] for r in done if r["system"] == "hf-eager"}
        for workload in [w for w in overhead if w in eager]:
            lines.append(f"\nFramework overhead, {workload}: rapidformer-eager runs at "
                         f"{overhead[workload] / eager[workload]:.3f}x the tokens/s of the "
                         f"hand-written eager loop (target: at least 0.98).")
    return "\n".join([*lines, "", MARK_END])


def write_table(doc: Path, table: str) -> None:
    text = doc.read_text() if doc.exists() else ""
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + table + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Speed suite\n\n" + table + "\n"
    doc.write_text(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default="h200", choices=["h200"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, eager systems, CPU")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out-dir", default="docs")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS_JSON", default=None,
                        help="write the rows of earlier runs (e.g. one per GPU) as one result")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if args.merge:
        rows = [row for path in args.merge for row in json.loads(Path(path).read_text())]
        write_report(out / "benchmarks" / "results.json", rows)
        write_table(out / "benchmarks.md", markdown(rows))
        print(f"merged {len(rows)} rows into {out / 'benchmarks' / 'results.json'}")
        return
    shapes = SMOKE if args.smoke else WORKLOADS
    systems = args.systems or (["hf-eager", "rapidformer-eager", "rapidformer-fp32"] if args.smoke
                               else SYSTEMS)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 20)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    import transformers

    meta = {"date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda"
            else f"CPU ({platform.machine()})",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "command": command_of(sys.argv[1:] if argv is None else argv)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-suite-") as temp:
        for name in args.workloads:
            for system in systems:
                try:
                    row = run_row(name, shapes[name], system, args, device, Path(temp))
                except Exception as exc:  # one failed system must not cost the other rows
                    row = {"workload": name, "system": system,
                           "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append({**row, **meta})
                print(json.dumps(rows[-1]), flush=True)
                # after every row: a run cut short still leaves what it measured
                write_report(out / "benchmarks" / "results.json", rows)
    write_table(out / "benchmarks.md", markdown(rows))
    print(f"wrote {out / 'benchmarks' / 'results.json'} and the table in {out / 'benchmarks.md'}")
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
