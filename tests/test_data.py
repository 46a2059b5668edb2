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
