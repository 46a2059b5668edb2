"""LoRA supervised fine-tuning speed and memory on a realistic SFT workload: rapidformer through
its CLI (`+recipe=llama_lora` on a Llama 3.2 1B-shaped model, bf16) unpacked, packed
(data.packing=true) and with QLoRA's 4-bit base (peft=qlora, GPU only), each with the frozen base
held in bf16 (what peft.base_dtype=auto gives a bf16 checkpoint) and in fp32 (the earlier
behaviour), against TRL's SFTTrainer (padded, and packed: its BFD packing, padding-free) and a
plain Hugging Face + peft loop, on the same conversations, in one call.

Workload: generated chats of the lengths of real instruction data
(data.synthetic_lengths=instruction: log-normal, mean about 250 words, a tail to 4k, cut at
--seq), the WordPiece vocabulary trained on them, and Llama 3's output size
(model.embedding_rows=128256): the output layer costs what it costs in the real model. Loss on
the assistant's tokens. Every system: LoRA r=16, alpha=32, dropout 0.05 on
q/k/v/o/gate/up/down, the base frozen in bf16 (random weights: throughput does not depend on
them), bf16 autocast, fused AdamW at a constant lr 2e-4, clipping 1.0, no activation
checkpointing (TRL's default turns it on; off here, as in the other rows). Unpacked rows take
--batch conversations a step, packed rows --packed-batch rows of --seq tokens.

    python benchmarks/lora_sft.py                      # GPU: every row
    python benchmarks/lora_sft.py --rows rf-lora-packed trl-packed --iters 60
    python benchmarks/lora_sft.py --smoke              # CPU, tiny, a few steps

Each row: real (non-pad) tokens/s over the steps after SKIP, peak GB, the padding fraction, the
loss at the end and the process wall seconds. Writes docs/benchmarks/lora_sft.json.
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

PACKED = ["data.packing=true"]
RF_ROWS = {"rf-lora": ["peft.base_dtype=bf16"],
           "rf-lora-packed": [*PACKED, "peft.base_dtype=bf16"],
           "rf-lora-packed-fp32base": [*PACKED, "peft.base_dtype=fp32"],
           "rf-qlora-packed": ["peft=qlora", *PACKED],
           "rf-qlora-packed-fp32base": ["peft=qlora", *PACKED, "peft.base_dtype=fp32"],
           # the lowest-memory setting: QLoRA with activation checkpointing (per-layer recompute)
           "rf-qlora-packed-ckpt": ["peft=qlora", *PACKED, "trainer.checkpoint_activations=true"],
           # the output layer on every position, through the model's forward (the earlier path)
           "rf-lora-packed-allhead": [*PACKED, "peft.base_dtype=bf16", "task.lm_head=all"],
           # liger-kernel's RMSNorm/SwiGLU/RoPE, with its fused linear cross-entropy on every
           # position, and with the labelled head computing the loss instead
           "rf-lora-packed-liger": [*PACKED, "peft.base_dtype=bf16", "kernels=liger"],
           "rf-lora-packed-liger-labelled": [*PACKED, "peft.base_dtype=bf16", "kernels=liger",
                                             "kernels.fused_linear_cross_entropy=false"],
           "rf-qlora-packed-liger": ["peft=qlora", *PACKED, "kernels=liger",
                                     "kernels.fused_linear_cross_entropy=false"],
           # each adapted layer as one function: the input saved once, the mask drawn again
           "rf-lora-packed-fused": [*PACKED, "peft.base_dtype=bf16", "peft.fused=true"],
           "rf-qlora-packed-fused": ["peft=qlora", *PACKED, "peft.fused=true"],
           "rf-qlora-packed-ckpt-fused": ["peft=qlora", *PACKED, "peft.fused=true",
                                          "trainer.checkpoint_activations=true"],
           # the checkpointed layers' inputs in pinned host memory (Unsloth's default
           # checkpointing offloads them too)
           "rf-qlora-packed-ckpt-offload": ["peft=qlora", *PACKED,
                                            "trainer.checkpoint_activations=true",
                                            "trainer.offload_activations=true"],
           # every memory setting at once: the lowest-memory rapidformer row
           "rf-qlora-packed-lowmem": ["peft=qlora", *PACKED, "peft.fused=true",
                                      "trainer.checkpoint_activations=true",
                                      "trainer.offload_activations=true"]}
CHILD_ROWS = {"hf-peft": "plain Hugging Face LlamaForCausalLM (bf16) + peft LoRA, a loop by "
                         "hand, padded to the longest in each batch",
              "trl-padded": "TRL SFTTrainer, peft LoRA on the bf16 model, padded batches",
              "trl-packed": "TRL SFTTrainer, packing=True (BFD, padding-free), peft LoRA",
              "trl-packed-liger": "TRL SFTTrainer, packing=True, use_liger_kernel=True (its "
                                  "layer kernels; TRL's own chunked head computes the loss)",
              "trl-qlora-packed": "TRL SFTTrainer, packing=True, the model loaded in 4 bits "
                                  "(bitsandbytes NF4, double quantization, bf16 compute), "
                                  "peft LoRA",
              "trl-qlora-packed-ckpt": "trl-qlora-packed with gradient_checkpointing=True (TRL's "
                                       "default)",
              "unsloth-padded": "Unsloth FastLanguageModel (bf16) + its LoRA, hf-peft's loop by "
                                "hand, padded to the longest in each batch",
              "unsloth-packed": "Unsloth, padding-free: whole conversations in one row of "
                                "--packed-batch x --seq tokens (packed_seq_lengths), same loop",
              "unsloth-qlora-packed": "unsloth-packed on a 4-bit base (load_in_4bit: bitsandbytes "
                                      "NF4)",
              "unsloth-qlora-packed-ckpt": "unsloth-qlora-packed with use_gradient_checkpointing="
                                           "'unsloth' (its default: offloaded to the host)"}
LOG_INTERVAL = 5
SKIP = 10  # the first steps (warm-up, allocator growth) are not in the means
ROW_TIMEOUT = 420
# held-out conversations every row is scored on after training (rapidformer's validation split):
# each system draws its own training batches, so the train loss of the last step differs by batch;
# the held-out loss of the same text is what "trains as well" compares
HELDOUT = 64


def common(args, work: Path) -> list[str]:
    workload = ["data.synthetic_lengths=instruction", f"model.embedding_rows={args.embedding_rows}"]
    return ["+recipe=llama_lora", f"model={args.model}", "peft.modules_to_save=null",
            f"data.path={work / 'data'}", f"data.max_seq_length={args.seq}",
            f"model.max_position_embeddings={max(args.seq, 128)}", *workload,
            f"data.synthetic_train_size={args.examples}", f"data.synthetic_eval_size={HELDOUT}",
            "trainer.epochs=null", f"trainer.train_iters={args.iters}",
            "trainer.lr=2e-4", "scheduler=constant", "scheduler.warmup_iters=0",
            f"trainer.log_interval={LOG_INTERVAL}", f"trainer.eval_interval={args.iters}",
            "task.sample_generations=0", "trainer.export_hf=false", "trainer.save_last=false",
            "trainer.progress_bar=false", *args.overrides]


def micro_batch(args, packed: bool) -> int:
    return args.packed_batch if packed else args.batch


def rapidformer_row(row: str, args, work: Path) -> dict:
    out = work / row
    batch = micro_batch(args, "data.packing=true" in RF_ROWS[row])
    command = [sys.executable, "-m", "rapidformer", *common(args, work), *RF_ROWS[row],
               f"trainer.micro_batch_size={batch}", f"trainer.global_batch_size={batch}",
               f"trainer.output_dir={out}"]
    base, _, windows = run_cli(row, command, work, timeout=args.row_timeout)
    if windows is None:
        return base
    later = [r for r in windows if r["step"] > SKIP] or windows
    mean = lambda key: sum(r.get(key) or 0 for r in later) / len(later)
    return {**base, "micro_batch": batch, "tokens_per_s": round(mean("tokens_per_s")),
            "samples_per_s": round(mean("samples_per_s"), 1),
            "padding_frac": round(mean("padding_frac"), 3),
            "peak_mem_gb": round(max(r.get("peak_mem_gb", 0) for r in windows), 2),
            "loss_at_end": round(windows[-1]["loss"], 4),
            "first_step_s": round(windows[0]["first_step_s"], 1),
            "heldout_loss": validation_loss(out / "metrics.jsonl"),
            "tokenizer": str(out / "tokenizer")}


def validation_loss(metrics: Path) -> float | None:
    """The run's last validation/loss (its evaluation after the last step), from metrics.jsonl."""
    found = None
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            value = json.loads(line).get("validation/loss")
            if value is not None:
                found = round(float(value), 4)
    return found


def child_row(row: str, args, work: Path, tokenizer_dir: str) -> dict:
    command = [sys.executable, __file__, "--child", row, "--work", str(work),
               "--tokenizer", tokenizer_dir, "--iters", str(args.iters),
               "--batch", str(args.batch), "--packed-batch", str(args.packed_batch),
               "--seq", str(args.seq), "--model", args.model,
               "--embedding-rows", str(args.embedding_rows),
               "--examples", str(args.examples), *(["--smoke"] if args.smoke else [])]
    base = {"row": row, "command": CHILD_ROWS[row]}
    started = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"ran past its {args.row_timeout} s limit"}
    keep_log(row, result)
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return {**base, "process_wall_s": round(time.perf_counter() - started, 1),
            **json.loads(result.stdout.strip().splitlines()[-1])}


def _config(args):
    from rapidformer.config.compose import compose, resolve

    return resolve(compose(common(args, Path(args.work))), tempfile.mkdtemp())[1]


def _encoded(args, cfg, tokenizer, split: str):
    """A split of the rapidformer run's data as that run encodes it (the same token/label rows)."""
    from datasets import load_dataset

    from rapidformer.data.chat import EncodeCounts, encode_rows

    rows = load_dataset("json", data_files=str(Path(args.work) / "data" / f"{split}.jsonl"),
                        split="train")
    return encode_rows(rows, tokenizer, cfg.data, "response", split, EncodeCounts())


def _model_and_rows(args):
    """The rapidformer run's tokenizer and token/label rows (the same conversations, the same
    masks) and the same model, random, its base in bf16 (a bf16 checkpoint as loaded)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rapidformer.tasks.sft import ready_for_chat

    cfg = _config(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ready_for_chat(tokenizer, cfg.data.chat_template)  # what the sft task does to it
    rows = _encoded(args, cfg, tokenizer, "train")
    m = cfg.model
    torch.manual_seed(0)
    # made in bf16 where it trains (an 8B model's fp32 init on the host takes minutes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=m.embedding_rows or len(tokenizer), hidden_size=m.hidden_size,
                num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
                max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default)
    return tokenizer, rows, model.to(torch.bfloat16)


def heldout(model, tokenizer, args) -> dict:
    """{"heldout_loss": ...}, or {"heldout_error": ...} where scoring failed (the row's speed
    numbers stand either way)."""
    try:
        return {"heldout_loss": heldout_loss(model, tokenizer, args)}
    except Exception as error:  # noqa: BLE001 — reported beside the row, never as a number
        return {"heldout_error": f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]}


def heldout_loss(model, tokenizer, args) -> float:
    """The trained model's mean loss over every labelled token of the held-out conversations
    (the rapidformer rows' validation split, encoded as they encode it), one conversation a
    forward under bf16 autocast: the number rapidformer's rows report as validation/loss."""
    import torch

    from rapidformer.data.lengths import IGNORE

    rows = _encoded(args, _config(args), tokenizer, "validation")
    device = next(p.device for p in model.parameters())
    total = count = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for ids, labels in zip(rows["input_ids"], rows["labels"]):
            ids, labels = (torch.tensor([x], device=device) for x in (ids, labels))
            n = int((labels[:, 1:] != IGNORE).sum())
            total += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * n
            count += n
    model.train(was_training)
    return round(total / count, 4)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])


def trl_child(args, packed: bool, liger: bool = False, four_bit: bool = False,
              checkpointing: bool = False) -> None:
    """TRL's SFTTrainer on the same token/label rows (a processed dataset: input_ids and labels,
    which it takes as they are), its own collator and packing. `four_bit`: QLoRA as TRL's
    documentation does it, the model loaded from a directory with a BitsAndBytesConfig."""
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer, rows, model = _model_and_rows(args)
    rows = rows.select_columns(["input_ids", "labels"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    quantization = None
    if four_bit:
        from transformers import BitsAndBytesConfig

        saved = Path(args.work) / "trl-base"
        model.save_pretrained(saved)
        del model
        torch.cuda.empty_cache()
        model = str(saved)
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
    clock = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            clock["begin"] = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in (1, SKIP, args.iters):
                sync()
                clock[state.global_step] = time.perf_counter()

    batch = micro_batch(args, packed)
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=args.iters,
        learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        bf16=True, use_cpu=device == "cpu", logging_steps=LOG_INTERVAL, report_to=[],
        save_strategy="no", packing=packed, max_length=args.seq,
        gradient_checkpointing=checkpointing,
        dataloader_num_workers=2, optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
        seed=0, dataset_num_proc=4, use_liger_kernel=liger,
        model_init_kwargs={"dtype": torch.bfloat16} if four_bit else None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows,
                         processing_class=tokenizer, peft_config=lora_config(),
                         quantization_config=quantization, callbacks=[Clock()])
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    real_per_row = sum(lengths) / len(lengths)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    elapsed = clock[args.iters] - clock[SKIP]
    steps = args.iters - SKIP
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({
        "micro_batch": batch, "tokens_per_s": round(real_per_row * batch * steps / elapsed),
        "samples_per_s": None if packed else round(batch * steps / elapsed, 1),
        "real_tokens_per_row": round(real_per_row, 1),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device == "cuda" else None, "loss_at_end": round(float(losses[-1]), 4),
        "first_step_s": round(clock[1] - clock["begin"], 1),
        **heldout(trainer.model, tokenizer, args)}))


def hf_child(args) -> None:
    """The loop a user writes with transformers and peft: a padding collator, bf16 autocast,
    fused AdamW over the adapters."""
    import torch
    from peft import get_peft_model

    from rapidformer.data.lengths import IGNORE

    tokenizer, rows, model = _model_and_rows(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = get_peft_model(model, lora_config()).to(device)
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
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.train()
    tokens = samples = slots = 0
    started, loss, step = None, None, 0
    begin, first_step_s = time.perf_counter(), None
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
            if step == 1:
                sync()
                first_step_s = time.perf_counter() - begin
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
        if device.type == "cuda" else None, "loss_at_end": round(float(loss), 4),
        "first_step_s": round(first_step_s, 1),
        **heldout(model, tokenizer, args)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=[*RF_ROWS, *CHILD_ROWS],
                        choices=[*RF_ROWS, *CHILD_ROWS])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="conversations a step, unpacked")
    parser.add_argument("--packed-batch", type=int, default=4, help="rows of --seq, packed")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--embedding-rows", type=int, default=128256)
    parser.add_argument("--examples", type=int, default=6000)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: llama_tiny, seq 512, 4096 output rows, no QLoRA")
    parser.add_argument("--out", default="docs/benchmarks/lora_sft.json")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--row-timeout", type=float, default=ROW_TIMEOUT,
                        help="seconds a row may run (its process: start, steps and exit)")
    parser.add_argument("--child", choices=list(CHILD_ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.overrides = ["precision=bf16", *args.overrides]
    if args.smoke:
        args.model, args.seq, args.embedding_rows = "llama_tiny", 512, 4096
        if not args.child:
            args.overrides = [*args.overrides, "trainer.device=cpu"]
            args.iters, args.batch, args.packed_batch, args.examples = SKIP + 4, 4, 1, 300
            args.rows = [r for r in args.rows if "qlora" not in r and "liger" not in r]
    if args.child == "hf-peft":
        return hf_child(args)
    if args.child and args.child.startswith("unsloth-"):
        from _unsloth_child import unsloth_child  # imports unsloth first, in this fresh process
        return unsloth_child(args, packed="packed" in args.child, four_bit="qlora" in args.child,
                             checkpointing="unsloth" if "ckpt" in args.child else False)
    if args.child:
        return trl_child(args, packed="packed" in args.child, liger="liger" in args.child,
                         four_bit="qlora" in args.child, checkpointing="ckpt" in args.child)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapidformer-lora-sft-") as temp:
        work = Path(temp)
        # the first rapidformer row generates the data and trains the vocabulary the others use
        order = sorted(args.rows, key=lambda r: r not in RF_ROWS)
        for row in order:
            if row in CHILD_ROWS:
                made = next((r["tokenizer"] for r in rows if "tokenizer" in r), None)
                rows.append(child_row(row, args, work, made) if made else
                            {"row": row, "error": "needs a rapidformer row first (its data)"})
            else:
                rows.append(rapidformer_row(row, args, work))
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r.pop("tokenizer", None)
    finish_speed_rows(args, rows, "trl-padded")


if __name__ == "__main__":
    main()
