"""Black-box token classification (NER on CoNLL-shaped data): the seed's
`--task token_classification`. Rows hold a list of words and a list of their tags (names such
as B-PER, or ids with names from the dataset's features), checked at loading by the tag rule of
rapidformer/data/token_labels.py; entity precision, recall and F1 (seqeval's rules) and token
accuracy at every evaluation."""
from __future__ import annotations

import logging
import math

from rapidformer.data.token_labels import (align_labels, entity_counts, load_token_data,
                                           precision_recall_f1, unseen_entities)
from rapidformer.data.tokenizers import ready_to_pad, training_texts
from rapidformer.models.hf import build_task_model
from rapidformer.models.head_labels import head_labels
from rapidformer.tasks.base import TaskFinetuner, mean

log = logging.getLogger("rapidformer")


class TokenClassificationFinetuner(TaskFinetuner):
    columns = ("tokens_column", "tags_column")

    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForTokenClassification

        d, t = self.cfg.data, self.cfg.task
        # every tag checked and made an id here, before training (the rule: data/token_labels)
        data = load_token_data(d, self.engine.run_dir, t.num_labels,
                               head=head_labels(self.cfg.model))
        splits, self.names, self.scored_splits = data.splits, data.names, data.scored_splits
        tokenizer = ready_to_pad(self.make_tokenizer(
            lambda: training_texts("token_classification", d, splits["train"])))

        def encode(batch, split):
            enc = tokenizer(batch[d.tokens_column], is_split_into_words=True, truncation=True,
                            max_length=d.max_seq_length)
            enc["labels"] = [align_labels(enc.word_ids(i), ids, t.label_all_tokens, self.names)
                             for i, ids in enumerate(batch[d.tags_column])]
            if split != "train":  # the scores count every gold entity, those cut off too
                enc["unseen"] = [unseen_entities(enc.word_ids(i), ids, enc["labels"][i],
                                                 self.names)
                                 for i, ids in enumerate(batch[d.tags_column])]
            return enc

        encoded = {name: ds.map(encode, batched=True, remove_columns=ds.column_names,
                                fn_kwargs={"split": name})
                   for name, ds in splits.items()}
        self.unseen = {}  # an evaluated split's dataset -> its gold entities past the cut
        for name in [n for n in encoded if n != "train"]:
            unseen = sum(encoded[name]["unseen"])
            encoded[name] = encoded[name].remove_columns("unseen")
            self.unseen[id(encoded[name])] = unseen
            if unseen:
                log.warning("%s: %d gold entities lie past data.max_seq_length=%d tokens of "
                            "their sentences; the model never reads them and the scores count "
                            "them as missed: raise data.max_seq_length to score them",
                            name, unseen, d.max_seq_length)
        self.require_examples(encoded, {k: len(v) for k, v in splits.items()})
        collate = self.shape_batches(DataCollatorForTokenClassification(tokenizer,
                                                                        return_tensors="pt"))
        return encoded["train"], encoded.get("validation"), encoded.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        labels = {"num_labels": len(self.names), "id2label": dict(enumerate(self.names)),
                  "label2id": {n: i for i, n in enumerate(self.names)}}
        model = build_task_model(self.cfg.model, "token_classification", self.tokenizer, **labels)
        return self.batching.drive(model), None, None

    loss_unit = "labels"

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        correct = n_pred = n_gold = right_tokens = tokens = loss_sum = 0
        for batch in eval_dataloader:
            outputs = model(**batch)  # every rank's, padding too: it may be a collective
            if self.padding_batch:
                continue
            predicted, gold = outputs.logits.argmax(dim=-1).cpu(), batch["labels"].cpu()
            keep = gold != -100
            right_tokens += int((predicted[keep] == gold[keep]).sum())
            tokens += int(keep.sum())
            rows_pred = [[self.names[i] for i in p[k].tolist()] for p, k in zip(predicted, keep)]
            rows_gold = [[self.names[i] for i in g[k].tolist()] for g, k in zip(gold, keep)]
            c, p, g = entity_counts(rows_pred, rows_gold)
            correct, n_pred, n_gold = correct + c, n_pred + p, n_gold + g
            # the mean over the batch's labelled tokens, weighted by them: the mean over every
            # labelled token, however the tokens fall into batches and ranks
            loss_sum += float(outputs.loss) * int(keep.sum()) if keep.any() else 0.0
        correct, n_pred, n_gold, right_tokens, tokens, loss_sum = self.sum_over_ranks(
            correct, n_pred, n_gold, right_tokens, tokens, loss_sum)
        n_gold += self._unseen_in(eval_dataloader)  # the split's, on every rank
        if not tokens:  # no labelled token to score
            return {"precision": math.nan, "recall": math.nan, "f1": math.nan,
                    "accuracy": math.nan, "loss": math.nan}
        metrics = precision_recall_f1(correct, n_pred, n_gold)
        metrics["accuracy"] = mean(right_tokens, tokens)
        metrics["loss"] = mean(loss_sum, tokens)
        return metrics

    def _unseen_in(self, loader) -> int:
        """The gold entities past the cut of the split `loader` reads (0 for a loader of other
        data: a white-box subclass's own)."""
        dataset = getattr(getattr(loader, "loader", loader), "dataset", None)
        return getattr(self, "unseen", {}).get(id(dataset), 0)
