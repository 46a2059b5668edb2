"""Extractive question answering, SQuAD-style: windows over long contexts, answer spans from
start/end logits, and SQuAD's exact-match and F1.

A context longer than the sequence is read in overlapping windows (`doc_stride` tokens of
overlap). Training: a window that holds the whole answer points at its first and last tokens,
one that does not points at [CLS] (index 0). Evaluation: each window keeps its example's index
and the character offsets of its context tokens (other tokens get (-1, -1)); the answer of an
example is the best-scoring valid span (start <= end, at most `max_answer_length` tokens, both
in the context) over all its windows, among the `n_best_size` best starts and ends of each.
"""
from __future__ import annotations

import collections
import re
import string

NOT_CONTEXT = (-1, -1)


def _answer(answers) -> tuple[str, int]:
    return answers["text"][0], answers["answer_start"][0]


def encode_windows(tokenizer, questions, contexts, max_length: int, stride: int):
    return tokenizer([q.lstrip() for q in questions], contexts, truncation="only_second",
                     max_length=max_length, stride=stride, return_overflowing_tokens=True,
                     return_offsets_mapping=True, padding="max_length",
                     padding_side="right")


def train_features(batch, tokenizer, d, t) -> dict:
    """Windows with start_positions / end_positions (batched `datasets.map` function)."""
    enc = encode_windows(tokenizer, batch[d.question_column], batch[d.context_column],
                         d.max_seq_length, t.doc_stride)
    starts, ends = [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        example = enc["overflow_to_sample_mapping"][i]
        text, first_char = _answer(batch[d.answers_column][example])
        last_char = first_char + len(text)
        sequence = enc.sequence_ids(i)
        lo = sequence.index(1)
        hi = len(sequence) - 1 - sequence[::-1].index(1)
        if not (offsets[lo][0] <= first_char and offsets[hi][1] >= last_char):
            starts.append(0)
            ends.append(0)
            continue
        start = lo
        while start <= hi and offsets[start][0] <= first_char:
            start += 1
        end = hi
        while end >= lo and offsets[end][1] >= last_char:
            end -= 1
        starts.append(start - 1)
        ends.append(end + 1)
    enc.pop("overflow_to_sample_mapping")
    enc.pop("offset_mapping")
    enc["start_positions"], enc["end_positions"] = starts, ends
    return enc


def eval_features(batch, indices, tokenizer, d, t) -> dict:
    """Windows with their example's index and context-only offsets (batched, with indices)."""
    enc = encode_windows(tokenizer, batch[d.question_column], batch[d.context_column],
                         d.max_seq_length, t.doc_stride)
    enc["example_index"] = [indices[j] for j in enc.pop("overflow_to_sample_mapping")]
    enc["offset_mapping"] = [
        [list(o) if s == 1 else list(NOT_CONTEXT) for o, s in zip(offsets, enc.sequence_ids(i))]
        for i, offsets in enumerate(enc["offset_mapping"])]
    return enc


def best_spans(start_logits, end_logits, example_index, offsets, n_best: int,
               max_answer_length: int) -> dict[int, tuple[float, int, int]]:
    """{example: (score, first character, end character)} of the best-scoring valid span of
    every example that has one (lists/arrays over windows); the score is start + end logit."""
    best: dict[int, tuple[float, int, int]] = {}
    for starts, ends, example, window in zip(start_logits, end_logits, example_index, offsets):
        starts, ends = list(map(float, starts)), list(map(float, ends))
        top_starts = sorted(range(len(starts)), key=starts.__getitem__, reverse=True)[:n_best]
        top_ends = sorted(range(len(ends)), key=ends.__getitem__, reverse=True)[:n_best]
        for s in top_starts:
            for e in top_ends:
                if tuple(window[s]) == NOT_CONTEXT or tuple(window[e]) == NOT_CONTEXT \
                        or e < s or e - s + 1 > max_answer_length:
                    continue
                score = starts[s] + ends[e]
                if int(example) not in best or score > best[int(example)][0]:
                    best[int(example)] = (score, int(window[s][0]), int(window[e][1]))
    return best


def best_answers(start_logits, end_logits, example_index, offsets, contexts: list[str],
                 n_best: int, max_answer_length: int) -> list[str]:
    """The predicted answer text of every example (lists/arrays over windows)."""
    spans = best_spans(start_logits, end_logits, example_index, offsets, n_best,
                       max_answer_length)
    return [contexts[i][spans[i][1]:spans[i][2]] if i in spans else ""
            for i in range(len(contexts))]


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, truths: list[str]) -> float:
    return float(max(normalize(prediction) == normalize(t) for t in truths))


def f1_score(prediction: str, truths: list[str]) -> float:
    def f1(pred: str, truth: str) -> float:
        p, g = normalize(pred).split(), normalize(truth).split()
        common = sum((collections.Counter(p) & collections.Counter(g)).values())
        if not p or not g:
            return float(p == g)
        if common == 0:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)

    return max(f1(prediction, t) for t in truths)
