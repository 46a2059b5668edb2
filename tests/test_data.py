"""Local data files in every format, with column mapping, and the errors for unusable data."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from rapidformer.config.schema import DataConfig
from rapidformer.data.synthetic import make_split
from rapidformer.data.text_classification import load_classification_data
from rapidformer.errors import InputError

ROWS = [{"q1": f"first {i}", "q2": f"second {i}", "y": i % 3} for i in range(12)]


def _write(path, fmt, rows):
    frame = pd.DataFrame(rows)
    if fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "tsv":
        frame.to_csv(path, index=False, sep="\t")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        frame.to_parquet(path)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "json", "jsonl", "parquet"])
def test_every_local_format_with_column_mapping(tmp_path, fmt):
    _write(tmp_path / f"train.{fmt}", fmt, ROWS)
    _write(tmp_path / f"dev.{fmt}", fmt, ROWS[:6])
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="q1", text_b_column="q2",
                   label_column="y")
    data = load_classification_data(d, tmp_path, num_labels=None)
    assert set(data.splits) == {"train", "validation"}
    assert len(data.splits["train"]) == 12 and data.num_labels == 3
    assert data.splits["validation"]["label"] == [0, 1, 2, 0, 1, 2]
    assert data.scored_splits == ("validation",)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_good_labels_never_look_up_their_lines(tmp_path, fmt, monkeypatch):
    """A row's line is found by reading the file up to it: for an error message only. Looked up
    for every row it made loading quadratic (the quickstart's 12,000 rows: 2 minutes)."""
    from rapidformer.data import text_classification

    def no_lookup(*args):
        raise AssertionError("a line number was looked up for a good label")

    monkeypatch.setattr(text_classification, "_text_line", no_lookup)
    monkeypatch.setattr(text_classification, "_csv_line", no_lookup)
    _write(tmp_path / f"train.{fmt}", fmt, ROWS)
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="q1", text_b_column="q2",
                   label_column="y")
    assert load_classification_data(d, tmp_path, None).num_labels == 3


def test_string_labels_are_mapped_to_ids(tmp_path):
    rows = [{"sentence1": "a", "sentence2": "b", "label": lab} for lab in ["yes", "no", "yes"]]
    _write(tmp_path / "train.jsonl", "jsonl", rows)
    d = DataConfig(source="local", path=str(tmp_path))
    data = load_classification_data(d, tmp_path, None)
    assert data.label_names == ["no", "yes"] and data.splits["train"]["label"] == [1, 0, 1]


def test_unlabelled_test_split_is_not_scored(tmp_path):
    _write(tmp_path / "train.jsonl", "jsonl", make_split(8, 1))
    _write(tmp_path / "test.jsonl", "jsonl",
           [{**r, "label": -1} for r in make_split(4, 2)])
    data = load_classification_data(DataConfig(source="local", path=str(tmp_path)), tmp_path, None)
    assert "test" in data.splits and data.scored_splits == ()


@pytest.mark.parametrize("setup,config,message", [
    (lambda p: None, {}, "no training file in"),
    (lambda p: _write(p / "train.csv", "csv", ROWS), {"text_a_column": "question"},
     "the train split has no column 'question' (data.text_a_column); its columns are: q1, q2, y"),
    (lambda p: _write(p / "train.csv", "csv", ROWS), {"train_file": "training.csv"},
     "data file not found"),
    (lambda p: _write(p / "train.csv", "csv", ROWS), {"num_labels": 2},
     "has label 2 but task.num_labels=2"),
    (lambda p: (p / "train.csv").write_bytes(b"q1,q2,y\n\xff\xfe bad,x,1\n"), {},
     "is not valid UTF-8 text (line 2)"),
])
def test_unusable_data_is_a_clear_error(tmp_path, setup, config, message):
    setup(tmp_path)
    num_labels = config.pop("num_labels", None)
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="q1", text_b_column="q2",
                   label_column="y")
    for key, value in config.items():
        setattr(d, key, value)
    with pytest.raises(InputError, match=None) as info:
        load_classification_data(d, tmp_path, num_labels)
    assert message in str(info.value)


def test_missing_data_directory(tmp_path):
    d = DataConfig(source="local", path=str(tmp_path / "nope"))
    with pytest.raises(InputError, match="data directory not found"):
        load_classification_data(d, tmp_path, None)


def test_synthetic_pairs_are_balanced_and_deterministic():
    a, b = make_split(400, 5), make_split(400, 5)
    assert a == b
    positives = sum(r["label"] for r in a)
    assert 150 < positives < 250


# --- labels: one rule for every format (the module docstring of data/text_classification) -------
# The default columns: ids written back into a `label` column the builder read as text stayed text
HEADER = "sentence1,sentence2,label\n"


def _pairs(labels):
    return [{"sentence1": f"first {i}", "sentence2": f"second {i}", "label": lab}
            for i, lab in enumerate(labels)]


def _load(tmp_path, num_labels=None):
    return load_classification_data(DataConfig(source="local", path=str(tmp_path)), tmp_path,
                                    num_labels)


def _ids(data, split):
    """The split's label ids, checked to be ints (1.0 == 1 and True == 1 would pass a bare ==)."""
    assert data.splits[split].features["label"].dtype == "int64"
    return data.splits[split]["label"]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet", "jsonl"])
def test_string_labels_are_mapped_to_ids_in_every_format(tmp_path, fmt):
    _write(tmp_path / f"train.{fmt}", fmt, _pairs(["pos", "neg", "pos", "neutral"]))
    _write(tmp_path / f"validation.{fmt}", fmt, _pairs(["neutral", "pos"]))
    data = _load(tmp_path)
    assert data.label_names == ["neg", "neutral", "pos"] and data.num_labels == 3
    assert _ids(data, "train") == [2, 0, 2, 1] and _ids(data, "validation") == [1, 2]
    assert data.scored_splits == ("validation",)


def test_mixed_labels_are_names_with_one_mapping_for_every_split(tmp_path):
    # train's column is read as text, validation's (digits only) as integers: same names
    _write(tmp_path / "train.csv", "csv", _pairs(["1", "2", "neg", "1"]))
    _write(tmp_path / "validation.csv", "csv", _pairs([2, 1]))
    data = _load(tmp_path)
    assert data.label_names == ["1", "2", "neg"]
    assert _ids(data, "train") == [0, 1, 2, 0] and _ids(data, "validation") == [1, 0]


@pytest.mark.parametrize("labels,ids,num_labels", [
    ([1.0, 0.0, 2.0, 0.0], [1, 0, 2, 0], 3),
    ([True, False, True, True], [1, 0, 1, 1], 2),
])
def test_whole_float_and_bool_labels_are_ids(tmp_path, labels, ids, num_labels):
    _write(tmp_path / "train.parquet", "parquet", _pairs(labels))
    data = _load(tmp_path)
    assert data.label_names == [] and data.num_labels == num_labels
    assert _ids(data, "train") == ids


def test_an_empty_or_minus_one_test_split_is_loaded_unscored(tmp_path):
    _write(tmp_path / "train.csv", "csv", _pairs(["pos", "neg"]))
    (tmp_path / "test.csv").write_text(HEADER + "a,b,\nc,d,\n")
    data = _load(tmp_path)
    assert _ids(data, "test") == [-1, -1] and data.scored_splits == ()


TRAIN_INTS = HEADER + "a,b,0\nc,d,1\n"
TRAIN_NAMES = HEADER + "a,b,pos\nc,d,neg\n"
JSONL = '{{"sentence1": "a", "sentence2": "b", "label": {}}}\n'


@pytest.mark.parametrize("files,num_labels,message", [
    ({"train.csv": HEADER + "a,b,pos\nc,d,\ne,f,neg\n"}, None,
     "train.csv line 3 has an empty label in column 'label' (data.label_column); every training "
     "row needs a label"),
    ({"train.tsv": HEADER.replace(",", "\t") + "a\tb\t1\n\nc\td\t\n"}, None,
     "train.tsv line 4 has an empty label in column 'label'"),  # after a blank line
    ({"train.csv": HEADER + '"a\nsecond line",b,pos\nc,d,\n'}, None,
     "train.csv line 4 has an empty label"),  # after a field over two lines
    ({"train.jsonl": JSONL.format('"pos"') + "\n" + JSONL.format("null")}, None,
     "train.jsonl line 3 has an empty label"),
    ({"train.csv": HEADER + "a,b,0.5\nc,d,1\n"}, None,
     "train.csv line 2 has the label 0.5 in column 'label' (data.label_column), which is no "
     "class"),
    ({"train.csv": TRAIN_INTS, "dev.csv": HEADER + "a,b,1\nc,d,2\n"}, None,
     "dev.csv line 3 has label 2 but task.num_labels=2 (column 'label', data.label_column); "
     "labels must be 0..1: the training labels go up to 1: add label 2 to the training data, "
     "set task.num_labels=3, or fix the data"),
    ({"train.csv": TRAIN_NAMES, "validation.csv": HEADER + "a,b,pos\nc,d,maybe\n"}, None,
     "validation.csv line 3 has the label 'maybe' in column 'label' (data.label_column), which "
     "no training row has (the training labels: neg, pos); add it to the training data"),
    ({"train.csv": TRAIN_INTS, "validation.csv": HEADER + "a,b,-1\n"}, None,
     "validation.csv line 2 has the label -1 (no label) in column 'label' (data.label_column); "
     "the validation split is scored at every evaluation"),
    ({"train.csv": TRAIN_INTS, "test.csv": HEADER + "a,b,1\nc,d,\n"}, None,
     "test.csv line 3 has an empty label in column 'label' (data.label_column); the test split "
     "is partly labelled"),
    ({"train.csv": TRAIN_INTS, "validation.csv": HEADER + "a,b,neg\n"}, None,
     "validation.csv line 2 has the label 'neg' in column 'label' (data.label_column), but the "
     "training labels are class ids (0..1)"),
    ({"train.csv": HEADER + "a,b,x\nc,d,y\ne,f,z\n"}, 2,
     "the training split has 3 labels (x, y, z) in column 'label' (data.label_column) but "
     "task.num_labels=2"),
    ({"train.csv": "sentence1,sentence2,y\na,b,0\n"}, None,
     "train.csv: the train split has no column 'label' (data.label_column)"),
])
def test_bad_labels_name_the_file_the_line_and_the_column(tmp_path, files, num_labels, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(InputError) as info:
        _load(tmp_path, num_labels)
    assert message in str(info.value)


def test_a_fraction_in_parquet_names_the_row(tmp_path):
    _write(tmp_path / "train.parquet", "parquet", _pairs([1.0, 1.5]))
    with pytest.raises(InputError, match=r"train\.parquet row 2 has the label 1\.5 in column"):
        _load(tmp_path)
