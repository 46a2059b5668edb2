"""Token-classification tags: one rule for every format and split (the module docstring of
rapidformer/data/token_labels.py). Good tags become the ids the model trains on; every bad row is
refused at loading with its file, line or row, word and config key."""
from __future__ import annotations

import json

import pytest

from rapidformer.config.schema import DataConfig
from rapidformer.data.token_labels import load_token_data, prepare_tags
from rapidformer.errors import InputError


def _row(tags, tokens=None):
    return {"tokens": tokens if tokens is not None else [f"w{i}" for i in range(len(tags))],
            "ner_tags": tags}


def _jsonl(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _load(tmp_path, num_labels=None, **data):
    return load_token_data(DataConfig(source="local", path=str(tmp_path), **data), tmp_path,
                           num_labels)


def _write(tmp_path, files: dict) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)


def _ids(data, split):
    """The split's tag ids, checked to be ints (1.0 == 1 and True == 1 would pass a bare ==)."""
    assert data.splits[split].features["ner_tags"].feature.dtype == "int64"
    return data.splits[split]["ner_tags"]


# --- good tags --------------------------------------------------------------------------------
def test_names_are_numbered_o_first_with_trains_numbering_in_every_split(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl(_row(["B-PER", "O", "B-LOC"]), _row(["I-PER"])),
                      "dev.jsonl": _jsonl(_row(["O", "B-LOC"]))})
    data = _load(tmp_path)
    assert data.names == ["O", "B-LOC", "B-PER", "I-PER"]
    assert _ids(data, "train") == [[2, 0, 1], [3]] and _ids(data, "validation") == [[0, 1]]
    assert data.scored_splits == ("validation",)


def test_whole_floats_digit_strings_and_bools_are_ids(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl(_row([0, 2.0, "1", True]), _row([False]))})
    data = _load(tmp_path)
    assert data.names == ["0", "1", "2"]
    assert _ids(data, "train") == [[0, 2, 1, 1], [0]]


def test_ids_among_names_are_names_with_one_numbering(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl(_row(["B-PER", 0, "O"])),
                      "validation.jsonl": _jsonl(_row([0, "O"]))})
    data = _load(tmp_path)
    assert data.names == ["O", "0", "B-PER"]
    assert _ids(data, "train") == [[2, 1, 0]] and _ids(data, "validation") == [[1, 0]]


def test_class_label_names_are_kept_and_task_num_labels_adds_classes(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Sequence, Value

    features = Features({"tokens": Sequence(Value("string")),
                         "ner_tags": Sequence(ClassLabel(names=["O", "B-PER", "I-PER"]))})
    Dataset.from_list([_row([1, 2, 0])], features=features).to_parquet(tmp_path / "train.parquet")
    data = _load(tmp_path)
    assert data.names == ["O", "B-PER", "I-PER"] and _ids(data, "train") == [[1, 2, 0]]
    assert _load(tmp_path, num_labels=4).names == ["O", "B-PER", "I-PER", "LABEL_3"]


def test_task_num_labels_sets_the_number_of_ids_and_pads_names(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl(_row([0, 1])), "validation.jsonl": _jsonl(_row([3]))})
    assert _load(tmp_path, num_labels=4).names == ["0", "1", "2", "3"]
    (tmp_path / "validation.jsonl").unlink()
    (tmp_path / "train.jsonl").write_text(_jsonl(_row(["O", "B-PER"])))
    assert _load(tmp_path, num_labels=3).names == ["O", "B-PER", "LABEL_2"]


# --- bad tags, words and rows -----------------------------------------------------------------
TRAIN_IDS = _jsonl(_row([0, 1]), _row([1, 0]))
TRAIN_NAMES = _jsonl(_row(["B-PER", "O"]))
WORDS_AB = ["anna", "berlin"]


@pytest.mark.parametrize("files,num_labels,message", [
    ({"train.jsonl": TRAIN_IDS, "validation.jsonl": _jsonl(_row([0, 5], WORDS_AB))}, None,
     "validation.jsonl line 1 has tag id 5 for word 2 ('berlin') in column 'ner_tags' "
     "(data.tags_column), but there are 2 tags (ids 0..1): the training tags go up to 1: add tag "
     "5 to the training data, set task.num_labels=6, or fix the tag"),
    ({"train.jsonl": TRAIN_IDS, "test.jsonl": _jsonl(_row([0]), _row([3]))}, 3,
     "test.jsonl line 2 has tag id 3 for word 1 ('w0') in column 'ner_tags' (data.tags_column), "
     "but there are 3 tags (ids 0..2): raise task.num_labels or fix the tag"),
    ({"train.jsonl": TRAIN_NAMES, "validation.jsonl": _jsonl(_row([0, 1], WORDS_AB))}, None,
     "validation.jsonl line 1 has the tag 0 for word 1 ('anna') in column 'ner_tags' "
     "(data.tags_column), which no training row has (the training tags: O, B-PER); add it to the "
     "training data or fix this tag, and an id among names is read as its text ('0')"),
    ({"train.jsonl": TRAIN_IDS, "validation.jsonl": _jsonl(_row(["O", "B-PER"], WORDS_AB))}, None,
     "validation.jsonl line 1 has the tag 'O' for word 1 ('anna') in column 'ner_tags' "
     "(data.tags_column), but the training tags are tag ids (0..1); write ids here too"),
    ({"train.jsonl": TRAIN_NAMES, "validation.jsonl": _jsonl(_row(["O", "B-LOC"], WORDS_AB))},
     None, "validation.jsonl line 1 has the tag 'B-LOC' for word 2 ('berlin') in column "
     "'ner_tags' (data.tags_column), which no training row has (the training tags: O, B-PER)"),
    ({"train.jsonl": TRAIN_IDS + _jsonl(_row([0, 1], ["a", "b", "c"]))}, None,
     "train.jsonl line 3 has 3 words in column 'tokens' (data.tokens_column) but 2 tags in column "
     "'ner_tags' (data.tags_column); every word needs exactly one tag"),
    ({"train.jsonl": TRAIN_IDS + _jsonl(_row([0, 1], ["a"]))}, None,
     "train.jsonl line 3 has 1 word in column 'tokens' (data.tokens_column) but 2 tags"),
    ({"train.jsonl": TRAIN_IDS + _jsonl(_row([], WORDS_AB))}, None,
     "train.jsonl line 3 has 2 words in column 'tokens' (data.tokens_column) but no tags in "
     "column 'ner_tags'"),
    ({"train.jsonl": TRAIN_IDS + _jsonl(_row([], []))}, None,
     "train.jsonl line 3 has no words in column 'tokens' (data.tokens_column) and no tags in "
     "column 'ner_tags' (data.tags_column); every row needs a sentence: drop the empty row"),
    ({"train.jsonl": _jsonl(_row([0, 1], "anna berlin"))}, None,
     "train.jsonl line 1 has the text 'anna berlin' in column 'tokens' (data.tokens_column), not "
     "a list of words: write each row's words as a list"),
    ({"train.jsonl": _jsonl(_row("O B-PER", WORDS_AB))}, None,
     "train.jsonl line 1 has the text 'O B-PER' in column 'ner_tags' (data.tags_column), not a "
     "list of tags"),
    ({"train.csv": "tokens,ner_tags\nanna,O\n"}, None,
     "train.csv line 2 has 'anna' in column 'tokens' (data.tokens_column), not a list of words"),
    ({"train.jsonl": TRAIN_IDS + _jsonl({"tokens": None, "ner_tags": [0]})}, None,
     "train.jsonl line 3 has null in column 'tokens' (data.tokens_column), not a list of words"),
    ({"train.jsonl": TRAIN_IDS + _jsonl(_row([0, None], WORDS_AB))}, None,
     "train.jsonl line 3 has no tag (null) for word 2 ('berlin') in column 'ner_tags' "
     "(data.tags_column); every word needs a tag"),
    ({"train.jsonl": _jsonl(_row(["O", " "], WORDS_AB))}, None,
     "train.jsonl line 1 has an empty tag (' ') for word 2 ('berlin') in column 'ner_tags'"),
    ({"train.jsonl": _jsonl(_row([0, 1], ["in", 1999]))}, None,
     "train.jsonl line 1 has 1999 as word 2 in column 'tokens' (data.tokens_column), which is no "
     "text"),
    ({"train.jsonl": _jsonl(_row([0, 1.5], WORDS_AB))}, None,
     "train.jsonl line 1 has the tag 1.5 for word 2 ('berlin') in column 'ner_tags' "
     "(data.tags_column), which is no tag"),
    ({"train.jsonl": _jsonl(_row([["B-PER"], "O"], WORDS_AB))}, None,
     "train.jsonl line 1 has the tag ['B-PER'] for word 1 ('anna') in column 'ner_tags'"),
    ({"train.jsonl": TRAIN_IDS, "validation.jsonl": _jsonl(_row([0, -1], WORDS_AB))}, None,
     "validation.jsonl line 1 has a negative tag id (-1) for word 2 ('berlin') in column "
     "'ner_tags' (data.tags_column); tag ids are 0..1"),
    ({"train.jsonl": TRAIN_IDS + "\n\n" + _jsonl(_row([0, 1], ["a"]))}, None,
     "train.jsonl line 5 has 1 word"),  # after blank lines
    ({"train.jsonl": _jsonl({"tokens": ["a"], "tags": [0]})}, None,
     "train.jsonl: the train split has no column 'ner_tags' (data.tags_column)"),
])
def test_bad_tags_name_the_file_the_line_the_word_and_the_column(tmp_path, files, num_labels,
                                                                 message):
    _write(tmp_path, files)
    with pytest.raises(InputError) as info:
        _load(tmp_path, num_labels)
    assert message in str(info.value)


def test_more_names_than_task_num_labels_names_the_file_and_the_fix(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl(_row(["O", "B-PER", "I-PER"]))})
    with pytest.raises(InputError) as info:
        _load(tmp_path, num_labels=2)
    assert (f"the training split ({tmp_path / 'train.jsonl'}) has 3 tags (O, B-PER, I-PER) in "
            f"column 'ner_tags' (data.tags_column) but task.num_labels=2; raise task.num_labels "
            f"to 3 or leave it unset") in str(info.value)


def test_other_columns_are_named_by_their_config_keys(tmp_path):
    _write(tmp_path, {"train.jsonl": _jsonl({"words": ["a", "b"], "labels": ["O"]})})
    with pytest.raises(InputError) as info:
        _load(tmp_path, tokens_column="words", tags_column="labels")
    assert ("train.jsonl line 1 has 2 words in column 'words' (data.tokens_column) but 1 tag in "
            "column 'labels' (data.tags_column)") in str(info.value)


def test_a_class_label_id_out_of_range_names_the_parquet_row(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Sequence, Value

    features = Features({"tokens": Sequence(Value("string")),
                         "ner_tags": Sequence(ClassLabel(names=["O", "B-PER"]))})
    Dataset.from_list([_row([1, 0])], features=features).to_parquet(tmp_path / "train.parquet")
    Dataset.from_list([_row([0]), _row([0, 2], WORDS_AB)]).to_parquet(tmp_path / "dev.parquet")
    with pytest.raises(InputError) as info:
        _load(tmp_path)
    assert ("dev.parquet row 2 has tag id 2 for word 2 ('berlin') in column 'ner_tags' "
            "(data.tags_column), but there are 2 tags (ids 0..1): the dataset's ClassLabel names "
            "ids 0..1 (O, B-PER): fix the tag, or set task.num_labels=3") in str(info.value)


def test_a_hub_split_names_the_dataset_and_the_row():
    from datasets import Dataset

    splits = {"train": Dataset.from_list([_row(["O", "B-PER"])]),
              "validation": Dataset.from_list([_row(["O"]), _row(["B-MISC"])])}
    d = DataConfig(source="hub", path="eriktks/conll2003")
    with pytest.raises(InputError) as info:
        prepare_tags(splits, {}, d, None)
    assert ("row 2 of the validation split of eriktks/conll2003 has the tag 'B-MISC' for word 1 "
            "('w0')") in str(info.value)
