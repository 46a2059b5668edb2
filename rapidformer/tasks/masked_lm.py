"""Black-box masked language modelling: the seed's `--task masked_lm`. Text rows are
tokenized and cut at data.max_seq_length; data.mask_prob of the tokens (whole words with
task.whole_word_masking) are masked anew every time a batch is made (BERT's 80/10/10 rule);
perplexity at every evaluation, over masks drawn from a fixed seed so evaluations compare."""
from __future__ import annotations

import math

import torch

from rapidformer.models.hf import build_task_model
from rapidformer.tasks.base import TaskFinetuner


class MaskedLMFinetuner(TaskFinetuner):
    columns = ("text_column",)

    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForLanguageModeling

        d = self.cfg.data
        splits = self.load_splits()
        tokenizer = self.make_tokenizer(lambda: (str(x) for x in splits["train"][d.text_column]))
        whole_words = self.cfg.task.whole_word_masking

        def encode(batch):
            texts = [str(x) for x in batch[d.text_column] if x and str(x).strip()]
            return tokenizer(texts, truncation=True, max_length=d.max_seq_length,
                             return_offsets_mapping=whole_words)

        encoded = {name: ds.map(encode, batched=True, remove_columns=ds.column_names)
                   for name, ds in splits.items()}
        collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=d.mask_prob,
                                                  whole_word_mask=whole_words)
        return encoded["train"], encoded.get("validation"), encoded.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        return build_task_model(self.cfg.model, "masked_lm", self.tokenizer), None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        loss_sum = masked = 0.0
        # the same masks at every evaluation, without moving the training's random stream
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.trainer.seed + self.engine.rank)
            for batch in eval_dataloader:
                count = int((batch["labels"] != -100).sum())
                loss = float(model(**batch).loss)  # every rank's forward runs (sharded weights)
                if count:  # a small batch can have no masked token: its mean loss is NaN
                    loss_sum += loss * count
                    masked += count
        loss_sum, masked = self.sum_over_ranks(loss_sum, masked)
        loss = loss_sum / max(masked, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
