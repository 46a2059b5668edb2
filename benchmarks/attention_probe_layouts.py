"""Probe (one H200, 2026-12-01): does GPT-2's packed q/k/v layout slow cuDNN attention, and
where does a compiled GPT step's attention time go? Attention alone in four q/k/v layouts (eager
and compiled, forward + backward, copies included), then GPT 1.3B and GPT-2 124M training steps
(batches with an all-ones mask) eager and compiled, with q/k/v made contiguous or not, with the
attention kernels' time per step. It ran before rapidformer_sdpa existed: the compiled steps'
131 ms against 34 ms eager is the materialized mask. Run from the project root:

    python benchmarks/attention_probe_layouts.py docs/benchmarks/experiments/attention_probe_layouts.json
"""
import sys, json
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
from run import build_model, batch_for, measure, WORKLOADS
from rapidformer.observability.step_profiler import kind_of

dev = torch.device("cuda")
out = {}
def timeit(fn, warm=3, n=10):
    """ms per call after `warm` calls (the speed suite's timing)."""
    return measure(fn, warm, n, dev)[1] * 1000

def attn_ms(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    tot = {}
    for e in p.key_averages():
        if e.device_time_total > 0:
            k = "attention" if kind_of(e.key) == "attention" else "other"
            tot[k] = tot.get(k, 0) + e.device_time_total / 1000
    return tot

B, H, S, D = 8, 16, 2048, 128
x = torch.randn(B, S, 3 * H * D, device=dev, dtype=torch.bfloat16, requires_grad=True)
def layouts(kind):
    if kind == "bhsd":
        return [t.view(B, S, H, D).transpose(1, 2).contiguous() for t in x.split(H * D, 2)]
    if kind == "packed":        # GPT-2: c_attn(x).split(...).view().transpose()
        return [t.view(B, S, H, D).transpose(1, 2) for t in x.split(H * D, 2)]
    if kind == "packed_contig":
        return [t.view(B, S, H, D).transpose(1, 2).contiguous() for t in x.split(H * D, 2)]
    if kind == "bshd":
        return [t.contiguous().view(B, S, H, D).transpose(1, 2) for t in x.split(H * D, 2)]
g = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
for kind in ("packed", "packed_contig", "bshd", "bhsd"):
    for compiled in (False, True):
        def f(kind=kind):
            q, k, v = layouts(kind)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        ff = torch.compile(f) if compiled else f
        def step():
            ff().backward(g)
        ms = timeit(step)
        key = f"attn {kind} compiled={compiled}"
        out[key] = {"ms_fwd_bwd_incl_copies": round(ms, 3), "kernel_ms": attn_ms(step)}
        print(key, out[key], flush=True)
torch._dynamo.reset()

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
def contiguous_sdpa(module, query, key, value, *args, **kwargs):
    return sdpa_attention_forward(module, query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)

def gpt_step(patched, compiled, workload="gpt_1p3b"):
    ALL_ATTENTION_FUNCTIONS["sdpa"] = contiguous_sdpa if patched else sdpa_attention_forward
    arch, L, Hd, nh, seq, mb, V = WORKLOADS[workload]
    torch.manual_seed(0)
    m = build_model(arch, L, Hd, nh, seq, V).to(dev)
    batch = batch_for(arch, mb, seq, V, dev)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # as the suite's batches were then
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(m) if compiled else m
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(**batch).loss
        loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True)
        return loss
    torch.manual_seed(1); first = step().item()
    ms = timeit(step, warm=3, n=10)
    k = attn_ms(step)
    del m, opt, fwd; torch.cuda.empty_cache(); torch._dynamo.reset()
    return {"ms": round(ms, 1), "tokens_per_s": round(mb * seq / ms * 1000), "kernel_ms": k, "first_loss": first}

for wl, patched, compiled in [("gpt_1p3b", False, True), ("gpt_1p3b", True, True), ("gpt_1p3b", True, False),
                              ("gpt2_124m", False, True), ("gpt2_124m", True, True)]:
    try: r = gpt_step(patched, compiled, wl)
    except Exception as e: r = {"error": str(e)[:300]}
    key = f"{wl} step contiguous={patched} compiled={compiled}"; out[key] = r; print(key, r, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
