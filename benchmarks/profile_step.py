"""Where a training step's GPU time goes: the torch profiler over a few steps of one speed-suite
workload and system, kernels grouped by kind (matmul, attention, fused elementwise, optimizer,
loss, communication, copies).

    python benchmarks/profile_step.py --workload gpt_1p3b --system rapidformer
    python benchmarks/profile_step.py --smoke          # CPU, tiny shapes: checks the plumbing

Writes docs/benchmarks/profile_<workload>_<system>.json (kind -> ms per step and share, and the
top kernels) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import SMOKE, WORKLOADS, batch_for, build_model, hf_loop, rapidformer_loop  # noqa: E402

from rapidformer.observability.step_profiler import kernel_summary  # noqa: E402

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="gpt_1p3b", choices=list(WORKLOADS))
    parser.add_argument("--system", default="rapidformer",
                        choices=["hf-eager", "hf-compile", "rapidformer", "rapidformer-eager"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-mask", action="store_true",
                        help="no attention_mask in the batch (no padding: causal attention "
                             "can skip the masked half)")
    parser.add_argument("--sdpa", default="default", choices=["default", "flash", "cudnn",
                                                               "efficient"],
                        help="force one scaled-dot-product-attention backend")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out-dir", default="docs/benchmarks")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke else "cuda")
    arch, layers, hidden, heads, seq, micro, vocab = (SMOKE if args.smoke
                                                      else WORKLOADS)[args.workload]
    torch.manual_seed(0)
    model = build_model(arch, layers, hidden, heads, seq, vocab)
    batch = batch_for(arch, micro, seq, vocab, device)
    if args.no_mask:
        batch.pop("attention_mask", None)
    if args.sdpa != "default":
        for name in ("flash", "cudnn", "mem_efficient"):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(args.sdpa in name)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    precision = "fp32" if args.smoke else "bf16"
    with tempfile.TemporaryDirectory() as work:
        if args.system.startswith("hf-"):
            step = hf_loop(model, batch, device, args.system == "hf-compile", dtype)
        else:
            graph = ["graph=compile"] if args.system == "rapidformer" else []
            step = rapidformer_loop(model, batch, [f"precision={precision}", *graph,
                                                   f"trainer.device={device.type}"], Path(work))
        for _ in range(args.warmup):
            step()
        activity = (torch.profiler.ProfilerActivity.CUDA if device.type == "cuda"
                    else torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(args.steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()

    variant = "".join(["_nomask" if args.no_mask else "",
                       f"_{args.sdpa}" if args.sdpa != "default" else ""])
    summary = kernel_summary(prof, device.type, args.steps)
    result = {"workload": args.workload, "system": args.system, "steps": args.steps,
              "attention_mask": not args.no_mask, "sdpa": args.sdpa,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "ms_per_step": summary["kernel_ms_per_step"],
              "kinds": summary["kinds"], "top_kernels": summary["top_kernels"]}
    print(f"{args.workload} / {args.system}: {result['ms_per_step']} ms of kernels per step")
    print("| kind | ms per step | share |\n|---|---|---|")
    for kind, entry in result["kinds"].items():
        print(f"| {kind} | {entry['ms_per_step']} | {100 * entry['share']:.1f} % |")
    out = Path(args.out_dir) / f"profile_{args.workload}_{args.system}{variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
