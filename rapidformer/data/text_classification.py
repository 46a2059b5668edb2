"""Sentence(-pair) classification data: hub datasets, local files, or the synthetic pairs.

Local files are read with the `datasets` library's csv/json/parquet builders, once their rows
are known to account for their lines (data/local_files.py, data/file_rows.py: a tsv is unquoted
unless data.quoting=csv); columns are mapped by `data.text_a_column`, `data.text_b_column` and
`data.label_column`. Every way a file can be unusable (missing, not a readable file, rows that do
not account for its lines, wrong columns, labels out of range, empty) is an `InputError` that
names the file and the config key to change; a bad label also names its line (csv, tsv, jsonl)
or row (a JSON array, parquet, the hub), counted from 1.

Labels follow one rule in every format. The builders infer a column's type per file (a csv
column of "1", "2", "neg" is text, the same column in another split may be read as integers), so
the rule looks at each value, not at the column's type:

- a whole number is a class id: an int, a float such as 1.0, or text such as "2"; a bool is 0 or 1;
- when every training label is a class id, labels are ids, 0..task.num_labels-1; task.num_labels
  defaults to the largest training id + 1 (at least 2);
- else labels are names: each label's text ("1", "neg"), sorted as text and numbered from 0 —
  or, fine-tuning a pretrained classifier whose head names them all, numbered as its head does
  (models/head_labels.py) — the training split's numbering applied to every split
  (`label_names` keeps the names);
- empty (or -1) means "no label": every training and validation row needs a label (the
  validation split is scored at every evaluation); a test split whose every label is empty or -1
  (GLUE's test on the hub), or that has no label column (GLUE's test.tsv), is loaded unscored,
  a test split with only some labels is refused;
- a fraction (1.5), a list, a negative id, a name among ids, an id at or above task.num_labels, or
  a validation or test label that no training row has is refused at loading, not after training.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time

from dataclasses import dataclass, field
from pathlib import Path

from rapidformer.config.schema import DataConfig
from rapidformer.data import file_rows
from rapidformer.data.local_files import (
    HUB, SPLIT_ALIASES, directory_problem, find_split_file, format_of, read_file, readable_format,
    remember, source_of)
from rapidformer.data.synthetic import write_dataset
from rapidformer.errors import InputError

# a label written as a whole number: "2", "-1", "2.0" (a csv column read as text keeps them so)
WHOLE_NUMBER = re.compile(r"[+-]?\d+(\.0*)?")
NO_LABEL = -1  # GLUE's test labels; also what an unlabelled test split gets

log = logging.getLogger("rapidformer")


@dataclass
class ClassificationData:
    splits: dict  # split name -> datasets.Dataset with text columns and `label`
    num_labels: int
    label_names: list[str] = field(default_factory=list)
    scored_splits: tuple[str, ...] = ("validation",)


def local_split_files(d: DataConfig, root: Path) -> dict:
    """{split: the file it is read from} of local data at `root` (data.path: a directory of
    split files, or one file for the train split), each reachable, or the InputError saying
    why not. The run's refusal pass asks it too, before anything is read."""
    problem = directory_problem(root)
    if problem:
        raise InputError(f"data.path={root} {problem}; point data.path at the data directory "
                         f"or file")
    if not root.exists():
        raise InputError(f"data directory not found: {root} (data.path); create it or fix the path")
    if not root.is_dir():
        readable_format(root, d.format)
        return {"train": root}
    given = {"train": d.train_file, "validation": d.validation_file, "test": d.test_file}
    files = {}
    for split in SPLIT_ALIASES:
        path = find_split_file(root, split, given[split], d.format)
        if path is not None:
            readable_format(path, d.format)
            files[split] = path
    if "train" not in files:
        raise InputError(f"no training file in {root} (data.path): expected train.csv, "
                         f"train.tsv, train.json, train.jsonl or train.parquet, or set "
                         f"data.train_file")
    return files


def _local_splits(d: DataConfig, root: Path) -> tuple[dict, dict]:
    """({split: dataset}, {split: the file it was read from})."""
    files = local_split_files(d, root)
    return {split: read_file(path, d.format, d.quoting) for split, path in files.items()}, files


def _hub_splits(d: DataConfig) -> dict:
    from datasets import load_dataset

    try:
        loaded = load_dataset(d.path, d.subset)
    except (ConnectionError, OSError, ValueError) as exc:
        raise InputError(unreachable_dataset_message(d)) from exc
    for split in loaded:
        remember(loaded[split], HUB)
    return {split: loaded[split] for split in loaded}


def unreachable_dataset_message(d: DataConfig) -> str:
    name = f"{d.path}/{d.subset}" if d.subset else d.path
    return (f"cannot load the dataset '{name}' (data.path, data.subset): not in the local "
            f"Hugging Face cache and the hub cannot be reached. Fix: load it once where there is "
            f"network, or use local files: data=pairs_local data.path=DIR")


def check_hub_dataset_offline(d: DataConfig) -> None:
    """Offline, a hub dataset is read from the cache: refused when `datasets` finds no builder
    for it there (load_dataset's own first step, cheap: no data is read). Online it is the
    run's to download."""
    from datasets import config, load_dataset_builder

    if not config.HF_HUB_OFFLINE:
        return
    try:
        load_dataset_builder(d.path, d.subset)
    except (ConnectionError, OSError, ValueError) as exc:
        raise InputError(unreachable_dataset_message(d)) from exc


def load_splits(d: DataConfig, run_dir: Path, write_synthetic=write_dataset) -> dict:
    """{split: datasets.Dataset} from local files, the hub, or data this project generates
    (`write_synthetic(root, train_size, eval_size, seed)` writes train/validation jsonl)."""
    return _load_splits_and_files(d, run_dir, write_synthetic)[0]


def _load_splits_and_files(d: DataConfig, run_dir: Path, write_synthetic=write_dataset
                           ) -> tuple[dict, dict]:
    """load_splits, and the file of each local split (the errors name it; none for the hub)."""
    files: dict = {}
    if d.source == "synthetic":
        root = Path(d.path) if d.path else run_dir / "data"
        generate_once(root, write_synthetic, d.synthetic_train_size, d.synthetic_eval_size,
                      d.synthetic_seed)
        splits, files = _local_splits(d, root)
    elif d.source == "local":
        splits, files = _local_splits(d, Path(d.path))
    else:
        splits = _hub_splits(d)
    if "train" not in splits:
        raise InputError(f"the dataset has no 'train' split (it has: {', '.join(splits)})")
    return splits, files


GENERATED = ".generated.json"  # what wrote a folder's generated data, written after it


def generate_once(root: Path, write, train_size: int, eval_size: int, seed: int) -> None:
    """The generated data in `root`, written unless the data there was made with these
    settings and finished: a set cut short (a kill, a full disk: a train.jsonl without its
    validation split) or made with other sizes or seed (a rerun with trainer.overwrite=true or
    a resume after the settings changed) is written again."""
    made = {"writer": getattr(write, "kind", getattr(write, "__name__", "")),
            "train_size": train_size, "eval_size": eval_size, "seed": seed}
    record = root / GENERATED
    try:
        found = json.loads(record.read_text())
        if {k: found.get(k) for k in made} == made and \
                all((root / name).is_file() for name in found["files"]):
            return
    except (OSError, ValueError, KeyError, TypeError):
        pass
    record.unlink(missing_ok=True)  # absent while the set is being written
    began = time.time()
    write(root, train_size, eval_size, seed)
    made["files"] = sorted(p.name for p in Path(root).iterdir()
                           if p.is_file() and p.stat().st_mtime >= began - 1)
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(made))
    os.replace(tmp, record)


def require_columns(splits: dict, wanted: dict[str, str], files: dict | None = None) -> None:
    """Every split has the columns {config key: column name}, or one error naming the key (and
    the split's file, where `files` knows it)."""
    for split, ds in splits.items():
        for key, column in wanted.items():
            if column not in ds.column_names:
                where = f"{files[split]}: " if files and split in files else ""
                if {"version", "data"} <= set(ds.column_names):
                    raise InputError(
                        f"{where}the {split} split is SQuAD's nested file (data -> paragraphs "
                        f"-> qas): flatten it to one row per question with the columns id, "
                        f"question, context and answers ({{\"text\": [...], \"answer_start\": "
                        f"[...]}}), as the hub's squad has them, in a .jsonl file")
                raise InputError(
                    f"{where}the {split} split has no column '{column}' ({key}); its columns "
                    f"are: {', '.join(ds.column_names)}. Set {key} to one of them")


def load_classification_data(d: DataConfig, run_dir: Path, num_labels: int | None,
                             head: dict[str, int] | None = None) -> ClassificationData:
    """`head`: the label2id of the pretrained head the run fine-tunes, whose names number the
    data's (models/head_labels.py)."""
    splits, files = _load_splits_and_files(d, run_dir)
    _check_columns(d, splits, files)
    if len(splits["train"]) == 0:
        raise InputError(f"the training split is empty ({files.get('train', d.path)}, "
                         f"data.path={d.path}); add examples")
    _check_texts(d, splits, files)
    return _encode_labels(d, splits, files, num_labels, head)


def _check_texts(d: DataConfig, splits: dict, files: dict) -> None:
    """Every row has its text: a row whose text is missing (a JSON row without the key, or
    null; an empty csv cell) would train on an empty string under its label."""
    for split, ds in splits.items():
        for key, column in (("data.text_a_column", d.text_a_column),
                            ("data.text_b_column", d.text_b_column)):
            if not column:
                continue
            values = ds[column]
            missing = [i for i, v in enumerate(values) if v is None]
            if missing:
                place = _place(split, files.get(split), d)
                raise InputError(
                    f"{place(missing[0])} has no text in column '{column}' ({key}): the field "
                    f"is missing, null or empty ({len(missing)} of the {split} split's "
                    f"{len(values)} rows); fill it in, drop the row, or set {key} to the column "
                    f"that holds the text")


def _check_columns(d: DataConfig, splits: dict, files: dict) -> None:
    """The text and label columns in every split; a test split without the label column (GLUE's
    test.tsv) gets one of empty labels: it loads unscored."""
    wanted = {"data.text_a_column": d.text_a_column}
    if d.text_b_column:
        wanted["data.text_b_column"] = d.text_b_column
    require_columns(splits, wanted, files)
    test = splits.get("test")
    if test is not None and d.label_column not in test.column_names:
        splits["test"] = test.add_column(d.label_column, [None] * len(test))
        remember(splits["test"], source_of(test))
    require_columns(splits, {"data.label_column": d.label_column}, files)


# --- labels: the rule in the module docstring -----------------------------------------------------
def _encode_labels(d: DataConfig, splits: dict, files: dict, num_labels: int | None,
                   head: dict[str, int] | None = None) -> ClassificationData:
    column = d.label_column
    places = {split: _place(split, files.get(split), d) for split in splits}
    values = {split: _label_values(ds[column], places[split], column)
              for split, ds in splits.items()}
    if all(isinstance(v, int) for v in values["train"]):
        label_names, n, to_id = _id_labels(values["train"], column, num_labels)
        given = list(getattr(splits["train"].features.get(column), "names", None) or [])
        if given and head and num_labels in (None, len(head)):  # ids a ClassLabel names
            label_names, to_id = ids_in_head_order(given, head, to_id, "labels")
            n = len(label_names)
    else:
        label_names, n, to_id = _named_labels(values["train"], column, num_labels, head)
    ids = {split: _split_ids(split, labels, to_id, places[split], column)
           for split, labels in values.items()}
    splits = {split: _with_label_column(ds, column, ids[split]) for split, ds in splits.items()}
    scored = tuple(split for split in splits if split != "train" and ids[split] is not None)
    return ClassificationData(splits=splits, num_labels=n, label_names=label_names,
                              scored_splits=scored)


def _label_values(column_values, place, column: str) -> list:
    """Each label as the rule reads it: an int (a class id), a str (a name) or None (empty)."""
    out = []
    for i, value in enumerate(column_values):
        label = _label_value(value)
        if label is ValueError:
            raise InputError(
                f"{place(i)} has the label {value!r} in column '{column}' (data.label_column), "
                f"which is no class: a label is a whole number (a class id) or a name; fix it, "
                f"or set data.label_column to the label column")
        out.append(label)
    return out


def _label_value(value):
    """int, str or None for one label as read; ValueError (returned, not raised) for a value
    that cannot be a class, so that the caller names its place."""
    if value is None:
        return None
    if isinstance(value, bool):  # before int: bool is an int subclass, and means 0/1
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):  # an empty cell of a float column
            return None
        return int(value) if value.is_integer() else ValueError
    if not isinstance(value, str):  # a list or a dict (multi-label data): not one class
        return ValueError
    text = value.strip()
    if not text:
        return None
    return int(float(text)) if WHOLE_NUMBER.fullmatch(text) else text


def _id_labels(train: list, column: str, num_labels: int | None):
    """(label_names, num_labels, to_id) when the training labels are class ids."""
    top = max((v for v in train if v is not None), default=0)
    n = num_labels or max(top + 1, 2)

    def to_id(value, where) -> int:  # where(): the row's place, worked out for an error only
        if isinstance(value, str):
            raise InputError(
                f"{where()} has the label '{value}' in column '{column}' (data.label_column), but "
                f"the training labels are class ids (0..{top}); write ids here too, or names in "
                f"every split")
        if value < 0:
            raise InputError(
                f"{where()} has a negative label ({value}) in column '{column}' "
                f"(data.label_column); labels must be 0..num_labels-1")
        if value >= n:
            fix = ("raise task.num_labels or fix the data" if num_labels else
                   f"the training labels go up to {top}: add label {value} to the training data, "
                   f"set task.num_labels={value + 1}, or fix the data")
            raise InputError(f"{where()} has label {value} but task.num_labels={n} (column "
                             f"'{column}', data.label_column); labels must be 0..{n - 1}: {fix}")
        return value

    return [], n, to_id


def _named_labels(train: list, column: str, num_labels: int | None,
                  head: dict[str, int] | None = None):
    """(label_names, num_labels, to_id) when the training labels are names: sorted as text, or
    in the order of the pretrained head's names where each is one of them."""
    names = sorted({str(v) for v in train if v is not None})
    if head and num_labels in (None, len(head)):
        names = names_in_head_order(names, head, "labels") or names
    index = {name: i for i, name in enumerate(names)}
    if num_labels is not None and num_labels < len(names):
        raise InputError(
            f"the training split has {len(names)} labels ({_listing(names)}) in column "
            f"'{column}' (data.label_column) but task.num_labels={num_labels}; raise "
            f"task.num_labels to {len(names)} or leave it unset")

    def to_id(value, where) -> int:  # where(): the row's place, worked out for an error only
        if str(value) not in index:
            raise InputError(
                f"{where()} has the label '{value}' in column '{column}' (data.label_column), "
                f"which no training row has (the training labels: {_listing(names)}); add it to "
                f"the training data or fix this label")
        return index[str(value)]

    return names, num_labels or max(len(names), 2), to_id


def _split_ids(split: str, labels: list, to_id, place, column: str) -> list[int] | None:
    """The split's label ids; None for an unlabelled test split (every label empty or -1)."""
    missing = [i for i, v in enumerate(labels) if v is None or v == NO_LABEL]
    if split == "test" and len(missing) == len(labels):
        return None
    if missing:
        i = missing[0]
        what = "an empty label" if labels[i] is None else f"the label {NO_LABEL} (no label)"
        why = {"train": "every training row needs a label: fill it in or drop the row",
               "validation": "the validation split is scored at every evaluation, so every row "
                             "needs a label: fill it in or drop the row (only a test split may "
                             "be unlabelled)",
               }.get(split, f"the {split} split is partly labelled: label every row, or leave "
                            f"every label empty (or {NO_LABEL}) to load it unscored")
        raise InputError(f"{place(i)} has {what} in column '{column}' (data.label_column); {why}")
    # place(i) reads the file up to row i: only for the message of a bad label
    return [to_id(v, lambda i=i: place(i)) for i, v in enumerate(labels)]


def _with_label_column(ds, column: str, ids: list[int] | None):
    """The split with its labels as int ids in `label` (written anew: a column the builder read
    as text would turn ids written into it back into text)."""
    drop = [column] + (["label"] if column != "label" and "label" in ds.column_names else [])
    return ds.remove_columns(drop).add_column("label", ids if ids is not None
                                              else [NO_LABEL] * len(ds))


def names_in_head_order(found: list[str], head: dict[str, int], what: str) -> list[str] | None:
    """Every class name in the pretrained head's order when each of `found` (the training
    data's names) is one of the head's; None where the data's own order applies (names the head
    was not trained for: said once, since the head's rows then change meaning)."""
    unknown = sorted(set(found) - set(head))
    if unknown:
        log.warning("the pretrained model's head was trained for the %s %s; the training "
                    "data's %s are not among them, so the data's own numbering applies and the "
                    "head learns them anew", what, _listing(sorted(head, key=head.get)),
                    _listing(unknown))
        return None
    return sorted(head, key=head.get)


def ids_in_head_order(given: list[str], head: dict[str, int], to_id, what: str):
    """(names, to_id) for ids that a dataset's ClassLabel names (`given`, as a hub dataset or
    a parquet file written by `datasets` has them), renumbered as the pretrained head numbers
    those names; the data's own ids where the head does not name them all."""
    order = names_in_head_order(given, head, what)
    if order is None:
        return given, to_id
    return order, lambda value, where: head[given[to_id(value, where)]]


def _listing(names: list[str], most: int = 10) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


# --- where a row is, as a person finds it in the file ---------------------------------------------
def _place(split: str, path: Path | None, d: DataConfig):
    """`place(i)`: where the split's row i (0-based) is. Line numbers are worked out only for an
    error, and follow the builders: blank lines are skipped, a quoted csv field may span lines
    (data/file_rows.py reads the file as they do)."""
    if path is None:
        name = f"{d.path}/{d.subset}" if d.subset else d.path
        return lambda i: f"row {i + 1} of the {split} split of {name}"
    fmt = format_of(path, d.format)
    if fmt in ("csv", "tsv"):
        dialect = file_rows.dialect_of(fmt, d.quoting)
        return lambda i: _line_or_row(path, _csv_line(path, dialect, i), i)
    if fmt in ("json", "jsonl") and not _is_json_array(path):
        return lambda i: _line_or_row(path, _text_line(path, i), i)
    return lambda i: f"{path} row {i + 1}"


def row_place(split: str, dataset, d: DataConfig):
    """`place(i)` for row i (0-based) of a split: its file and line where it was read from a
    file here (load_splits), its row of the hub's split, else `<split> row <i + 1>`."""
    source = source_of(dataset)
    if source is HUB:
        return _place(split, None, d)
    if source is not None:
        return _place(split, source, d)
    return lambda i: f"{split} row {i + 1}"


def _line_or_row(path: Path, line: int | None, index: int) -> str:
    return f"{path} line {line}" if line else f"{path} row {index + 1}"


def _csv_line(path: Path, dialect, index: int) -> int | None:
    """The line on which data row `index` starts (a quoted field may span lines)."""
    return file_rows.row_line(path, dialect, index)


def _text_line(path: Path, index: int) -> int | None:
    """The line of JSON record `index`: the index-th line that is not blank."""
    seen = -1
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if line.strip() and seen == index:
                return number
    return None


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def tokenize_splits(data: ClassificationData, d: DataConfig, tokenizer) -> dict:
    a, b = d.text_a_column, d.text_b_column

    def encode(batch):
        first = [str(x) if x is not None else "" for x in batch[a]]
        second = [str(x) if x is not None else "" for x in batch[b]] if b else None
        return tokenizer(first, second, truncation=True, max_length=d.max_seq_length)

    out = {}
    for split, ds in data.splits.items():
        keep = {"label"}
        encoded = ds.map(encode, batched=True,
                         remove_columns=[c for c in ds.column_names if c not in keep])
        out[split] = encoded.rename_column("label", "labels")
    return out
