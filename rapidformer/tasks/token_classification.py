"""Black-box token classification (NER on CoNLL-shaped data): the seed's
`--task token_classification`. Rows hold a list of words and a list of their tags (names such
as B-PER, or ids with names from the dataset's features); entity precision, recall and F1
(seqeval's rules) and token accuracy at every evaluation."""
from __future__ import annotations


from rapidformer.data.token_labels import align_labels, entity_counts, precision_recall_f1
from rapidformer.errors import InputError
from rapidformer.models.hf import build_task_model
from rapidformer.tasks.base import TaskFinetuner


def tag_names(train, column: str) -> list[str]:
    """The tag vocabulary: the dataset's ClassLabel names, or the names found in the training
    split ("O" first, then sorted)."""
    feature = getattr(train.features[column], "feature", None)
    if getattr(feature, "names", None):
        return list(feature.names)
    found = {tag for row in train[column] for tag in row}
    if all(isinstance(t, int) for t in found):
        return [str(i) for i in range(max(found) + 1)]
    return sorted(map(str, found), key=lambda t: (t != "O", t))


class TokenClassificationFinetuner(TaskFinetuner):
    columns = ("tokens_column", "tags_column")

    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForTokenClassification

        d, t = self.cfg.data, self.cfg.task
        splits = self.load_splits()
        self.names = tag_names(splits["train"], d.tags_column)
        index = {name: i for i, name in enumerate(self.names)}
        tokenizer = self.make_tokenizer(
            lambda: (" ".join(map(str, row)) for row in splits["train"][d.tokens_column]))

        def encode(batch):
            enc = tokenizer(batch[d.tokens_column], is_split_into_words=True, truncation=True,
                            max_length=d.max_seq_length)
            labels = []
            for i, tags in enumerate(batch[d.tags_column]):
                try:
                    ids = [tag if isinstance(tag, int) else index[str(tag)] for tag in tags]
                except KeyError as exc:
                    raise InputError(f"tag {exc} in {d.tags_column} is not in the training "
                                     f"split's tags ({', '.join(self.names)})") from None
                labels.append(align_labels(enc.word_ids(i), ids, t.label_all_tokens, self.names))
            enc["labels"] = labels
            return enc

        encoded = {name: ds.map(encode, batched=True, remove_columns=ds.column_names)
                   for name, ds in splits.items()}
        collate = DataCollatorForTokenClassification(tokenizer, return_tensors="pt")
        return encoded["train"], encoded.get("validation"), encoded.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        labels = {"num_labels": len(self.names), "id2label": dict(enumerate(self.names)),
                  "label2id": {n: i for i, n in enumerate(self.names)}}
        return build_task_model(self.cfg.model, "token_classification", self.tokenizer,
                                **labels), None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        correct = n_pred = n_gold = right_tokens = tokens = loss_sum = batches = 0
        for batch in eval_dataloader:
            outputs = model(**batch)
            predicted, gold = outputs.logits.argmax(dim=-1).cpu(), batch["labels"].cpu()
            keep = gold != -100
            right_tokens += int((predicted[keep] == gold[keep]).sum())
            tokens += int(keep.sum())
            rows_pred = [[self.names[i] for i in p[k].tolist()] for p, k in zip(predicted, keep)]
            rows_gold = [[self.names[i] for i in g[k].tolist()] for g, k in zip(gold, keep)]
            c, p, g = entity_counts(rows_pred, rows_gold)
            correct, n_pred, n_gold = correct + c, n_pred + p, n_gold + g
            loss_sum, batches = loss_sum + float(outputs.loss), batches + 1
        correct, n_pred, n_gold, right_tokens, tokens, loss_sum, batches = self.sum_over_ranks(
            correct, n_pred, n_gold, right_tokens, tokens, loss_sum, batches)
        metrics = precision_recall_f1(correct, n_pred, n_gold)
        metrics["accuracy"] = right_tokens / max(tokens, 1)
        metrics["loss"] = loss_sum / max(batches, 1)
        return metrics
