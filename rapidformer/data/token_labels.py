"""Token classification: word-level tags aligned to sub-tokens, and entity-level scores.

A word split into several sub-tokens keeps its tag on the first one; the others get -100 (not
trained on, not scored) unless `label_all_tokens`, which gives them the word's tag — with a B-
tag turned into the matching I- tag, so that an entity still starts once. Special tokens and
padding always get -100.

Scores follow seqeval's default (CoNLL) rules: an entity is a maximal run of tokens of one type
that starts at a B- tag, or at an I- tag that does not continue an entity of its type; a
predicted entity counts when its type, start and end all equal a gold one's.
"""
from __future__ import annotations


def align_labels(word_ids: list[int | None], word_labels: list[int], label_all_tokens: bool,
                 names: list[str] | None = None) -> list[int]:
    """Per-token label ids for one row (`word_ids` from a fast tokenizer's encoding)."""
    aligned, previous = [], None
    for word in word_ids:
        if word is None:
            aligned.append(-100)
        elif word != previous:
            aligned.append(word_labels[word])
        elif label_all_tokens:
            aligned.append(_inside(word_labels[word], names))
        else:
            aligned.append(-100)
        previous = word
    return aligned


def _inside(label: int, names: list[str] | None) -> int:
    """The I- label of a B- label (the same label when there is none, or names are unknown)."""
    if names and names[label].startswith("B-") and f"I-{names[label][2:]}" in names:
        return names.index(f"I-{names[label][2:]}")
    return label


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of each entity in a BIO (or IO) tag sequence."""
    found, kind, start = set(), None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, label = tag.partition("-") if "-" in tag else (tag, "", "")
        begins = prefix == "B" or (prefix == "I" and label != kind)
        if kind is not None and (prefix == "O" or begins):
            found.add((kind, start, i - 1))
            kind = None
        if begins:
            kind, start = label, i
    return found


def entity_counts(predicted: list[list[str]], gold: list[list[str]]) -> tuple[int, int, int]:
    """(correct entities, predicted entities, gold entities) over sequences."""
    correct = n_pred = n_gold = 0
    for p, g in zip(predicted, gold):
        pe, ge = entities(p), entities(g)
        correct += len(pe & ge)
        n_pred += len(pe)
        n_gold += len(ge)
    return correct, n_pred, n_gold


def precision_recall_f1(correct: int, n_pred: int, n_gold: int) -> dict:
    precision = correct / n_pred if n_pred else 0.0
    recall = correct / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}
