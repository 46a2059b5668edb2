"""One prediction per input row, for each fine-tuning task, made the way the task's training
read its data: the same tokenizer calls, data.max_seq_length, task options (QA windows,
source prefix, beams), and the label or tag names the training split gave the ids; rows padded
on the right, as training pads them (tasks/batching.RightPadded), whatever the tokenizer's side.

Each predictor takes a `Predicting` (model, tokenizer, config, label names, options) and the
rows (dicts holding the columns the run's data config names) and returns the new columns of
each row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from rapidformer.data.qa import best_spans, eval_features
from rapidformer.errors import InputError

@dataclass
class Predicting:
    model: torch.nn.Module
    tokenizer: object
    cfg: object  # the run's RunConfig
    device: torch.device
    batch_size: int
    label_names: list = field(default_factory=list)  # id -> name; empty: ids are the labels
    top_k: int = 5
    max_new_tokens: int | None = None
    num_beams: int | None = None

    def forward(self, encoded: dict):
        return self.model(**{k: torch.as_tensor(v).to(self.device) for k, v in encoded.items()})


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _text(value) -> str:
    return "" if value is None else str(value)


def sequence_classification(p: Predicting, rows: list[dict]) -> list[dict]:
    """`prediction`: the label (its name, or its id when training's labels were ids) and
    `score`: its probability."""
    d, out = p.cfg.data, []
    for batch in _chunks(rows, p.batch_size):
        first = [_text(r[d.text_a_column]) for r in batch]
        second = [_text(r[d.text_b_column]) for r in batch] if d.text_b_column else None
        encoded = p.tokenizer(first, second, truncation=True, max_length=d.max_seq_length,
                              padding=True, padding_side="right", return_tensors="pt")
        scores, ids = p.forward(encoded).logits.float().softmax(dim=-1).max(dim=-1)
        out += [{"prediction": p.label_names[i] if p.label_names else i, "score": s}
                for i, s in zip(ids.tolist(), scores.tolist())]
    return out


def words_of(value, where: str, column: str) -> list[str]:
    """A row's words: a list of strings, or text (split at white space; a csv cell may hold a
    JSON list)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(w, str) for w in value):
        return value
    raise InputError(f"{where} has {str(value)[:40]!r} in column '{column}' "
                     f"(data.tokens_column), not words: give a list of strings or text")


def token_classification(p: Predicting, rows: list[dict], places: list[str]) -> list[dict]:
    """`predicted_tags`: one tag per input word, the tag of the word's first sub-token (the
    one training labels). Words past data.max_seq_length tokens are read in further windows, so
    every word gets its tag; a word the tokenizer turns into no token gets null."""
    d, out = p.cfg.data, []
    column = d.tokens_column
    for batch, where in zip(_chunks(rows, p.batch_size), _chunks(places, p.batch_size)):
        words = [words_of(r[column], w, column) for r, w in zip(batch, where)]
        tags = [[None] * len(w) for w in words]
        if any(words):
            encoded = p.tokenizer(words, is_split_into_words=True, truncation=True,
                                  max_length=d.max_seq_length, return_overflowing_tokens=True,
                                  padding=True, padding_side="right", return_tensors="pt")
            rows_of = encoded.pop("overflow_to_sample_mapping").tolist()
            predicted = p.forward(encoded).logits.argmax(dim=-1).tolist()
            for window, (row, ids) in enumerate(zip(rows_of, predicted)):
                previous = None
                for position, word in enumerate(encoded.word_ids(window)):
                    if word is not None and word != previous and tags[row][word] is None:
                        tags[row][word] = p.label_names[ids[position]]
                    previous = word
        out += [{"predicted_tags": t} for t in tags]
    return out


def question_answering(p: Predicting, rows: list[dict]) -> list[dict]:
    """`answer` (text of the context), `answer_start`/`answer_end` (its characters in the
    context, end exclusive) and `score` (start + end logit), the best valid span over all of a
    context's windows as the task's evaluation picks it; no valid span: an empty answer."""
    d, t, out = p.cfg.data, p.cfg.task, []
    for batch in _chunks(rows, p.batch_size):
        columns = {d.question_column: [_text(r[d.question_column]) for r in batch],
                   d.context_column: [_text(r[d.context_column]) for r in batch]}
        features = eval_features(columns, list(range(len(batch))), p.tokenizer, d, t)
        examples, offsets = features.pop("example_index"), features.pop("offset_mapping")
        inputs = dict(features)
        starts, ends = [], []
        for window in _chunks(list(range(len(examples))), p.batch_size):
            outputs = p.forward({k: [v[i] for i in window] for k, v in inputs.items()})
            starts += outputs.start_logits.float().cpu().tolist()
            ends += outputs.end_logits.float().cpu().tolist()
        spans = best_spans(starts, ends, examples, offsets, t.n_best_size, t.max_answer_length)
        for i, context in enumerate(columns[d.context_column]):
            if i in spans:
                score, first, end = spans[i]
                out.append({"answer": context[first:end], "answer_start": first,
                            "answer_end": end, "score": score})
            else:
                out.append({"answer": "", "answer_start": None, "answer_end": None,
                            "score": None})
    return out


def masked_lm(p: Predicting, rows: list[dict]) -> list[dict]:
    """`masks`: for each mask token of the text, in order, the top-k tokens with their
    probabilities."""
    d, tokenizer, out = p.cfg.data, p.tokenizer, []
    if tokenizer.mask_token_id is None:
        raise InputError("the run's tokenizer has no mask token: masked-token prediction needs "
                         "one")
    for batch in _chunks(rows, p.batch_size):
        encoded = tokenizer([_text(r[d.text_column]) for r in batch], truncation=True,
                            max_length=d.max_seq_length, padding=True, padding_side="right",
                            return_tensors="pt")
        logits = p.forward(encoded).logits.float()
        for row, ids in enumerate(encoded["input_ids"].tolist()):
            masks = []
            for position in [i for i, token in enumerate(ids) if token == tokenizer.mask_token_id]:
                probs, top = logits[row, position].softmax(dim=-1).topk(p.top_k)
                masks.append([{"token": tokenizer.convert_ids_to_tokens(i), "score": s}
                              for i, s in zip(top.tolist(), probs.tolist())])
            out.append({"masks": masks})
    return out


def seq2seq_lm(p: Predicting, rows: list[dict]) -> list[dict]:
    """`generated`: the model's text for the source (task.source_prefix prepended), with
    task.num_beams beams and up to task.max_target_length new tokens unless given."""
    d, t, out = p.cfg.data, p.cfg.task, []
    for batch in _chunks(rows, p.batch_size):
        encoded = p.tokenizer([t.source_prefix + _text(r[d.document_column]) for r in batch],
                              truncation=True, max_length=d.max_seq_length, padding=True,
                              padding_side="right", return_tensors="pt").to(p.device)
        generated = p.model.generate(input_ids=encoded["input_ids"],
                                     attention_mask=encoded["attention_mask"],
                                     num_beams=p.num_beams or t.num_beams,
                                     max_new_tokens=p.max_new_tokens or t.max_target_length)
        out += [{"generated": text}
                for text in p.tokenizer.batch_decode(generated, skip_special_tokens=True)]
    return out


# the columns each task's prediction adds to a row
OUTPUT_COLUMNS = {"sequence_classification": ("prediction", "score"),
                  "token_classification": ("predicted_tags",),
                  "question_answering": ("answer", "answer_start", "answer_end", "score"),
                  "masked_lm": ("masks",),
                  "seq2seq_lm": ("generated",)}


def input_columns(cfg) -> dict[str, str]:
    """{config key: column} of the columns each task's prediction reads."""
    d, task = cfg.data, cfg.task.name
    keys = {"sequence_classification": ["text_a_column"] + (["text_b_column"]
                                                             if d.text_b_column else []),
            "token_classification": ["tokens_column"],
            "question_answering": ["question_column", "context_column"],
            "masked_lm": ["text_column"],
            "seq2seq_lm": ["document_column"]}[task]
    return {f"data.{key}": getattr(d, key) for key in keys}
