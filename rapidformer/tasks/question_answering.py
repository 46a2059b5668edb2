"""Black-box extractive question answering on SQuAD-shaped data: the seed's
`--task question_answering`. Long contexts are read in overlapping windows; each evaluation
turns start/end logits into answer texts and scores them with SQuAD's exact match and F1
(rapidformer/data/qa.py)."""
from __future__ import annotations

import math

import torch

from rapidformer.data.qa import best_answers, eval_features, exact_match, f1_score, train_features
from rapidformer.data.qa_rows import checked_splits
from rapidformer.data.tokenizers import training_texts
from rapidformer.models.hf import build_task_model
from rapidformer.tasks.base import TaskFinetuner


class QuestionAnsweringFinetuner(TaskFinetuner):
    columns = ("question_column", "context_column", "answers_column")

    def train_valid_test_datasets_provider(self):
        from transformers import default_data_collator

        d, t = self.cfg.data, self.cfg.task
        splits = checked_splits(self.load_splits(), d)
        tokenizer = self.make_tokenizer(
            lambda: training_texts("question_answering", d, splits["train"]))
        train = splits["train"].map(lambda b: train_features(b, tokenizer, d, t), batched=True,
                                    remove_columns=splits["train"].column_names)
        # evaluation windows of validation and test point into one list of examples
        self.examples, evaluated, offset = [], {}, 0
        for name in ("validation", "test"):
            if name in splits:
                ds = splits[name]
                evaluated[name] = ds.map(
                    lambda b, idx, first=offset: eval_features(
                        b, [first + i for i in idx], tokenizer, d, t),
                    batched=True, with_indices=True, remove_columns=ds.column_names)
                self.examples += [{"context": row[d.context_column],
                                   "answers": list(row[d.answers_column]["text"])} for row in ds]
                offset += len(ds)
        self.require_examples(evaluated, {k: len(v) for k, v in splits.items()})
        return train, evaluated.get("validation"), evaluated.get("test"), default_data_collator

    def model_optimizer_lr_scheduler_provider(self):
        return build_task_model(self.cfg.model, "question_answering", self.tokenizer), None, None

    loss_unit = "examples"

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model, t = model[0], self.cfg.task
        starts, ends, examples, offsets = [], [], [], []
        for batch in eval_dataloader:
            example_index, offset_mapping = batch.pop("example_index"), batch.pop("offset_mapping")
            outputs = model(**batch)  # every rank's, padding too: it may be a collective
            # every window of every rank (a padding batch's gather adds no row): an example's
            # windows may fall on several ranks, its answer is chosen over all of them
            starts.append(self.gather(outputs.start_logits.float()))
            ends.append(self.gather(outputs.end_logits.float()))
            examples.append(self.gather(example_index))
            offsets.append(self.gather(offset_mapping))
        if not examples or not sum(len(part) for part in examples):  # no window to score
            return {"exact_match": math.nan, "f1": math.nan}
        examples_cat = torch.cat(examples).cpu()
        predictions = best_answers(torch.cat(starts).cpu(), torch.cat(ends).cpu(), examples_cat,
                                   torch.cat(offsets).cpu().tolist(),
                                   [e["context"] for e in self.examples], t.n_best_size,
                                   t.max_answer_length)
        scored = sorted(set(examples_cat.tolist()))  # each example once, however many windows
        return self._scores([(predictions[i], self.examples[i]["answers"]) for i in scored])

    @staticmethod
    def _scores(pairs) -> dict:
        n = max(len(pairs), 1)
        return {"exact_match": sum(exact_match(p, a) for p, a in pairs) / n,
                "f1": sum(f1_score(p, a) for p, a in pairs) / n}
