"""Gradient clipping folded into the fused AdamW step, against clip_grad_norm_ + step.

    python benchmarks/clip_in_optimizer.py docs/benchmarks/experiments/clip_in_optimizer.json

RapidformerEngine.step() with a fused torch optimizer computes the gradient norm and hands the
clip to the optimizer's kernel as a gradient divisor (the hook GradScaler uses), instead of
clip_grad_norm_'s extra pass that multiplies every gradient in place. This times both paths of
the same engine on the GPT 1.3B workload's parameters (random gradients, fp32, clip 1.0), in
one process, alternating, with CUDA events; the model's forward and backward are not run.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def time_steps(engine, params, grads, steps: int) -> float:
    """Milliseconds per engine.step(), the gradients put back (not copied) before each."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        start.record()
        engine.step()
        end.record()
        torch.cuda.synchronize()
        total += start.elapsed_time(end)
    return total / steps


def main(out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.config.compose import compose, resolve
    from rapidformer.engine import RapidformerEngine

    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as work:
        _, cfg = resolve(compose(["model=bert_tiny", "trainer.train_iters=1000",
                                  "trainer.clip_grad=1.0", "precision=bf16"]), work)
        engine = RapidformerEngine(cfg=cfg, run_dir=Path(work))
        with device:
            model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=2048, n_head=16,
                                               n_positions=2048, vocab_size=50257))
        model, _, _ = engine.compose(model, total_iters=1000)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [torch.randn_like(p) for p in params]
        folded = engine.strategy.clips_in_optimizer
        assert folded(), "the fused path needs a fused torch AdamW and no fp16 loss scaler"
        rows = {"folded into the fused AdamW": [], "clip_grad_norm_ then step": []}
        for _ in range(3):  # alternate, so clock drift hits both alike
            engine.strategy.clips_in_optimizer = folded
            time_steps(engine, params, grads, 3)
            rows["folded into the fused AdamW"].append(time_steps(engine, params, grads, 20))
            engine.strategy.clips_in_optimizer = lambda: False
            time_steps(engine, params, grads, 3)
            rows["clip_grad_norm_ then step"].append(time_steps(engine, params, grads, 20))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "parameters": sum(p.numel() for p in params),
              "ms_per_step": {k: round(min(v), 3) for k, v in rows.items()},
              "ms_per_step_all_rounds": {k: [round(x, 3) for x in v] for k, v in rows.items()}}
    print(json.dumps(result, indent=1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "clip_in_optimizer.json")
