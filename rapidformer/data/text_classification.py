"""Sentence(-pair) classification data: hub datasets, local files, or the synthetic pairs.

Local files are read with the `datasets` library's csv/json/parquet builders; columns are mapped
by `data.text_a_column`, `data.text_b_column` and `data.label_column`. Every way a file can be
unusable (missing, unreadable, wrong columns, labels out of range, empty) is an `InputError`
that names the file and the config key to change.
"""
from __future__ import annotations

import contextlib
import logging

from dataclasses import dataclass, field
from pathlib import Path

from rapidformer.config.schema import DataConfig
from rapidformer.data.synthetic import write_dataset
from rapidformer.errors import InputError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "dev", "val"),
                 "test": ("test",)}


@dataclass
class ClassificationData:
    splits: dict  # split name -> datasets.Dataset with text columns and `label`
    num_labels: int
    label_names: list[str] = field(default_factory=list)
    scored_splits: tuple[str, ...] = ("validation",)


def _find_split_file(root: Path, split: str, given: str | None, fmt: str) -> Path | None:
    if given:
        path = root / given
        if not path.is_file():
            raise InputError(f"data file not found: {path} (data.{split}_file={given}, "
                             f"data.path={root}); fix the name or the path")
        return path
    extensions = list(FORMATS) if fmt == "auto" else [
        ext for ext, name in FORMATS.items() if name == fmt]
    for stem in SPLIT_ALIASES[split]:
        for ext in extensions:
            if (root / f"{stem}{ext}").is_file():
                return root / f"{stem}{ext}"
    return None


def _read(path: Path, fmt: str):
    from datasets import load_dataset

    fmt = FORMATS.get(path.suffix.lower()) if fmt == "auto" else fmt
    if fmt is None:
        raise InputError(f"cannot tell the format of {path}: use a .csv, .tsv, .json, .jsonl or "
                         f".parquet name, or set data.format")
    builder, kwargs = {"csv": ("csv", {}), "tsv": ("csv", {"delimiter": "\t"}),
                       "json": ("json", {}), "jsonl": ("json", {}),
                       "parquet": ("parquet", {})}[fmt]
    if fmt != "parquet":
        bad_line = _first_bad_line(path)
        if bad_line:
            raise InputError(f"{path} is not valid UTF-8 text (line {bad_line}); re-encode it "
                             f"as UTF-8")
        header = 1 if fmt in ("csv", "tsv") else 0
        if _non_empty_lines(path) <= header:
            raise InputError(f"{path} holds no examples{' (only a header)' if header else ''}; "
                             f"add examples or point data.path at another file")
    try:
        with _library_errors_silenced():
            return load_dataset(builder, data_files={"data": str(path)}, split="data", **kwargs)
    except Exception as exc:  # the builders wrap the real cause in their own error types
        cause = _root_cause(exc)
        text = str(cause).strip() or type(cause).__name__
        raise InputError(f"cannot read {path} as {fmt}: {text.splitlines()[0]}") from exc


@contextlib.contextmanager
def _library_errors_silenced():
    """datasets logs a failed file with its traceback before raising; the failure comes back
    as one InputError naming the file, so its ERROR records are dropped while loading."""
    logger = logging.getLogger("datasets")
    drop = lambda record: record.levelno < logging.ERROR  # noqa: E731
    logger.addFilter(drop)
    for handler in logger.handlers:
        handler.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
        for handler in logger.handlers:
            handler.removeFilter(drop)


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def _non_empty_lines(path: Path, enough: int = 2) -> int:
    """Non-blank lines, counted up to `enough`."""
    count = 0
    with open(path, "rb") as f:
        for line in f:
            count += bool(line.strip())
            if count >= enough:
                break
    return count


def _first_bad_line(path: Path) -> int:
    """The first line that is not UTF-8 (1-based), or 0 when the whole file is."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _local_splits(d: DataConfig, root: Path) -> dict:
    if not root.exists():
        raise InputError(f"data directory not found: {root} (data.path); create it or fix the path")
    if root.is_file():
        return {"train": _read(root, d.format)}
    given = {"train": d.train_file, "validation": d.validation_file, "test": d.test_file}
    splits = {}
    for split in SPLIT_ALIASES:
        path = _find_split_file(root, split, given[split], d.format)
        if path is not None:
            splits[split] = _read(path, d.format)
    if "train" not in splits:
        raise InputError(f"no training file in {root} (data.path): expected train.csv, "
                         f"train.tsv, train.json, train.jsonl or train.parquet, or set "
                         f"data.train_file")
    return splits


def _hub_splits(d: DataConfig) -> dict:
    from datasets import load_dataset

    try:
        loaded = load_dataset(d.path, d.subset)
    except (ConnectionError, OSError, ValueError) as exc:
        name = f"{d.path}/{d.subset}" if d.subset else d.path
        raise InputError(
            f"cannot load the dataset '{name}' (data.path, data.subset): not in the local "
            f"Hugging Face cache and the hub cannot be reached. Fix: load it once where there is "
            f"network, or use local files: data=pairs_local data.path=DIR") from exc
    return {split: loaded[split] for split in loaded}


def load_splits(d: DataConfig, run_dir: Path, write_synthetic=write_dataset) -> dict:
    """{split: datasets.Dataset} from local files, the hub, or data this project generates
    (`write_synthetic(root, train_size, eval_size, seed)` writes train/validation jsonl)."""
    if d.source == "synthetic":
        root = Path(d.path) if d.path else run_dir / "data"
        if not (root / "train.jsonl").is_file():
            write_synthetic(root, d.synthetic_train_size, d.synthetic_eval_size, d.synthetic_seed)
        splits = _local_splits(d, root)
    elif d.source == "local":
        splits = _local_splits(d, Path(d.path))
    else:
        splits = _hub_splits(d)
    if "train" not in splits:
        raise InputError(f"the dataset has no 'train' split (it has: {', '.join(splits)})")
    return splits


def require_columns(splits: dict, wanted: dict[str, str]) -> None:
    """Every split has the columns {config key: column name}, or one error naming the key."""
    for split, ds in splits.items():
        for key, column in wanted.items():
            if column not in ds.column_names:
                raise InputError(
                    f"the {split} split has no column '{column}' ({key}); its columns are: "
                    f"{', '.join(ds.column_names)}. Set {key} to one of them")


def load_classification_data(d: DataConfig, run_dir: Path, num_labels: int | None) -> ClassificationData:
    splits = load_splits(d, run_dir)
    _check_columns(d, splits)
    for split, ds in splits.items():
        if len(ds) == 0 and split == "train":
            raise InputError(f"the training split is empty (data.path={d.path}); add examples")
    return _encode_labels(d, splits, num_labels)


def _check_columns(d: DataConfig, splits: dict) -> None:
    wanted = {"data.text_a_column": d.text_a_column, "data.label_column": d.label_column}
    if d.text_b_column:
        wanted["data.text_b_column"] = d.text_b_column
    require_columns(splits, wanted)


def _encode_labels(d: DataConfig, splits: dict, num_labels: int | None) -> ClassificationData:
    train_labels = splits["train"][d.label_column]
    label_names: list[str] = []
    if any(isinstance(v, str) for v in train_labels):
        label_names = sorted({str(v) for v in train_labels})
        index = {name: i for i, name in enumerate(label_names)}

        def to_id(batch):
            out = []
            for v in batch[d.label_column]:
                if v is None or str(v) not in index:
                    out.append(-1)
                else:
                    out.append(index[str(v)])
            return {"label": out}

        splits = {s: ds.map(to_id, batched=True) if d.label_column == "label" else
                  ds.map(to_id, batched=True, remove_columns=[d.label_column])
                  for s, ds in splits.items()}
        found = len(label_names)
    else:
        if d.label_column != "label":
            splits = {s: (ds.remove_columns(["label"]) if "label" in ds.column_names else ds)
                      .rename_column(d.label_column, "label") for s, ds in splits.items()}
        if any(v is None for v in train_labels):
            raise InputError(f"the train split has empty labels in column '{d.label_column}'")
        found = int(max(train_labels)) + 1
        if min(train_labels) < 0:
            raise InputError(f"the train split has a negative label ({min(train_labels)}) in "
                             f"column '{d.label_column}'; labels must be 0..num_labels-1")
    n = num_labels or max(found, 2)
    scored = []
    for split, ds in splits.items():
        labels = [v for v in ds["label"] if v is not None]
        if split != "train" and (not labels or min(labels) < 0):
            continue  # unlabelled split (e.g. GLUE test): not scored
        if labels and max(labels) >= n:
            raise InputError(
                f"the {split} split has label {max(labels)} but task.num_labels={n}; labels must "
                f"be 0..{n - 1}: raise task.num_labels or fix the data")
        if split != "train":
            scored.append(split)
    return ClassificationData(splits=splits, num_labels=n, label_names=label_names,
                              scored_splits=tuple(scored))


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
