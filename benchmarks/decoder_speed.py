"""Decoder pretraining speed: rapidformer through its CLI (`+recipe=llama_pretrain`: a Llama
3.2 1B-shaped model, bf16, torch.compile) in bf16, float8 (precision=fp8), with liger-kernel
(kernels=liger) and with fused q|k|v and gate|up projections (kernels.fused_projections=true),
against a plain Hugging Face + torch.compile loop on the same samples, in one call on one GPU.

Data: the project's generated documents as Megatron mmap files, GPT-2 BPE trained on them and
the vocabulary padded to GPT-2's 50,257 entries (the output head of a real model). Seq 2048,
micro batch 8, constant lr 3e-4, AdamW (fused), clipping 1.0, every system the same samples in
the same order.

    python benchmarks/decoder_speed.py                              # GPU: every row
    python benchmarks/decoder_speed.py --rows hf-compile rf-bf16 rf-fp8 --iters 200
    python benchmarks/decoder_speed.py --rows hf-compile rf-bf16 rf-bf16-fused rf-fp8 rf-fp8-fused
    python benchmarks/decoder_speed.py --smoke                      # CPU, tiny, a few steps
    python benchmarks/decoder_speed.py --rows hf-compile rf-bf16 rf-fp8 --iters 80 --profile 61 65

Each row: tokens/s and MFU (bf16 peak) over the log windows after step 20, peak GB, the first
step's seconds, and the loss curve (each log window's mean loss). Writes
docs/benchmarks/decoder_speed.json. With `--profile FIRST LAST` every row also carries
`profile`, the device's time per step by kernel kind and the top kernels over those steps
(rapidformer: trainer.profile_steps; the plain loop: the same torch.profiler summary), and the
log windows holding the profiled steps are left out of the rates (the profiler slows them).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _data import gpt_mmap_data
from _report import finish_speed_rows, keep_log, run_cli

RF_ROWS = {"rf-bf16": [],
           "rf-fp8": ["precision=fp8"],
           "rf-fp8-rowwise": ["precision=fp8", "precision.fp8_scaling=rowwise"],
           "rf-liger": ["kernels=liger"],
           "rf-fp8-liger": ["precision=fp8", "kernels=liger"],
           # q|k|v and gate|up as one linear layer each (float8 then takes the 512-wide k/v too)
           "rf-bf16-fused": ["kernels.fused_projections=true"],
           "rf-fp8-fused": ["precision=fp8", "kernels.fused_projections=true"]}
HF_ROWS = ("hf-compile",)
VOCAB_SIZE = 50257
LOG_INTERVAL = 10
SKIP = 20  # the first steps (compile, warm-up) are not in the means


def common(data: dict, args) -> list[str]:
    return ["+recipe=llama_pretrain", f"model={args.model}", f"data.path={data['prefix']}",
            f"model.tokenizer={data['vocab']}", f"model.merge_file={data['merges']}",
            f"data.max_seq_length={args.seq}", f"trainer.train_iters={args.iters}",
            f"trainer.micro_batch_size={args.batch}", f"trainer.global_batch_size={args.batch}",
            "trainer.lr=3e-4", "scheduler=constant", f"trainer.log_interval={LOG_INTERVAL}",
            "trainer.eval_iters=1", "trainer.export_hf=false", "trainer.progress_bar=false",
            "trainer.save_last=false", "data.num_workers=2", *args.overrides]


def profiled_window(step: int, args) -> bool:
    """Whether the log window ending at `step` holds a profiled step."""
    if not args.profile:
        return False
    first, last = args.profile
    return step - LOG_INTERVAL < last and step >= first


def profile_digest(summary: dict) -> dict:
    """A row's profile: the time per step by kind and the longest kernels."""
    keep = ("steps", "kernel_ms_per_step", "wall_ms_per_step", "busy_frac", "kinds",
            "top_kernels")
    return {k: summary[k] for k in keep if k in summary}


def rapidformer_row(row: str, data: dict, args, work: Path) -> dict:
    profiling = [f"trainer.profile_steps=[{args.profile[0]},{args.profile[1]}]"] \
        if args.profile else []
    command = [sys.executable, "-m", "rapidformer", *common(data, args), *RF_ROWS[row],
               *profiling, f"trainer.output_dir={work / row}"]
    base, result, windows = run_cli(row, command, work)
    if windows is None:
        return base
    timed = [r for r in windows if not profiled_window(r["step"], args)] or windows
    later = [r for r in timed if r["step"] > SKIP] or timed
    mean = lambda key: sum(r.get(key) or 0 for r in later) / len(later)
    first = re.search(r"first step compiled and ran in ([\d.]+) s", result.stderr + result.stdout)
    float8 = re.search(r"(\d+) linear layers in float8", result.stderr + result.stdout)
    return {**base, "tokens_per_s": round(mean("tokens_per_s")),
            "mfu": round(mean("mfu"), 4) if any("mfu" in r for r in later) else None,
            "peak_mem_gb": round(max(r.get("peak_mem_gb", 0) for r in windows), 2),
            "first_step_s": float(first.group(1)) if first else None,
            "float8_layers": int(float8.group(1)) if float8 else 0,
            "loss_curve": [round(r["loss"], 4) for r in windows],
            "loss_at_end": round(windows[-1]["loss"], 4), **profile_of(work / row, args)}


def profile_of(run_dir: Path, args) -> dict:
    table = run_dir / "profile" / "kernels_rank0.json"
    if not args.profile:
        return {}
    if not table.is_file():
        return {"profile": {"error": f"no {table.name}: the run wrote no profile"}}
    return {"profile": profile_digest(json.loads(table.read_text()))}


def hf_row(row: str, data: dict, args, work: Path) -> dict:
    command = [sys.executable, __file__, "--hf-child", "--hf-data", json.dumps(data),
               "--iters", str(args.iters), "--batch", str(args.batch), "--seq", str(args.seq),
               "--model", args.model, *(["--smoke"] if args.smoke else []),
               *(["--profile", *map(str, args.profile)] if args.profile else [])]
    result = subprocess.run(command, capture_output=True, text=True)
    keep_log(row, result)
    base = {"row": row, "command": "plain Hugging Face LlamaForCausalLM + torch.compile, "
                                   "same samples"}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return {**base, **json.loads(result.stdout.strip().splitlines()[-1])}


def hf_child(args) -> None:
    """LlamaForCausalLM of the same shape compiled, fused AdamW at a constant lr, bf16 autocast,
    clipping, on the megatron-core samples rapidformer reads: the loop a user writes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidformer.config.compose import compose, resolve
    from rapidformer.data.megatron import build_gpt_datasets
    from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer
    from rapidformer.observability.flops import flops_per_token, peak_flops

    data = json.loads(args.hf_data)
    _, cfg = resolve(compose(common(data, args)), tempfile.mkdtemp())
    tokenizer = load_pretraining_tokenizer(cfg.model)
    d, m = cfg.data, cfg.model
    train, _, _ = build_gpt_datasets(d.path, tokenizer, d.split, [args.iters * args.batch, 0, 0],
                                     d.max_seq_length, cfg.trainer.seed,
                                     path_to_cache=tempfile.mkdtemp())
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, num_workers=2,
                                         pin_memory=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.trainer.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    forward = model if args.smoke else torch.compile(model)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if not args.smoke
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    from rapidformer.observability.step_profiler import kernel_summary

    losses, started, first_step = [], None, None
    prof, profiled_s, profile = None, 0.0, None
    t0 = time.perf_counter()
    for step, batch in enumerate(loader, 1):
        if args.profile and step == args.profile[0]:
            sync()
            prof = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU,
                *([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])])
            prof.__enter__()
            profile_t0 = time.perf_counter()
        ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with autocast:
            logits = forward(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 1:
            sync()
            first_step = time.perf_counter() - t0
        if prof is not None and step == args.profile[1]:
            sync()
            wall = time.perf_counter() - profile_t0
            prof.__exit__(None, None, None)
            profile = profile_digest(kernel_summary(prof, device.type,
                                                    step - args.profile[0] + 1, wall))
            prof = None
            profiled_s = time.perf_counter() - profile_t0  # not in the rate
        if step == SKIP:
            sync()
            started = time.perf_counter()
        if step == args.iters:
            break
    sync()
    elapsed = time.perf_counter() - (started or t0) - profiled_s
    timed_steps = len(losses) - SKIP
    if profile is not None:
        timed_steps -= args.profile[1] - args.profile[0] + 1
    tokens_per_s = max(timed_steps, 1) * args.batch * args.seq / elapsed
    parameters = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    curve = [round(float(sum(losses[i:i + LOG_INTERVAL]) / LOG_INTERVAL), 4)
             for i in range(0, len(losses) - LOG_INTERVAL + 1, LOG_INTERVAL)]
    print(json.dumps({
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * flops_per_token(parameters, m.num_layers, m.hidden_size,
                                                    args.seq) / peak, 4) if peak else None,
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda" else None,
        "first_step_s": round(first_step, 1), "loss_curve": curve,
        "loss_at_end": curve[-1] if curve else None,
        **({"profile": profile or {"error": "the run ended before the profiled steps"}}
           if args.profile else {})}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=[*HF_ROWS, *RF_ROWS],
                        choices=[*HF_ROWS, *RF_ROWS])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb", type=float, default=40.0, help="the corpus's MiB")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: llama_tiny, seq 64, eager fp32, emulated float8")
    parser.add_argument("--out", default="docs/benchmarks/decoder_speed.json")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--profile", nargs=2, type=int, metavar=("FIRST", "LAST"),
                        help="profile these steps of every row (after step 20: not in the rate)")
    parser.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.overrides = [*args.overrides, "trainer.device=cpu", "graph=eager", "precision=fp32"]
        args.model, args.seq, args.mb = "llama_tiny", 64, min(args.mb, 1.0)
        if not args.hf_child:
            args.iters, args.batch = 30, 4
            args.rows = [r for r in args.rows if "liger" not in r]
            RF_ROWS.update({row: [*extra, "precision.fp8_emulate=true",
                                  "precision.fp8_skip_small=false"]
                            for row, extra in RF_ROWS.items() if "fp8" in row})
    if args.profile and not SKIP < args.profile[0] <= args.profile[1] <= args.iters:
        parser.error(f"--profile {args.profile[0]} {args.profile[1]}: give steps after {SKIP} "
                     f"and at most --iters ({args.iters}), the first not after the last")
    if args.hf_child:
        return hf_child(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-decoder-speed-") as temp:
        work = Path(temp)
        data = gpt_mmap_data(work, args.mb, vocab_size=VOCAB_SIZE)
        for row in args.rows:
            runner = hf_row if row in HF_ROWS else rapidformer_row
            rows.append(runner(row, data, args, work))
            print(json.dumps(rows[-1]), flush=True)
    finish_speed_rows(args, rows, "hf-compile")


if __name__ == "__main__":
    main()
