"""Unsloth's LoRA on the lora_sft benchmark's workload: the same random Llama 3.2 1B-shaped model
(bf16, 128,256 output rows), the same token/label rows, LoRA r=16 alpha=32 dropout 0.05 on
q/k/v/o/gate/up/down, bf16 autocast, fused AdamW at a constant lr 2e-4, clipping 1.0, no
activation checkpointing, trained by the loop hf_child writes by hand (its collator, its shuffled
order), so only the model code differs. Unsloth loads from a directory, so the model is saved
under --work first and loaded back through FastLanguageModel.

Packed: padding-free, as Unsloth's own trainer does it — whole conversations concatenated into one
row of at most --packed-batch x --seq tokens, position ids restarting at each, and their lengths as
`packed_seq_lengths` (Unsloth's attention keeps them apart; no attention mask, no pad).

QLoRA (four_bit): the same, the saved bf16 base loaded back with load_in_4bit=True, Unsloth's
4-bit path (bitsandbytes NF4, bf16 compute); checkpointing="unsloth" is Unsloth's own activation
checkpointing (its default, layer inputs offloaded to the host), the lowest-memory setting.

Unsloth patches transformers and peft when it is imported, so this runs in a fresh child process
and imports it first. BENCH_UNSLOTH_SITE, when set, is put first on sys.path before that (the
folder holding unsloth and the trl/datasets versions it pins), so the other rows keep theirs.
Whatever fails, the process exits 1 with the exception on one line, the last of stderr.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def unsloth_child(args, packed: bool, four_bit: bool = False, checkpointing=False) -> None:
    """One row: prints one JSON line, or exits 1 with the error as the last stderr line.
    four_bit: the base loaded in 4 bits (load_in_4bit). checkpointing: Unsloth's
    use_gradient_checkpointing (False, or "unsloth": its default)."""
    try:
        _run(args, packed, four_bit, checkpointing)
    except BaseException as error:  # noqa: BLE001 — reported, never turned into numbers
        if isinstance(error, SystemExit) and not error.code:
            raise
        traceback.print_exc()
        sys.stdout.flush()
        print(f"{type(error).__name__}: {' '.join(str(error).split())}"[:2000], file=sys.stderr,
              flush=True)
        sys.exit(1)


def _import_unsloth(work: str):
    site = os.environ.get("BENCH_UNSLOTH_SITE")
    if site:
        sys.path.insert(0, site)
    early = [m for m in ("transformers", "peft", "trl") if m in sys.modules]
    if early:
        raise RuntimeError(f"{early} imported before unsloth: it must come first (a new process)")
    # no hub at all: the model is local, and the machine may have no network (statistics pings)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    # its generated modules go under --work, not into the working directory
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(Path(work) / "unsloth_compiled_cache"))
    import unsloth  # noqa: F401 — before transformers and peft: it patches them

    return unsloth


def _run(args, packed: bool, four_bit: bool, checkpointing) -> None:
    unsloth = _import_unsloth(args.work)
    import torch
    from unsloth import FastLanguageModel

    # after unsloth (lora_sft imports torch only)
    from lora_sft import SKIP, _model_and_rows, heldout, micro_batch
    from rapidformer.data.lengths import IGNORE

    if args.iters <= SKIP:
        raise ValueError(f"--iters {args.iters} leaves no step after the first {SKIP}")
    tokenizer, rows, model = _model_and_rows(args)
    saved = Path(tempfile.mkdtemp(prefix="unsloth-model-", dir=args.work))
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 copy's blocks: the 4-bit load needs the room
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(saved), max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=four_bit,
        load_in_8bit=False, full_finetuning=False, use_gradient_checkpointing=checkpointing,
        offload_embedding=False, fix_tokenizer=False, local_files_only=True)
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS, bias="none",
        use_gradient_checkpointing=checkpointing, random_state=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, fused=device.type == "cuda")
    pad = tokenizer.pad_token_id
    batch = micro_batch(args, packed)
    batches = (_packed(rows, batch * args.seq, torch) if packed
               else _padded(rows, args.batch, pad, IGNORE, torch))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    tokens = samples = slots = 0
    started = first_step = loss = None
    for step, (inputs, real, count) in enumerate(batches, start=1):
        if step == 1:
            sync()
            begun = time.perf_counter()
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        with autocast:
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            sync()
            first_step = time.perf_counter() - begun
        if step == SKIP:
            sync()
            started = time.perf_counter()
        elif step > SKIP:
            tokens += real
            samples += count
            slots += inputs["input_ids"].numel()
        if step == args.iters:
            break
    sync()
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    unsloth_utils = sys.modules.get("unsloth.models._utils")  # the GPU backend's (not on CPU)
    print(json.dumps({
        "micro_batch": batch, "tokens_per_s": round(tokens / elapsed),
        "samples_per_s": round(samples / elapsed, 1), "padding_frac": round(1 - tokens / slots, 3),
        "peak_mem_gb": None if peak is None else round(peak, 2),
        "loss_at_end": round(float(loss.detach()), 4),
        **heldout(model, tokenizer, args),
        "first_step_s": round(first_step, 2), "unsloth": unsloth.__version__,
        "unsloth_backend": "cpu" if getattr(unsloth, "_IS_CPU_BACKEND", False) else device.type,
        "gradient_checkpointing": checkpointing, "load_in_4bit": four_bit,
        "flash_attn": bool(getattr(unsloth_utils, "HAS_FLASH_ATTENTION", False)),
        "xformers": getattr(unsloth_utils, "xformers_version", None)}))


def _padded(rows, batch_size: int, pad: int, ignore: int, torch):
    """hf_child's batches: the same shuffled order, padded to the longest of each batch."""
    def collate(batch):
        longest = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), longest), pad)
        labels = torch.full((len(batch), longest), ignore)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = (torch.tensor(r["input_ids"]),
                                                       torch.tensor(r["labels"]), 1)
        return ids, labels, mask

    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=True,
                                         collate_fn=collate, num_workers=2, pin_memory=True,
                                         generator=torch.Generator().manual_seed(0))
    while True:
        for ids, labels, mask in loader:
            yield ({"input_ids": ids, "attention_mask": mask, "labels": labels},
                   int(mask.sum()), ids.shape[0])


def _packed(rows, budget: int, torch):
    """Padding-free rows: whole conversations, in a shuffled order, concatenated up to `budget`
    tokens; positions restart at each and `packed_seq_lengths` tells Unsloth where they end."""
    columns = rows.select_columns(["input_ids", "labels"]).to_dict()
    ids_all, labels_all = columns["input_ids"], columns["labels"]
    generator = torch.Generator().manual_seed(0)
    while True:
        order = torch.randperm(len(ids_all), generator=generator).tolist()
        group, total = [], 0
        for i in order:
            n = min(len(ids_all[i]), budget)
            if group and total + n > budget:
                yield _pack(group, ids_all, labels_all, torch)
                group, total = [], 0
            group.append((i, n))
            total += n
        if group:
            yield _pack(group, ids_all, labels_all, torch)


def _pack(group, ids_all, labels_all, torch):
    ids = torch.tensor([t for i, n in group for t in ids_all[i][:n]]).unsqueeze(0)
    labels = torch.tensor([t for i, n in group for t in labels_all[i][:n]]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for _, n in group]).unsqueeze(0)
    lengths = torch.tensor([n for _, n in group], dtype=torch.int32)
    return ({"input_ids": ids, "labels": labels, "position_ids": positions,
             "packed_seq_lengths": lengths}, ids.shape[1], len(group))
