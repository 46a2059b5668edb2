"""Probe (one H200, 2026-12-01): scaled-dot-product-attention backends with and without dropout
on GPT 1.3B's and BERT-base's attention shapes, a compiled GPT 1.3B step under each forced
backend, and a BERT MLM step with the head over the masked positions only (15 % labels, no
padding mask). Run from the project root; results in docs/benchmarks/experiments/:

    python benchmarks/attention_probe_backends.py docs/benchmarks/experiments/attention_probe_backends.json
"""
import sys, json, contextlib
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from run import build_model, batch_for, measure, WORKLOADS

dev = torch.device("cuda")
out = {}

def timeit(fn, warm=3, n=10):
    """ms per call after `warm` calls (the speed suite's timing)."""
    return measure(fn, warm, n, dev)[1] * 1000

def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    ks = sorted(((e.device_time_total, e.key) for e in p.key_averages() if e.device_time_total > 0), reverse=True)
    return [k[:70] for _, k in ks[:2]]

# 1. attention alone
for name, shape, causal in [("gpt1p3b", (8, 16, 2048, 128), True), ("bert", (32, 12, 512, 64), False)]:
    q, k, v = (torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    for p in (0.1, 0.0):
        for be in ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            ctx = contextlib.nullcontext if be == "default" else (lambda be=be: sdpa_kernel([getattr(SDPBackend, be)]))
            def f():
                with ctx():
                    o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
                o.backward(g)
            try:
                ms = timeit(f); ks = kernels_of(f)
            except Exception as e:
                ms, ks = None, [str(e)[:100]]
            key = f"attn {name} p={p} {be}"
            out[key] = {"ms_fwd_bwd": ms, "kernels": ks}; print(key, out[key], flush=True)

# 2. full GPT 1.3B step, hf-compile loop, default vs flash context
def gpt_step(backend, dropout):
    arch, L, H, nh, seq, mb, V = WORKLOADS["gpt_1p3b"]
    torch.manual_seed(0)
    m = build_model(arch, L, H, nh, seq, V)
    if dropout is not None:
        m.config.attn_pdrop = dropout
        for blk in m.transformer.h: blk.attn.attn_dropout.p = dropout
    m = m.to(dev); batch = batch_for(arch, mb, seq, V, dev); batch.pop("attention_mask", None)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(m)
    ctx = contextlib.nullcontext if backend == "default" else (lambda: sdpa_kernel([getattr(SDPBackend, backend)]))
    def step():
        with ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(**batch).loss
        loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True)
    ms = timeit(step, warm=4, n=10)
    ks = kernels_of(step)
    del m, opt, fwd; torch.cuda.empty_cache(); torch._dynamo.reset()
    return {"ms": ms, "tokens_per_s": mb * seq / ms * 1000, "kernels": ks}

for be, dp in [("default", None), ("FLASH_ATTENTION", None), ("EFFICIENT_ATTENTION", None), ("default", 0.0)]:
    try: r = gpt_step(be, dp)
    except Exception as e: r = {"error": str(e)[:300]}
    key = f"gpt1p3b step {be} attn_pdrop={dp}"; out[key] = r; print(key, r, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)

# 3. BERT MLM: 15 % labels; full head vs masked-only head
def bert_step(masked_only, capture):
    arch, L, H, nh, seq, mb, V = WORKLOADS["bert_mlm"]
    torch.manual_seed(0)
    m = build_model(arch, L, H, nh, seq, V).to(dev)
    ids = torch.randint(0, V, (mb, seq), device=dev)
    labels = torch.where(torch.rand(mb, seq, device=dev) < 0.15, ids, -100)
    torch._dynamo.config.capture_dynamic_output_shape_ops = capture
    def forward(input_ids, labels):
        if not masked_only:
            return m(input_ids=input_ids, labels=labels).loss
        h = m.bert(input_ids=input_ids).last_hidden_state
        sel = labels != -100
        logits = m.cls(h[sel])
        return F.cross_entropy(logits.float(), labels[sel])
    fwd = torch.compile(forward)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(ids, labels)
        loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True)
    ms = timeit(step, warm=5, n=20)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full = m(input_ids=ids, labels=labels).loss.item()
        h = m.bert(input_ids=ids).last_hidden_state; sel = labels != -100
        part = F.cross_entropy(m.cls(h[sel]).float(), labels[sel]).item()
    del m, opt, fwd; torch.cuda.empty_cache(); torch._dynamo.reset()
    return {"ms": ms, "tokens_per_s": mb * seq / ms * 1000, "loss_full_head": full, "loss_masked_head": part}

for mo, cap in [(False, False), (True, False), (True, True)]:
    try: r = bert_step(mo, cap)
    except Exception as e: r = {"error": str(e)[:300]}
    key = f"bert_mlm 15% step masked_only={mo} capture_dynamic={cap}"; out[key] = r; print(key, r, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
