"""The seed's white-box fine-tuning example on today's libraries: a Finetuner subclass.

    python -m rapidformer.data.synthetic data/pairs
    python -m rapidformer user_script=examples/finetuner_user_script.py model=hf \
        model.name_or_path=MODEL_DIR data=pairs_local data.path=data/pairs

Run in CI by tests/test_train.py::test_white_box_user_script; docs/white_box.md shows it.
"""
import torch
from datasets import load_dataset
from transformers import AutoTokenizer, BertForSequenceClassification

from rapidformer import Finetuner, RapidformerEngine, get_args


class MyFinetuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)

        def tokenize_function(examples):
            return tokenizer(examples["sentence1"], examples["sentence2"], truncation=True,
                             max_length=args.seq_length)

        files = {s: f"{args.data_path}/{s}.jsonl" for s in ("train", "validation", "test")}
        datasets = load_dataset("json", data_files=files)
        tokenized = datasets.map(tokenize_function, batched=True,
                                 remove_columns=["idx", "sentence1", "sentence2"])
        tokenized = tokenized.rename_column("label", "labels")  # the seed's rename_column_

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return tokenized["train"], tokenized["validation"], tokenized["test"], collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = BertForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path)
        return model, None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = self.gather(outputs.logits.argmax(dim=-1))
            references = self.gather(batch["labels"])
            correct += int((predictions == references).sum())
            total += len(references)
        return {"accuracy": correct / total, "seen": total}


engine = RapidformerEngine()
trainer = MyFinetuner(engine=engine)
trainer.train()
