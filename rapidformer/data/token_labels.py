"""Token classification: the tag rule, word-level tags aligned to sub-tokens, and entity-level
scores.

Rows hold a list of words (data.tokens_column) and a list of their tags (data.tags_column). Tags
follow one rule in every format and split: the label rule of sentence classification
(rapidformer/data/text_classification.py, whose helpers read each value and name its place),
applied to each word's tag.

- a row's words are a list of text (a JSON array in .jsonl/.json, a list column in parquet; a
  csv or tsv cell is text, never a list), at least one word, and its tags a list of exactly as
  many tags, one per word;
- a whole number is a tag id: an int, a float such as 1.0, or text such as "2"; a bool is 0 or 1;
- when every training tag is an id, tags are ids, 0..n-1. Their names are the dataset's
  ClassLabel names where it has them (CoNLL-2003 on the hub), and n their number; else n is
  task.num_labels, or the largest training id + 1, and the names are the ids as text;
- else tags are names: each tag's text ("B-PER", "1"), "O" first and the others sorted as text
  — or, fine-tuning a pretrained token classifier whose head names them all, numbered as its
  head does (models/head_labels.py) — the training split's numbering applied to every split;
- task.num_labels, when set, is n: at least the number of names (classes beyond them are named
  LABEL_<i>, as Hugging Face does, and no row has them);
- a row whose words or tags are no list, an empty row, a row with fewer or more tags than words,
  a word that is no text, an empty tag (null), a fraction (1.5), a negative id, a name among ids,
  an id at or above n, or a validation or test tag that no training row has is refused at
  loading, before training, with its file and line (jsonl) or row (a JSON array, parquet, the
  hub), counted from 1, the word and the config key.

A word split into several sub-tokens keeps its tag on the first one; the others get -100 (not
trained on, not scored) unless `label_all_tokens`, which gives them the word's tag — with a B-
tag turned into the matching I- tag, so that an entity still starts once. Special tokens and
padding always get -100.

Scores follow seqeval's default (CoNLL) rules: an entity is a maximal run of tokens of one type
that starts at a B- tag, or at an I- tag that does not continue an entity of its type; a
predicted entity counts when its type, start and end all equal a gold one's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rapidformer.config.schema import DataConfig
from rapidformer.data.synthetic_tasks import writer_for
from rapidformer.data.text_classification import (
    _label_value, _listing, _load_splits_and_files, _place, ids_in_head_order, names_in_head_order,
    require_columns)
from rapidformer.errors import InputError

TOKENS_KEY, TAGS_KEY = "data.tokens_column", "data.tags_column"


@dataclass
class TagData:
    splits: dict  # {split: datasets.Dataset}, the tags column holding tag ids
    names: list[str]  # tag id -> name
    scored_splits: tuple[str, ...] = field(default_factory=tuple)


def load_token_data(d: DataConfig, run_dir: Path, num_labels: int | None,
                    write_synthetic=None, head: dict[str, int] | None = None) -> TagData:
    """The splits of a token-classification dataset with their tags checked and made ids (the
    rule in the module docstring); `write_synthetic` writes `data=synthetic`'s sentences;
    `head`: the label2id of the pretrained head the run fine-tunes, whose tag names number the
    data's."""
    splits, files = _load_splits_and_files(d, run_dir,
                                           write_synthetic or writer_for("token_classification"))
    require_columns(splits, {TOKENS_KEY: d.tokens_column, TAGS_KEY: d.tags_column}, files)
    return prepare_tags(splits, files, d, num_labels, head)


def prepare_tags(splits: dict, files: dict, d: DataConfig, num_labels: int | None,
                 head: dict[str, int] | None = None) -> TagData:
    """Every split's tags as ids, train's vocabulary for all (`files`: {split: the file it was
    read from}, which the errors name; none for the hub)."""
    if len(splits["train"]) == 0:
        raise InputError(f"the training split is empty ({files.get('train', d.path)}, "
                         f"data.path={d.path}); add examples")
    places = {split: _place(split, files.get(split), d) for split in splits}
    rows = {split: _tag_rows(ds, d, places[split]) for split, ds in splits.items()}
    train = [tag for _, tags in rows["train"] for tag in tags]
    if all(isinstance(tag, int) for tag in train):
        names, to_id = _id_tags(splits["train"], train, d.tags_column, num_labels, files)
        feature = getattr(splits["train"].features[d.tags_column], "feature", None)
        given = list(getattr(feature, "names", None) or [])
        if given and head and num_labels in (None, len(head)):  # ids a ClassLabel names
            found, to_id = ids_in_head_order(given, head, to_id, "tags")
            names = found if found is not given else names
    else:
        names, to_id = _named_tags(train, d.tags_column, num_labels, files, head)
    out = {}
    for split, ds in splits.items():
        place = places[split]
        ids = [[to_id(tag, lambda what: f"{place(i)} has {what} for {_word(j, w)}")
                for j, (w, tag) in enumerate(zip(words, tags))]
               for i, (words, tags) in enumerate(rows[split])]
        out[split] = ds.remove_columns([d.tags_column]).add_column(d.tags_column, ids)
    return TagData(splits=out, names=names,
                   scored_splits=tuple(split for split in out if split != "train"))


def _tag_rows(ds, d: DataConfig, place) -> list[tuple[list[str], list]]:
    """Each row's (words, tags), its tags as the rule reads them (ints and names), once its
    words and tags are lists of one length."""
    tokens, tags_column = d.tokens_column, d.tags_column
    out = []
    for i, (words, tags) in enumerate(zip(ds[tokens], ds[tags_column])):
        for value, column, key, what in ((words, tokens, TOKENS_KEY, "words"),
                                         (tags, tags_column, TAGS_KEY, "tags")):
            if not isinstance(value, list):
                raise InputError(
                    f"{place(i)} has {_shown(value)} in column '{column}' ({key}), not a list of "
                    f"{what}: write each row's {what} as a list (a JSON array in .jsonl or "
                    f".json, a list column in parquet; a csv or tsv cell is text), or set {key} "
                    f"to the column of {what}")
        if len(words) != len(tags):
            raise InputError(
                f"{place(i)} has {_count(len(words), 'word')} in column '{tokens}' ({TOKENS_KEY}) "
                f"but {_count(len(tags), 'tag')} in column '{tags_column}' ({TAGS_KEY}); every "
                f"word needs exactly one tag: fix the row, or set {TOKENS_KEY} and {TAGS_KEY} "
                f"to the columns of words and tags")
        if not words:
            raise InputError(
                f"{place(i)} has no words in column '{tokens}' ({TOKENS_KEY}) and no tags in "
                f"column '{tags_column}' ({TAGS_KEY}); every row needs a sentence: drop the "
                f"empty row")
        row = []
        for j, (word, tag) in enumerate(zip(words, tags)):
            if not isinstance(word, str):
                raise InputError(
                    f"{place(i)} has {_shown(word)} as word {j + 1} in column '{tokens}' "
                    f"({TOKENS_KEY}), which is no text; every word is a string: quote it, or "
                    f"drop it and its tag")
            value = _label_value(tag)
            if value is None:
                empty = "no tag (null)" if tag is None else f"an empty tag ({tag!r})"
                raise InputError(
                    f"{place(i)} has {empty} for {_word(j, word)} in column "
                    f"'{tags_column}' ({TAGS_KEY}); every word needs a tag: fill it in (O for "
                    f"a word outside any entity) or drop the row")
            if value is ValueError:
                raise InputError(
                    f"{place(i)} has the tag {tag!r} for {_word(j, word)} in column "
                    f"'{tags_column}' ({TAGS_KEY}), which is no tag: a tag is a whole number "
                    f"(a tag id) or a name such as B-PER; fix it, or set {TAGS_KEY} to the "
                    f"tags column")
            row.append(value)
        out.append((words, row))
    return out


def _id_tags(train_ds, train: list[int], column: str, num_labels: int | None, files: dict):
    """(names, to_id) when the training tags are ids."""
    feature = getattr(train_ds.features[column], "feature", None)
    given = list(getattr(feature, "names", None) or [])
    top = max(train)
    n = num_labels or len(given) or top + 1
    if given and n < len(given):
        raise InputError(
            f"the training split{_file(files)} names {len(given)} tags ({_listing(given)}) in "
            f"its ClassLabel feature of column '{column}' ({TAGS_KEY}) but task.num_labels={n}; "
            f"raise task.num_labels to {len(given)} or leave it unset")
    names = _padded(given, n) if given else [str(i) for i in range(n)]

    def to_id(value, where) -> int:
        """`where(what)`: "<file> line 3 has <what> for word 2 ('paris')" (made only for an
        error: it reads the file)."""
        if isinstance(value, str):
            raise InputError(
                f"{where(f'the tag {value!r}')} in column '{column}' ({TAGS_KEY}), but the "
                f"training tags are tag ids (0..{top}); write ids here too, or names in every "
                f"split")
        if value < 0:
            raise InputError(
                f"{where(f'a negative tag id ({value})')} in column '{column}' ({TAGS_KEY}); tag "
                f"ids are 0..{n - 1}: fix it or drop the row")
        if value >= n:
            if num_labels:
                fix = "raise task.num_labels or fix the tag"
            elif given:
                fix = (f"the dataset's ClassLabel names ids 0..{len(given) - 1} "
                       f"({_listing(given)}): fix the tag, or set task.num_labels={value + 1}")
            else:
                fix = (f"the training tags go up to {top}: add tag {value} to the training data, "
                       f"set task.num_labels={value + 1}, or fix the tag")
            raise InputError(
                f"{where(f'tag id {value}')} in column '{column}' ({TAGS_KEY}), but there are {n} "
                f"tags (ids 0..{n - 1}): {fix}")
        return value

    return names, to_id


def _named_tags(train: list, column: str, num_labels: int | None, files: dict,
                head: dict[str, int] | None = None):
    """(names, to_id) when the training tags are names: "O" first, then sorted as text; or in
    the order of the pretrained head's names where each is one of them."""
    found = sorted({str(tag) for tag in train}, key=lambda t: (t != "O", t))
    if head and num_labels in (None, len(head)):
        found = names_in_head_order(found, head, "tags") or found
    if num_labels is not None and num_labels < len(found):
        raise InputError(
            f"the training split{_file(files)} has {len(found)} tags ({_listing(found)}) in "
            f"column '{column}' ({TAGS_KEY}) but task.num_labels={num_labels}; raise "
            f"task.num_labels to {len(found)} or leave it unset")
    index = {name: i for i, name in enumerate(found)}

    def to_id(value, where) -> int:
        if str(value) not in index:
            ids = (f", and an id among names is read as its text ('{value}'): write the tag's "
                   f"name" if isinstance(value, int) else "")
            raise InputError(
                f"{where(f'the tag {_tag(value)}')} in column '{column}' ({TAGS_KEY}), which no "
                f"training row has (the training tags: {_listing(found)}); add it to the "
                f"training data or fix this tag{ids}")
        return index[str(value)]

    return _padded(found, num_labels or len(found)), to_id


def _padded(names: list[str], n: int) -> list[str]:
    return names + [f"LABEL_{i}" for i in range(len(names), n)]


def _file(files: dict) -> str:
    return f" ({files['train']})" if "train" in files else ""


def _word(j: int, word) -> str:
    return f"word {j + 1} ({_shown(word)})"


def _tag(value) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}" if n else f"no {what}s"


def _shown(value, most: int = 40) -> str:
    """A value as a message shows it: text quoted (cut short), null, or the value's repr."""
    if value is None:
        return "null"
    if isinstance(value, str):
        text = value if len(value) <= most else value[:most] + "..."
        return f"the text {text!r}" if " " in value or len(value) > most else repr(text)
    return repr(value)


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


def unseen_entities(word_ids: list[int | None], word_labels: list[int], labels: list[int],
                    names: list[str]) -> int:
    """The gold entities of one row that reach past the words its encoding kept (a sentence
    longer than data.max_seq_length tokens): scored as missed, since the model never reads
    them. `labels` (the row's aligned labels) loses the kept part of an entity the cut splits,
    which would otherwise count as a whole, shorter entity."""
    kept = [w for w in word_ids if w is not None]
    last = max(kept) if kept else -1
    if last + 1 >= len(word_labels):
        return 0
    past = [(first, end) for _, first, end in entities([names[i] for i in word_labels])
            if end > last]
    for first, _ in past:
        for position, word in enumerate(word_ids):
            if word is not None and word >= first:
                labels[position] = -100
    return len(past)


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
