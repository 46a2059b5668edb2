"""Black-box sequence-to-sequence LM (summarization-shaped, T5/BART models): the seed's
`--task seq2seq_lm`. Sources (with task.source_prefix) and targets are tokenized, target padding
is -100; each evaluation generates with task.num_beams beams and scores ROUGE-L (torchmetrics)
against the targets, and reports the teacher-forced loss."""
from __future__ import annotations


from rapidformer.data.tokenizers import training_texts
from rapidformer.models.hf import build_task_model
from rapidformer.tasks.base import TaskFinetuner, mean


class Seq2SeqFinetuner(TaskFinetuner):
    columns = ("document_column", "summary_column")

    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForSeq2Seq

        d, t = self.cfg.data, self.cfg.task
        splits = self.load_splits()
        tokenizer = self.make_tokenizer(lambda: training_texts("seq2seq_lm", d, splits["train"]))

        def encode(batch):
            sources = [t.source_prefix + str(x) for x in batch[d.document_column]]
            enc = tokenizer(sources, truncation=True, max_length=d.max_seq_length)
            targets = tokenizer(text_target=[str(x) for x in batch[d.summary_column]],
                                truncation=True, max_length=t.max_target_length)
            enc["labels"] = targets["input_ids"]
            return enc

        encoded = {name: ds.map(encode, batched=True, remove_columns=ds.column_names)
                   for name, ds in splits.items()}
        self.require_examples(encoded, {k: len(v) for k, v in splits.items()})
        collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")
        return encoded["train"], encoded.get("validation"), encoded.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        return build_task_model(self.cfg.model, "seq2seq_lm", self.tokenizer), None, None

    loss_unit = "labels"

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        from torchmetrics.functional.text.rouge import rouge_score

        wrapped, t, tokenizer = model[0], self.cfg.task, self.tokenizer
        generator = self.engine.unwrapped_model()  # `generate` is the Hugging Face model's
        # sharded weights are gathered by every rank's forward: ranks generate in step
        synced = self.engine.strategy.forward_is_collective
        rouge_sum = loss_sum = rows = targets = 0.0
        for batch in eval_dataloader:
            # the mean over the batch's target tokens, weighted by them: the mean over every
            # target token, however they fall into batches and ranks
            count = int((batch["labels"] != -100).sum())
            loss = float(wrapped(**batch).loss)  # every rank's, padding too: maybe a collective
            # a padding batch generates too when generation is a collective (synced_gpus keeps
            # each rank's decode going until every rank's is done)
            if self.padding_batch and not synced:
                continue
            generated = generator.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                num_beams=t.num_beams, max_new_tokens=t.max_target_length, synced_gpus=synced)
            if self.padding_batch:
                continue
            if count:
                loss_sum += loss * count
                targets += count
            labels = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
            predictions = tokenizer.batch_decode(generated, skip_special_tokens=True)
            references = tokenizer.batch_decode(labels, skip_special_tokens=True)
            for prediction, reference in zip(predictions, references):
                scores = rouge_score(prediction, reference, rouge_keys=("rougeL",))
                rouge_sum += float(scores["rougeL_fmeasure"])
                rows += 1
        rouge_sum, rows, loss_sum, targets = self.sum_over_ranks(rouge_sum, rows, loss_sum,
                                                                 targets)
        return {"rougeL": mean(rouge_sum, rows), "loss": mean(loss_sum, targets)}
