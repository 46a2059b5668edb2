"""The seed's "custom Trainer" pattern: your own loop over the engine's pieces, on any number
of processes.

    python -m rapidformer.data.synthetic data/pairs
    python -m rapidformer user_script=examples/own_loop.py model=hf model.name_or_path=MODEL_DIR \
        data=pairs_local data.path=data/pairs launcher.nproc_per_node=2

Run in CI on 2 processes by tests/test_distributed.py::test_the_seeds_own_loop_on_two_processes;
docs/own_loop.md shows it.
"""
import json
from functools import partial

import torch
from datasets import load_dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)

from rapidformer import Finetuner, RapidformerEngine, get_args

args = get_args()
engine = RapidformerEngine()
finetuner = Finetuner(engine=engine)

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
files = {s: f"{args.data_path}/{s}.jsonl" for s in ("train", "validation")}
datasets = load_dataset("json", data_files=files)
tokenized = datasets.map(
    lambda ex: tokenizer(ex["sentence1"], ex["sentence2"], truncation=True, max_length=64),
    batched=True, remove_columns=["idx", "sentence1", "sentence2"]).rename_column("label", "labels")
collate = lambda examples: tokenizer.pad(examples, padding="longest", return_tensors="pt")

train_dataloader = finetuner.build_data_loader(tokenized["train"], shuffle=True, collate_fn=collate)
eval_dataloader = finetuner.build_data_loader(tokenized["validation"], collate_fn=collate)

model = AutoModelForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path)
lr_scheduler = partial(get_linear_schedule_with_warmup, num_warmup_steps=2,
                       num_training_steps=args.epochs * len(train_dataloader))
model, optimizer, lr_scheduler = engine.compose(model_obj=model, lr_scheduler_fn=lr_scheduler)

losses = []
for epoch in range(args.epochs):
    model.train()
    for step, batch in enumerate(train_dataloader):
        loss = model(**batch).loss
        engine.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    model.eval()
    predictions, references = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        predictions.append(engine.gather(outputs.logits.argmax(dim=-1)))
        references.append(engine.gather(batch["labels"]))
    predictions, references = torch.cat(predictions), torch.cat(references)
    accuracy = float((predictions == references).float().mean())
if engine.is_main_process:
    with open(f"{args.save}/own_loop.json", "w") as f:
        json.dump({"accuracy": accuracy, "scored": len(references), "losses": losses,
                   "batches": len(train_dataloader), "world_size": engine.world_size}, f)
