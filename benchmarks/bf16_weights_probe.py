"""Probe: bf16 weights with fp32 master copies in the optimizer, against autocast over fp32
weights (rapidformer's bf16 today), on the speed suite's GPT 1.3B workload, one process.

    python benchmarks/bf16_weights_probe.py docs/benchmarks/experiments/bf16_weights_probe.json

Under autocast the weights stay fp32, so the embeddings, the residual stream and every layer
norm's input are fp32 activations (twice the bytes of bf16) and each forward casts the weights.
With bf16 weights the whole forward and backward run in bf16; the optimizer keeps fp32 masters:
the bf16 gradients are copied into fp32, clipped inside the fused AdamW (as the engine does),
and the updated masters copied back into the bf16 weights. Both rows use the engine's attention
(rapidformer_sdpa) and a whole-model torch.compile. This decides whether a bf16-weights
precision mode is worth building; it is not a product path.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from run import WORKLOADS, batch_for, build_model, measure, rapidformer_loop

from rapidformer.observability.flops import flops_per_token, peak_flops
from rapidformer.models.attention import use_training_sdpa


def bf16_weights_loop(model, batch: dict, device, clip: float = 1.0):
    model = model.to(device)
    assert use_training_sdpa(model)
    model.config.use_cache = False
    masters = [p.detach().clone().float() for p in model.parameters()]
    model.to(torch.bfloat16)
    params = list(model.parameters())
    for m in masters:
        m.grad = torch.zeros_like(m)
    optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    forward = torch.compile(model)

    def step():
        loss = forward(**batch).loss
        loss.backward()
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
        norm = torch.nn.utils.get_total_norm([m.grad for m in masters], foreach=True)
        optimizer.grad_scale = ((norm + 1e-6) / clip).clamp(min=1.0)
        optimizer.step()
        del optimizer.grad_scale
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        for p in params:
            p.grad = None
    return step


def main(out: str) -> None:
    device = torch.device("cuda")
    arch, layers, hidden, heads, seq, micro, vocab = WORKLOADS["gpt_1p3b"]
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for system in ("rapidformer", "bf16 weights + fp32 masters"):
            torch.manual_seed(0)
            model = build_model(arch, layers, hidden, heads, seq, vocab)
            parameters = sum(p.numel() for p in model.parameters())
            batch = batch_for(arch, micro, seq, vocab, device)
            torch.cuda.reset_peak_memory_stats()
            if system == "rapidformer":
                step = rapidformer_loop(model, batch, ["precision=bf16", "graph=compile",
                                                       "trainer.device=cuda"], Path(work) / "r")
            else:
                step = bf16_weights_loop(model, batch, device)
            warmup_s, seconds = measure(step, 5, 20, device)
            tokens_per_s = micro * seq / seconds
            rows[system] = {"tokens_per_s": round(tokens_per_s, 1),
                            "mfu": round(tokens_per_s * flops_per_token(parameters, layers, hidden,
                                                                       seq) / peak_flops(device), 4),
                            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                            "warmup_s": round(warmup_s, 1)}
            print(system, rows[system], flush=True)
            del model, step
            torch.cuda.empty_cache()
    result = {"workload": "gpt_1p3b", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bf16_weights_probe.json")
