"""LoRA supervised fine-tuning speed and memory: rapidformer through its CLI (`+recipe=llama_lora`
on a Llama 3.2 1B-shaped model, bf16) unpacked, packed (data.packing=true) and with QLoRA's
4-bit base (peft=qlora, GPU only), against a plain Hugging Face + peft loop on the same
conversations (padded to the longest in each batch, as transformers' collators do), in one call.

Data: the project's generated chats (rapidformer's synthetic `chat` data, short turns of a few
to a few dozen tokens), its WordPiece vocabulary, loss on the assistant's tokens. Every system:
LoRA r=16, alpha=32 on q/k/v/o/gate/up/down, the base frozen, AdamW at a constant lr, clipping
1.0, micro batch --batch rows. The base's weights are random (throughput does not depend on
them) and its vocabulary is the generated data's, far smaller than a real model's 128k: the
output head costs less here than in a real 1B model.

    python benchmarks/lora_sft.py                      # GPU: every row
    python benchmarks/lora_sft.py --rows rf-lora hf-peft --iters 100
    python benchmarks/lora_sft.py --smoke              # CPU, tiny, a few steps

Each row: real (non-pad) tokens/s and samples/s over the log windows after step SKIP, peak GB,
the padding fraction and the loss at the end. Writes docs/benchmarks/lora_sft.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import finish_speed_rows, keep_log, run_cli

RF_ROWS = {"rf-lora": [], "rf-lora-packed": ["data.packing=true"],
           "rf-qlora-packed": ["peft=qlora", "data.packing=true"]}
HF_ROWS = ("hf-peft",)
LOG_INTERVAL = 10
SKIP = 10  # the first windows (warm-up, allocator growth) are not in the means


def common(args, work: Path) -> list[str]:
    return ["+recipe=llama_lora", f"model={args.model}", "peft.modules_to_save=null",
            f"data.path={work / 'data'}", f"data.max_seq_length={args.seq}",
            f"data.synthetic_train_size={args.examples}", "data.synthetic_eval_size=16",
            "trainer.epochs=null", f"trainer.train_iters={args.iters}",
            f"trainer.micro_batch_size={args.batch}", f"trainer.global_batch_size={args.batch}",
            "trainer.lr=2e-4", "scheduler=constant", "scheduler.warmup_iters=0",
            f"trainer.log_interval={LOG_INTERVAL}", f"trainer.eval_interval={args.iters}",
            "task.sample_generations=0", "trainer.export_hf=false", "trainer.save_last=false",
            "trainer.progress_bar=false", *args.overrides]


def rapidformer_row(row: str, args, work: Path) -> dict:
    out = work / row
    command = [sys.executable, "-m", "rapidformer", *common(args, work), *RF_ROWS[row],
               f"trainer.output_dir={out}"]
    base, _, windows = run_cli(row, command, work)
    if windows is None:
        return base
    later = [r for r in windows if r["step"] > SKIP] or windows
    mean = lambda key: sum(r.get(key) or 0 for r in later) / len(later)
    return {**base, "tokens_per_s": round(mean("tokens_per_s")),
            "samples_per_s": round(mean("samples_per_s"), 1),
            "padding_frac": round(mean("padding_frac"), 3),
            "peak_mem_gb": round(max(r.get("peak_mem_gb", 0) for r in windows), 2),
            "loss_at_end": round(windows[-1]["loss"], 4), "tokenizer": str(out / "tokenizer")}


def hf_row(row: str, args, work: Path, tokenizer_dir: str) -> dict:
    command = [sys.executable, __file__, "--hf-child", "--work", str(work),
               "--tokenizer", tokenizer_dir, "--iters", str(args.iters),
               "--batch", str(args.batch), "--seq", str(args.seq), "--model", args.model,
               "--examples", str(args.examples), *(["--smoke"] if args.smoke else [])]
    result = subprocess.run(command, capture_output=True, text=True)
    keep_log(row, result)
    base = {"row": row, "command": "plain Hugging Face LlamaForCausalLM + peft LoRA, the same "
                                   "conversations, padded to the longest in each batch"}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return {**base, **json.loads(result.stdout.strip().splitlines()[-1])}


def hf_child(args) -> None:
    """The loop a user writes with transformers and peft: the rapidformer run's tokenizer and
    token/label rows (the same conversations, the same masks), a padding collator, bf16
    autocast, fused AdamW over the adapters."""
    import contextlib

    import torch
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rapidformer.config.compose import compose, resolve
    from rapidformer.data.chat import EncodeCounts, encode_rows
    from rapidformer.data.lengths import IGNORE
    from rapidformer.tasks.sft import ready_for_chat

    work = Path(args.work)
    _, cfg = resolve(compose(common(args, work)), tempfile.mkdtemp())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ready_for_chat(tokenizer, cfg.data.chat_template)  # what the sft task does to it
    rows = load_dataset("json", data_files=str(work / "data" / "train.jsonl"), split="train")
    rows = encode_rows(rows, tokenizer, cfg.data, "response", "train", EncodeCounts())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = cfg.model
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
        intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa"))
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"])).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, fused=device.type == "cuda")
    pad = tokenizer.pad_token_id

    def collate(batch):
        longest = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), longest), pad)
        labels = torch.full((len(batch), longest), IGNORE)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = (torch.tensor(r["input_ids"]),
                                                       torch.tensor(r["labels"]), 1)
        return ids, labels, mask

    loader = torch.utils.data.DataLoader(rows, batch_size=args.batch, shuffle=True,
                                         collate_fn=collate, num_workers=2, pin_memory=True,
                                         generator=torch.Generator().manual_seed(0))
    autocast = (contextlib.nullcontext() if args.smoke
                else torch.autocast(device.type, dtype=torch.bfloat16))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.train()
    tokens = samples = slots = 0
    started, loss, step = None, None, 0
    while step < args.iters:
        for ids, labels, mask in loader:
            step += 1
            ids, labels, mask = (t.to(device, non_blocking=True) for t in (ids, labels, mask))
            with autocast:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == SKIP:
                sync()
                started = time.perf_counter()
            elif step > SKIP:
                tokens += int(mask.sum())
                samples += ids.shape[0]
                slots += mask.numel()
            if step == args.iters:
                break
    sync()
    elapsed = time.perf_counter() - started
    print(json.dumps({
        "tokens_per_s": round(tokens / elapsed), "samples_per_s": round(samples / elapsed, 1),
        "padding_frac": round(1 - tokens / slots, 3),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda" else None, "loss_at_end": round(float(loss), 4)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=[*RF_ROWS, *HF_ROWS],
                        choices=[*RF_ROWS, *HF_ROWS])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--examples", type=int, default=40000)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: llama_tiny, seq 128, fp32, no QLoRA")
    parser.add_argument("--out", default="docs/benchmarks/lora_sft.json")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.seq = "llama_tiny", 128
        if not args.hf_child:
            args.overrides = [*args.overrides, "trainer.device=cpu", "precision=fp32"]
            args.iters, args.batch, args.examples = 30, 8, 2000
            args.rows = [r for r in args.rows if "qlora" not in r]
    else:
        args.overrides = ["precision=bf16", *args.overrides]
    if args.hf_child:
        return hf_child(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-lora-sft-") as temp:
        work = Path(temp)
        # the first rapidformer row generates the data and trains the vocabulary the others use
        order = sorted(args.rows, key=lambda r: r not in RF_ROWS)
        for row in order:
            if row in HF_ROWS:
                made = next((r["tokenizer"] for r in rows if "tokenizer" in r), None)
                rows.append(hf_row(row, args, work, made) if made else
                            {"row": row, "error": "needs a rapidformer row first (its data)"})
            else:
                rows.append(rapidformer_row(row, args, work))
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r.pop("tokenizer", None)
    finish_speed_rows(args, rows, "hf-peft")


if __name__ == "__main__":
    main()
