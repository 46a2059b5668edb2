"""Where a LoRA SFT step's memory goes, on the CPU: the bytes the autograd graph saves for the
backward (unique storages, by module, dtype and shape) and the process's live and peak bytes
around one forward/backward, for

- `rf-all` / `rf-labelled`: rapidformer's own training step (`+recipe=llama_lora
  data.packing=true peft.base_dtype=bf16 precision=bf16`, task.lm_head=all or labelled;
  `rf-fused`: labelled with peft.fused=true), run
  through the engine as `rapidformer train` runs it (autocast, transforms, packed collate); the
  probe wraps the task's run_forward_step and the strategy's backward;
- `hf`: benchmarks/lora_sft.py's hand loop (a bf16 LlamaForCausalLM, peft's get_peft_model, bf16
  autocast, the model's own loss from labels) on the same packed row;
- `trl`: TRL's SFTTrainer.compute_loss as TRL 1.16 runs it (trl.trainer.utils.add_fused_lm_head
  before peft, `model(**inputs, fused_lm_head=True)`, loss = -log_probs.sum() / labelled).

The model is Llama 3.2 1B's layer shape (hidden 2048, 32/8 heads, SwiGLU 8192) with fewer
layers (--layers, default 2) and Llama 3's 128,256-row output layer, one packed row of --seq
tokens. Every number scales linearly to 16 layers x 4 rows (the script prints the
extrapolation: per-layer bytes x layers x rows, head bytes x rows).

    python benchmarks/memory_probe_lora.py                 # every variant, a subprocess each
    python benchmarks/memory_probe_lora.py --variants hf rf-labelled --layers 1 --seq 1024

Live and peak bytes come from the process's resident set (VmRSS, VmHWM after a reset through
/proc/self/clear_refs) with glibc returning every allocation of 64 KiB or more to the system on
free (MALLOC_MMAP_THRESHOLD_), so they follow the tensors' allocations. The CPU's attention
kernels are not CUDA's: attention's saved tensors differ a little from a GPU's (noted in the
report), everything else is the same graph.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("rf-all", "rf-labelled", "rf-fused", "hf", "trl")
# the rapidformer variants' settings beside the common ones (rf_overrides)
RF_VARIANTS = {"rf-all": ["task.lm_head=all"], "rf-labelled": ["task.lm_head=labelled"],
               "rf-fused": ["task.lm_head=labelled", "peft.fused=true"]}
GB = 1e9


# --- measuring ---------------------------------------------------------------------------------

def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class Probe:
    """Saved-for-backward tensors of one forward, attributed to the innermost module running."""

    def __init__(self, model):
        import torch

        self.torch = torch
        self.names = {id(m): n for n, m in model.named_modules()}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stack: list[str] = []
        self.saved: dict[int, dict] = {}

    def category(self) -> str:
        name = next((n for n in reversed(self.stack) if n is not None), "")
        name = re.sub(r"^(base_model\.model\.)", "", name)
        name = re.sub(r"\.default$", "", name)
        layer = re.search(r"layers\.(\d+)\.", name + ".")
        name = re.sub(r"layers\.\d+\.?", "layers.N.", name).rstrip(".")
        return ("layer " if layer else "") + (name or "<model forward / loss>")

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.saved and storage.nbytes():
            self.saved[ptr] = {"bytes": storage.nbytes(), "dtype": str(t.dtype).split(".")[-1],
                               "shape": tuple(t.shape), "where": self.category(),
                               "weight": ptr in self.params}
        return t

    def __enter__(self):
        torch = self.torch
        def pre(module, *_):
            self.stack.append(self.names.get(id(module)))

        def post(module, *_):  # returns None: the module's output stays as it is
            if self.stack:
                self.stack.pop()

        self.hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                      torch.nn.modules.module.register_module_forward_hook(post,
                                                                           always_call=True)]
        self.saving = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.saving.__enter__()
        return self

    def __exit__(self, *exc):
        self.saving.__exit__(*exc)
        for h in self.hooks:
            h.remove()

    def table(self) -> dict:
        """bytes by where (layers summed), by dtype, and the largest shapes."""
        by_where, by_dtype, by_shape = (collections.Counter() for _ in range(3))
        activations = weights = 0
        for s in self.saved.values():
            if s["weight"]:
                weights += s["bytes"]
                continue
            activations += s["bytes"]
            by_where[s["where"]] += s["bytes"]
            by_dtype[s["dtype"]] += s["bytes"]
            by_shape[f"{s['dtype']}{list(s['shape'])} @ {s['where']}"] += s["bytes"]
        return {"saved_activation_bytes": activations, "saved_weight_bytes (params)": weights,
                "by_where": dict(by_where.most_common()), "by_dtype": dict(by_dtype),
                "largest": dict(by_shape.most_common(14))}


def measured(model, forward, backward) -> dict:
    """One forward under the probe, then its backward: saved bytes, live bytes at the loss, the
    peak of forward + backward over the bytes before it."""
    import gc

    gc.collect()
    before = rss()
    reset_hwm()
    with Probe(model) as probe:
        loss = forward()
    gc.collect()
    at_loss = rss() - before
    forward_peak = hwm() - before
    backward(loss)
    peak = hwm() - before
    return {"loss": float(loss), "live_at_loss_bytes": at_loss,
            "forward_peak_bytes": forward_peak, "step_peak_bytes": peak, **probe.table()}


# --- the variants ------------------------------------------------------------------------------

def rf_overrides(args, work: Path, variant: str) -> list[str]:
    return ["+recipe=llama_lora", "model=llama_1b", f"model.num_layers={args.layers}",
            "peft.modules_to_save=null", "data.packing=true", "peft.base_dtype=bf16",
            "precision=bf16", *RF_VARIANTS[variant], f"data.path={work / 'data'}",
            f"data.max_seq_length={args.seq}", f"model.max_position_embeddings={args.seq}",
            "data.synthetic_lengths=instruction", "model.embedding_rows=128256",
            f"data.synthetic_train_size={args.examples}", "data.synthetic_eval_size=8",
            "trainer.epochs=null", "trainer.train_iters=1", "trainer.eval_interval=1000",
            "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
            "trainer.log_interval=1", "trainer.device=cpu", "task.sample_generations=0",
            "trainer.export_hf=false", "trainer.save_last=false", "trainer.progress_bar=false",
            "scheduler=constant", "scheduler.warmup_iters=0", "trainer.lr=2e-4"]


def rapidformer_variant(args, variant: str) -> dict:
    import torch

    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class

    work = Path(tempfile.mkdtemp(prefix="rf-memprobe-"))
    run = work / "run"
    _, cfg = settle(compose(rf_overrides(args, work, variant)), str(run))
    task = task_class("sft")(engine=RapidformerEngine(cfg, run))
    result = {}
    own_forward = task.run_forward_step
    strategy = task.engine.strategy
    own_backward = strategy.backward

    def forward_step(batch, model):
        if result or not model.training:
            return own_forward(batch, model)
        torch.save({k: v.cpu() for k, v in batch.items()}, args.batch_file)
        state = {}

        def backward(loss):
            state["loss"] = loss
            own_backward(loss, 1)

        result.update(measured(model, lambda: own_forward(batch, model), backward))
        result["autocast_on_during_forward"] = torch.is_autocast_enabled("cpu")
        result["batch"] = {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()}
        result["labelled_next_tokens"] = int((batch["labels"][:, 1:] != -100).sum())
        result["tokens"] = batch["input_ids"].numel()
        result["parameter_dtypes"] = dict(collections.Counter(
            f"{p.dtype} trains={p.requires_grad}" for p in model.parameters()))
        strategy.backward = lambda loss, steps: None  # done inside the probe
        return state["loss"]

    task.run_forward_step = forward_step
    try:
        task.train()
    finally:  # the run's folder holds the base's copy (GBs at 1B): never left in the temp dir
        shutil.rmtree(work, ignore_errors=True)
    opt = getattr(task.engine, "optimizer", None)
    if opt is not None:
        states = collections.Counter()
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.numel() > 1:
                    states[str(v.dtype)] += v.numel() * v.element_size()
        result["optimizer_state_bytes"] = dict(states)
    return result


def hf_model(args):
    """lora_sft.py's _model_and_rows model at this shape: random, bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=128256, hidden_size=2048, num_hidden_layers=args.layers,
            num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
            max_position_embeddings=args.seq, rope_theta=500000.0, tie_word_embeddings=False,
            use_cache=False, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16)


def the_batch(args) -> dict:
    import torch

    if Path(args.batch_file).exists():
        return torch.load(args.batch_file)
    # no rapidformer row ran first: a packed row of 8 examples, the last three quarters of each
    # labelled
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128256, (1, args.seq), generator=g)
    size = args.seq // 8
    positions = torch.arange(args.seq) % size
    labels = torch.where(positions >= size // 4, ids[0], -100)[None]
    return {"input_ids": ids, "position_ids": positions[None], "labels": labels}


def hf_variant(args, trl: bool) -> dict:
    import torch
    from peft import get_peft_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lora_sft import lora_config

    model = hf_model(args)
    if trl:
        from trl.trainer.utils import add_fused_lm_head

        # what SFTTrainer does before peft (its compute_loss reads entropy and is_top1)
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    model = get_peft_model(model, lora_config())
    model.train()
    batch = the_batch(args)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "labels": batch["labels"]}

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if not trl:
                return model(**inputs, use_cache=False).loss
            out = model(**inputs, use_cache=False, fused_lm_head=True)
            loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
            # its metrics, as compute_loss computes them (detached)
            _ = out.entropy.detach().sum(), out.is_top1.sum()
            return loss

    result = measured(model, forward, lambda loss: loss.backward())
    result["labelled_next_tokens"] = int((batch["labels"][:, 1:] != -100).sum())
    result["tokens"] = batch["input_ids"].numel()
    result["parameter_dtypes"] = dict(collections.Counter(
        f"{p.dtype} trains={p.requires_grad}" for p in model.parameters()))
    return result


# --- the report --------------------------------------------------------------------------------

def extrapolate(r: dict, args, layers: int = 16, tokens: int = 4 * 2048) -> dict:
    """per-layer saved bytes x layers, the rest (embedding, final norm, head, loss) as is, both
    x tokens / the measured row's tokens (rows of 2048: the packed attention's mask scales with
    the rows too)."""
    scale = tokens / r["tokens"]
    per_layer = sum(b for w, b in r["by_where"].items() if w.startswith("layer ")) / args.layers
    rest = r["saved_activation_bytes"] - per_layer * args.layers
    rows = scale
    return {"per_layer_GB": round(per_layer * rows / GB, 3),
            "layers_GB": round(per_layer * layers * rows / GB, 2),
            "head_and_rest_GB": round(rest * rows / GB, 2),
            "saved_total_GB": round((per_layer * layers + rest) * rows / GB, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--examples", type=int, default=96)
    parser.add_argument("--batch-file", default=None)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.child:
        result = (rapidformer_variant(args, args.child)
                  if args.child.startswith("rf-") else hf_variant(args, args.child == "trl"))
        print("RESULT " + json.dumps(result))
        return
    args.batch_file = args.batch_file or tempfile.mktemp(suffix=".pt", prefix="memprobe-batch-")
    # the rapidformer rows first: their packed row is the others' input
    order = sorted(args.variants, key=lambda v: not v.startswith("rf-"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    results = {}
    for v in order:
        cmd = [sys.executable, __file__, "--child", v, "--layers", str(args.layers), "--seq",
               str(args.seq), "--examples", str(args.examples), "--batch-file", args.batch_file]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{v}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results[v] = r = json.loads(line[len("RESULT "):])
        r["extrapolated_16_layers_8192_tokens"] = extrapolate(r, args)
        print(f"\n=== {v} (layers={args.layers}, 1 row of {r['tokens']} tokens, "
              f"{r['labelled_next_tokens']} labelled) ===")
        for key in ("saved_activation_bytes", "live_at_loss_bytes", "forward_peak_bytes",
                    "step_peak_bytes"):
            print(f"  {key:28s} {r[key] / GB:8.3f} GB")
        print("  saved by where:")
        for w, b in r["by_where"].items():
            print(f"    {b / GB:8.4f} GB  {w}")
        print("  saved by dtype:", {k: round(b / GB, 3) for k, b in r["by_dtype"].items()})
        print("  largest saved:")
        for w, b in r["largest"].items():
            print(f"    {b / GB:8.4f} GB  {w}")
        print("  extrapolated (16 layers x 8192 tokens):", r["extrapolated_16_layers_8192_tokens"])
        for key in ("parameter_dtypes", "optimizer_state_bytes", "autocast_on_during_forward"):
            if key in r:
                print(f"  {key}: {r[key]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
