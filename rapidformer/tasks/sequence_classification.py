"""Black-box sentence(-pair) classification: the seed's `--task sequence_classification`.

The same four methods a white-box user writes, filled in from the config: data from the data
group, a tokenizer, a Hugging Face `AutoModelForSequenceClassification`, accuracy and F1.
"""
from __future__ import annotations

import math

import torch
from torchmetrics.functional.classification import (binary_f1_score, multiclass_accuracy,
                                                    multiclass_f1_score)

from rapidformer.data.text_classification import load_classification_data, tokenize_splits
from rapidformer.data.tokenizers import build_tokenizer, pad_id_into, ready_to_pad, training_texts
from rapidformer.models.hf import build_sequence_classifier
from rapidformer.models.head_labels import head_labels
from rapidformer.tasks.base import TaskFinetuner, mean


def classification_metrics(predictions: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict:
    """Accuracy, and F1 of the positive class for two labels (GLUE's MRPC F1), macro F1 else."""
    predictions, labels = predictions.cpu(), labels.cpu()
    accuracy = multiclass_accuracy(predictions, labels, num_classes=num_labels, average="micro")
    if num_labels == 2:
        f1 = binary_f1_score(predictions, labels)
    else:
        f1 = multiclass_f1_score(predictions, labels, num_classes=num_labels, average="macro")
    return {"accuracy": float(accuracy), "f1": float(f1)}


class SequenceClassificationFinetuner(TaskFinetuner):
    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorWithPadding

        d, m = self.cfg.data, self.cfg.model
        data = load_classification_data(d, self.engine.run_dir, self.cfg.task.num_labels,
                                        head_labels(m))
        self.num_labels, self.label_names = data.num_labels, data.label_names
        self.scored_splits = data.scored_splits
        tokenizer_dir = self._resumed_tokenizer_dir() or self.engine.run_dir / "tokenizer"

        self.tokenizer = ready_to_pad(build_tokenizer(
            m, lambda: training_texts("sequence_classification", d, data.splits["train"]),
            tokenizer_dir, d.max_seq_length))
        encoded = tokenize_splits(data, d, self.tokenizer)
        self.require_examples(encoded, {k: len(v) for k, v in data.splits.items()})
        collate_fn = self.shape_batches(DataCollatorWithPadding(self.tokenizer, return_tensors="pt"))
        return encoded["train"], encoded.get("validation"), encoded.get("test"), collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        model = build_sequence_classifier(self.cfg.model, self.num_labels, self.tokenizer,
                                          self.label_names)
        pad_id_into(model.config, self.tokenizer)
        return self.batching.drive(model), None, None

    loss_unit = "examples"

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        predictions, labels = [], []
        loss_sum = 0.0
        for batch in eval_dataloader:
            outputs = model(**batch)  # every rank's, padding too: it may be a collective
            predictions.append(self.gather(outputs.logits.argmax(dim=-1)))  # padding: no rows
            labels.append(self.gather(batch["labels"]))
            if not self.padding_batch:
                # the batch's mean loss weighted by its examples: batches differ in size between
                # ranks (and from one process's), the mean over examples does not
                loss_sum += float(outputs.loss) * len(batch["labels"])
        loss_sum, = self.sum_over_ranks(loss_sum)
        if not labels or not sum(len(part) for part in labels):  # no example to score
            return {"accuracy": math.nan, "f1": math.nan, "loss": math.nan}
        predictions, labels = torch.cat(predictions), torch.cat(labels)
        metrics = classification_metrics(predictions, labels, self.num_labels)
        metrics["loss"] = mean(loss_sum, len(labels))  # labels: every rank's, gathered
        return metrics
