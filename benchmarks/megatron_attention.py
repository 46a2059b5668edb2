"""The core attention of a megatron-core GPT on one GPU: megatron-core's local
DotProductAttention against rapidformer's SDPAttention, eager and with each layer compiled.

    python benchmarks/megatron_attention.py --out megatron_attention.json   # GPT 1.3B, one GPU
    python benchmarks/megatron_attention.py --smoke --out smoke.json         # CPU, seconds
    python benchmarks/megatron_attention.py --model megatron_llama --layers 16 --hidden 2048 \
        --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --variants sdpa sdpa_compile \
        --out megatron_llama_1b.json                 # Llama 3.2 1B's shape, one GPU
    python benchmarks/megatron_attention.py --model megatron_llama --smoke --out smoke.json

The model is rapidformer's megatron-core GPT (rapidformer/models/megatron.py: local layers,
layout-independent weights, GPT-2's vocabulary padded to 50,304), 24 layers x hidden 2048 x 16
heads, FFN 8192, sequence 2048, dropout 0.1 (hidden and attention), trained the way the
Megatron strategy trains it: bf16 weights (Float16Module) with fp32 main weights in
megatron-core's optimizer (torch's fused AdamW on a GPU) and gradient buffers, megatron-core's
schedule, one optimizer step
per global batch (micro batch 8, no accumulation by default). The tokens are random (this is a
speed test: the loss stays near log(vocabulary)).

Variants (--variants), each in its own process (a crash or an out-of-memory in one leaves the
others' rows): `local` (model.attn_implementation=eager: scores, softmax and dropout on a
materialized [b x heads, s, s] matrix), `sdpa` (the default: torch's
scaled_dot_product_attention, FlashAttention / cuDNN on the GPU), `sdpa_compile` (the same with
graph=compile: each TransformerLayer compiled in place) and `local_compile`. Each row: tokens/s
over the timed steps (after --warmup steps, which hold torch.compile's compile), MFU (model FLOPs
per token, 6 x parameters + attention, rapidformer/observability/flops.py, against the GPU's
dense bf16 peak), peak GPU memory (GiB, torch.cuda.max_memory_allocated) and the losses of the
first and last steps; with --profile N, N more steps under torch.profiler after the timed ones,
their kernel time by kind (rapidformer/observability/step_profiler.py).

`--model megatron_llama` measures the Llama-family decoder instead (RMSNorm, SwiGLU, rotary
positions, --kv-heads key/value heads, an untied output layer, no dropout by default). Its MFU
counts the weights a token multiplies through: every block and the output layer, not the input
embedding, which is a lookup (with Llama 3's untied 128,256-entry vocabulary, counting it would
add 17 % to a 1B model's MFU); `parameters` in the row is every parameter.

Needs torch and megatron-core only (no Hydra or OmegaConf: the run config is rapidformer's
dataclass schema filled in here); rapidformer is imported from this checkout. --smoke: a 2-layer
model of hidden 64 on the CPU, the local and sdpa variants (torch.compile does not trace
megatron-core's CPU mapping, so the compiled variants are GPU-only and skipped there).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # rapidformer from this checkout, installed or not

from _report import finish, portable_command, write_report  # noqa: E402

# name: (model.attn_implementation, graph=compile)
VARIANTS = {"local": ("eager", False), "sdpa": ("sdpa", False),
            "sdpa_compile": ("sdpa", True), "local_compile": ("eager", True)}
GPT2_VOCAB = 50257


def run_config(args, attention: str, compiled: bool):
    """The run's config as rapidformer's dataclasses (what Hydra would compose)."""
    from rapidformer.config.schema import RunConfig

    cfg = RunConfig()
    m = cfg.model
    m.name, m.arch, m.source = args.model, args.model, "config"
    m.hidden_size, m.num_layers, m.num_attention_heads = args.hidden, args.layers, args.heads
    m.intermediate_size, m.max_position_embeddings = args.ffn, args.seq
    if args.model == "megatron_llama":
        m.num_key_value_heads, m.rope_theta = args.kv_heads, 500000.0  # Llama 3's base
    m.hidden_dropout = m.attention_dropout = args.dropout
    m.initializer_range = 0.02
    m.attn_implementation = attention
    cfg.data.max_seq_length = args.seq
    cfg.precision.name = cfg.precision.dtype = args.precision
    cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size = args.micro, args.global_batch
    cfg.trainer.lr, cfg.trainer.clip_grad = 1e-4, 1.0
    cfg.graph.name = "compile" if compiled else "eager"
    return cfg


def measure(args, name: str) -> dict:
    """One variant in this process: build, train --warmup + --iters steps, time the last."""
    import torch

    from rapidformer.accelerators import megatron_optimizer, parallel
    from rapidformer.accelerators.graph import compile_blocks
    from rapidformer.models.megatron import build_megatron_decoder, prepare_for_compile
    from rapidformer.observability.flops import flops_per_token, peak_flops

    attention, compiled = VARIANTS[name]
    cfg = run_config(args, attention, compiled)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    parallel.initialize(cfg, device)
    model = build_megatron_decoder(cfg, args.vocab)
    params = parallel.count_parameters(model)
    # FLOPs: an untied input embedding is a lookup, not a matmul (a tied one is the output layer)
    matmul_params = params - (model.embedding.word_embeddings.weight.numel()
                              if not model.share_embeddings_and_output_weights else 0)
    model = model.to(device)
    if compiled:
        prepare_for_compile()
        compile_blocks(model, cfg.graph, sharded=True)
    model = megatron_optimizer.wrap_model(model, cfg)
    optimizer = megatron_optimizer.build_optimizer(model, cfg)
    micro, seq = args.micro, args.seq
    accumulation = args.global_batch // micro
    generator = torch.Generator(device=device).manual_seed(0)
    pool = [torch.randint(0, args.vocab, (micro, seq + 1), device=device, generator=generator)
            for _ in range(4)]
    positions = torch.arange(seq, device=device).expand(micro, seq)

    def forward_step(iterator, model):
        ids = next(iterator)
        output = model(ids[:, :-1], positions, None, labels=ids[:, 1:])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def train_step(step: int) -> float:
        batches = iter(pool[(step * accumulation + i) % len(pool)] for i in range(accumulation))
        micro_losses = parallel.forward_backward(forward_step, batches, model, accumulation, seq,
                                                 micro)
        with torch.profiler.record_function("optimizer step"):
            optimizer.step()
            megatron_optimizer.zero_grad(model, optimizer)
        return float(sum(m["loss"] for m in micro_losses) / accumulation)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, start, warmup_s = [], time.perf_counter(), None
    for step in range(args.warmup + args.iters):
        if step == args.warmup:
            sync()
            warmup_s = time.perf_counter() - start
            start = time.perf_counter()
        losses.append(train_step(step))
    sync()
    elapsed = time.perf_counter() - start
    profile = None
    if args.profile:  # after the timed steps: the profiler's overhead is not in the rate
        from rapidformer.observability.step_profiler import kernel_summary

        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            profiled = time.perf_counter()
            for step in range(args.profile):
                train_step(args.warmup + args.iters + step)
            sync()
            profiled = time.perf_counter() - profiled
        profile = kernel_summary(prof, device.type, args.profile, profiled)
    tokens_per_s = args.iters * args.global_batch * seq / elapsed
    per_token = flops_per_token(matmul_params, args.layers, args.hidden, seq)
    peak = peak_flops(device)
    return {"variant": name, "attention": ("megatron-core DotProductAttention"
                                           if attention == "eager" else "SDPAttention"),
            "compiled": compiled, "parameters": params, "flop_parameters": matmul_params,
            "tokens_per_s": round(tokens_per_s), "step_ms": round(1000 * elapsed / args.iters, 1),
            "mfu": round(tokens_per_s * per_token / peak, 4) if peak else None,
            "peak_mem_gb": (round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
                            if cuda else None),
            "warmup_s": round(warmup_s, 1), "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4),
            **({"profile": profile} if profile else {})}


def run_variant(name: str, args, work: Path) -> dict:
    """measure() in a fresh process (its own CUDA context, allocator and compile caches)."""
    if args.smoke and VARIANTS[name][1]:
        return {"variant": name, "skipped": "torch.compile does not trace megatron-core's CPU "
                                            "mapping (megatron_cpu); a GPU variant"}
    row_path = work / f"{name}.json"
    command = [sys.executable, __file__, "--_variant", name, "--_row", str(row_path),
               *sys.argv[1:]]
    log_path = work / f"{name}.log"
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            return {"variant": name, "error": f"no result within {args.run_timeout} s"}
    if result.returncode != 0 or not row_path.exists():
        lines = log_path.read_text().strip().splitlines() or ["?"]
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            (Path(args.logs) / log_path.name).write_text(log_path.read_text())
        return {"variant": name, "error": lines[-1][:300]}
    return json.loads(row_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=["local", "sdpa", "sdpa_compile"])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--model", default="megatron_gpt",
                        choices=["megatron_gpt", "megatron_llama"])
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="megatron_llama's key/value heads (default: one per head)")
    parser.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per optimizer step (default: one micro batch)")
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    parser.add_argument("--dropout", type=float, default=None,
                        help="hidden and attention dropout (default 0.1; megatron_llama 0)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="a 2-layer model of hidden 64 on the CPU, 2 timed steps")
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    parser.add_argument("--logs", default=None, help="keep a failed variant's log here")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds per variant")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, this many more under torch.profiler: "
                             "each row gets its kernel time per step by kind and the longest "
                             "kernels (an `optimizer step` region: the step and zeroing)")
    parser.add_argument("--_variant", help=argparse.SUPPRESS)
    parser.add_argument("--_row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.heads, args.seq, args.micro = 2, 64, 4, 64, 2
        args.vocab, args.warmup, args.iters = 1000, 1, 2
        args.kv_heads, args.ffn = (2, 176) if args.model == "megatron_llama" else (None, None)
    llama = args.model == "megatron_llama"
    args.ffn = args.ffn or 4 * args.hidden
    args.dropout = (0.0 if llama else 0.1) if args.dropout is None else args.dropout
    args.global_batch = args.global_batch or args.micro
    if args.global_batch % args.micro:
        parser.error("--global-batch must be a multiple of --micro")
    if args._variant:  # the child process: one variant
        Path(args._row).write_text(json.dumps(measure(args, args._variant)))
        return

    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    result = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "versions": {"torch": torch.__version__, "megatron_core": _megatron_version()},
              "command": portable_command(" ".join(["python", *sys.argv])),
              "model": {"config": args.model, "layers": args.layers, "hidden": args.hidden,
                        "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
                        "ffn": args.ffn, "seq": args.seq, "vocab": args.vocab,
                        "dropout": args.dropout},
              "micro_batch": args.micro, "global_batch": args.global_batch,
              "precision": args.precision, "warmup_steps": args.warmup, "timed_steps": args.iters,
              "rows": []}
    with tempfile.TemporaryDirectory(prefix="rapidformer-megatron-attention-") as temp:
        for name in args.variants:
            row = run_variant(name, args, Path(temp))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_report(args.out, result)  # a run cut short keeps the rows it measured
    finish(args.out, result)


def _megatron_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # carried on PYTHONPATH without its metadata
        return None


if __name__ == "__main__":
    main()
