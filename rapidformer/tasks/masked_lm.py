"""Black-box masked language modelling: the seed's `--task masked_lm`. Text rows are
tokenized and cut at data.max_seq_length; data.mask_prob of the tokens (whole words with
task.whole_word_masking) are masked anew every time a training batch is made (BERT's 80/10/10
rule); perplexity at every evaluation, over masks drawn once per example from the seed and the
example's index, so that evaluations compare and every rank count or batching scores the same
masked tokens."""
from __future__ import annotations

import math

import torch

from rapidformer.data.tokenizers import training_texts
from rapidformer.models.hf import build_task_model
from rapidformer.tasks.base import TaskFinetuner, mean


class MaskedLMFinetuner(TaskFinetuner):
    columns = ("text_column",)

    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForLanguageModeling

        d = self.cfg.data
        splits = self.load_splits()
        tokenizer = self.make_tokenizer(lambda: training_texts("masked_lm", d, splits["train"]))
        whole_words = self.cfg.task.whole_word_masking

        def encode(batch):
            texts = [str(x) for x in batch[d.text_column] if x and str(x).strip()]
            if not texts:  # rows of no text only: none is kept (a tokenizer refuses no text)
                return {key: [] for key in tokenizer("x", return_offsets_mapping=whole_words)}
            return tokenizer(texts, truncation=True, max_length=d.max_seq_length,
                             return_offsets_mapping=whole_words)

        encoded = {name: ds.map(encode, batched=True, remove_columns=ds.column_names)
                   for name, ds in splits.items()}
        self.require_examples(encoded, {k: len(v) for k, v in splits.items()},
                              f"no text in data.text_column={d.text_column}",
                              f"fill the rows' {d.text_column} column, or set data.text_column "
                              f"to the column that holds the text")
        masking = DataCollatorForLanguageModeling(tokenizer, mlm_probability=d.mask_prob,
                                                  whole_word_mask=whole_words)
        scored = {name: masked_once(ds, masking, self.cfg.trainer.seed)
                  for name, ds in encoded.items() if name != "train"}
        for name, ds in scored.items():  # a masked token to score, or nothing to evaluate
            if not any(label != -100 for row in ds["labels"] for label in row):
                raise self.empty_split(
                    name, len(ds), fix="add examples or raise data.mask_prob",
                    what=f"none of its {len(ds)} examples has a token masked at data.mask_prob="
                         f"{d.mask_prob}, and a perplexity of no token is no number")
        collate = self.shape_batches(MaskOrPad(masking, tokenizer), masked_lm=True)
        return encoded["train"], scored.get("validation"), scored.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        model = build_task_model(self.cfg.model, "masked_lm", self.tokenizer)
        return self.batching.drive(model), None, None

    loss_unit = "labels"

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        loss_sum = masked = 0.0
        for batch in eval_dataloader:
            count = int((batch["labels"] != -100).sum())
            loss = float(model(**batch).loss)  # every rank's, padding too: maybe a collective
            # a small batch can have no masked token: its mean loss is NaN
            if count and not self.padding_batch:
                loss_sum += loss * count
                masked += count
        loss_sum, masked = self.sum_over_ranks(loss_sum, masked)
        loss = mean(loss_sum, masked)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def masked_once(dataset, masking, seed: int):
    """`dataset` with each row masked by `masking` once, from a seed of its own (the run's
    seed and the row's index): the masks do not depend on batches, ranks or the training's
    random stream, which is left where it was."""
    def mask(row, index):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + index)
            batch = masking([row])
        return {key: value[0].tolist() for key, value in batch.items()}

    dropped = [c for c in ("offset_mapping", "special_tokens_mask") if c in dataset.column_names]
    return dataset.map(mask, with_indices=True, remove_columns=dropped)


class MaskOrPad:
    """The task's collate function: training rows are masked anew in every batch; evaluation
    rows, masked already (they have labels), are only padded (labels with -100)."""

    def __init__(self, masking, tokenizer):
        from transformers import DataCollatorForTokenClassification

        self.masking = masking
        self.padding = DataCollatorForTokenClassification(tokenizer, return_tensors="pt")

    def __call__(self, features):
        return (self.padding if "labels" in features[0] else self.masking)(features)
