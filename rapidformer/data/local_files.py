"""Local data files: which file is each split's, whether it can be read, and reading it with
the `datasets` builders once its rows are known to account for its lines (data/file_rows.py).

Every problem is one InputError naming the file: a split's file that is a directory, a symbolic
link that loops or leads nowhere, something other than a regular file (a FIFO would block the
read), or one that cannot be read; text that is not UTF-8; a file with no rows; rows that do not
account for the lines. The libraries' own log lines, warnings and progress bars are kept quiet
while a file is read (RAPIDFORMER_DEBUG=1 shows them): the user sees the one message.

The dataset read from a file remembers the file (`source_of`), so that a later check of its rows
(sft's conversations, the labels) names the file and the line.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import stat
import warnings
import weakref
from pathlib import Path

from rapidformer.data import file_rows, json_rows
from rapidformer.errors import InputError, debug_enabled

FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "dev", "val"),
                 "test": ("test",)}
HUB = object()  # the source of a split loaded from the hub

_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(dataset, source) -> None:
    """`source`: the file a split was read from, or HUB."""
    with contextlib.suppress(TypeError):
        _SOURCES[dataset] = source


def source_of(dataset):
    """The file `dataset` was read from, HUB, or None when it was not loaded here."""
    try:
        return _SOURCES.get(dataset)
    except TypeError:
        return None


# --- which file, and whether it can be read ----------------------------------------------------
def path_problem(path: Path) -> str | None:
    """What keeps `path` from being read as a data file (a sentence that follows its name), or
    None when it is a readable regular file or does not exist at all."""
    try:
        info = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link that loops (following it never reaches a file)"
        if exc.errno == errno.ENOENT:
            if os.path.islink(path):
                return f"is a symbolic link to {os.readlink(path)}, which does not exist"
            return None
        return f"cannot be reached: {exc.strerror}"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory, not a data file"
    if not stat.S_ISREG(info.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode) else
                "a socket" if stat.S_ISSOCK(info.st_mode) else "a device")
        return f"is {kind}, not a regular file"
    if not os.access(path, os.R_OK):
        return "cannot be read: permission denied"
    return None


def directory_problem(root: Path) -> str | None:
    """What keeps data.path from being read as a directory of data files."""
    try:
        info = os.stat(root)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link that loops (following it never reaches a file)"
        if exc.errno == errno.ENOENT and os.path.islink(root):
            return f"is a symbolic link to {os.readlink(root)}, which does not exist"
        if exc.errno == errno.ENOENT:
            return None
        return f"cannot be reached: {exc.strerror}"
    if stat.S_ISDIR(info.st_mode) and not os.access(root, os.R_OK | os.X_OK):
        return "is a directory that cannot be read: permission denied"
    return None


def find_split_file(root: Path, split: str, given: str | None, fmt: str) -> Path | None:
    """The file of `split` under `root`: `given` (data.<split>_file), else the one
    `<alias>.<ext>` that is a readable file (two, e.g. train.csv and train.jsonl, or
    validation.csv and dev.csv, are refused: which one is meant is not said); a name that
    exists but cannot be read, with no readable one beside it, is refused with what is wrong
    with it."""
    if given:
        path = root / given
        problem = path_problem(path)
        if problem:
            raise InputError(f"{path} (data.{split}_file={given}) {problem}; point "
                             f"data.{split}_file at the data file")
        if not path.is_file():
            raise InputError(f"data file not found: {path} (data.{split}_file={given}, "
                             f"data.path={root}); fix the name or the path")
        return path
    extensions = list(FORMATS) if fmt == "auto" else [
        ext for ext, name in FORMATS.items() if name == fmt]
    unusable, found = [], []
    for stem in SPLIT_ALIASES[split]:
        for ext in extensions:
            path = root / f"{stem}{ext}"
            problem = path_problem(path)
            if problem:
                unusable.append((path, problem))
            elif path.is_file():
                found.append(path)
    if len(found) > 1:  # reading one would leave the others' rows out without a word
        names = ", ".join(p.name for p in found)
        raise InputError(f"{root} (data.path) holds {len(found)} files for the {split} split "
                         f"({names}); a run reads one: keep one of them there, or name it "
                         f"with data.{split}_file=NAME")
    if found:
        return found[0]
    if unusable:
        path, problem = unusable[0]
        raise InputError(f"{path} {problem}: it cannot be read as the {split} split; put the "
                         f"{split} data there as a file, or name the file with "
                         f"data.{split}_file")
    return None


def format_of(path: Path, fmt: str) -> str | None:
    return FORMATS.get(path.suffix.lower()) if fmt == "auto" else fmt


# --- reading -----------------------------------------------------------------------------------
def readable_format(path: Path, fmt: str) -> str:
    """The format `path` is read as, once its name (or data.format) says one and it is a
    readable regular file; else the InputError saying which."""
    fmt = format_of(path, fmt)
    if fmt is None:
        raise InputError(f"cannot tell the format of {path}: use a .csv, .tsv, .json, .jsonl or "
                         f".parquet name, or set data.format")
    problem = path_problem(path)
    if problem:
        raise InputError(f"{path} {problem}; point data.path at the data")
    return fmt


def read_file(path: Path, fmt: str, quoting: str = "auto"):
    """The file as a datasets.Dataset, its rows checked to account for its lines first."""
    from datasets import load_dataset

    fmt = readable_format(path, fmt)
    kwargs = {}
    try:
        rows = _checked_rows(path, fmt, quoting)
        if fmt in ("csv", "tsv"):
            dialect = file_rows.dialect_of(fmt, quoting)
            # only an empty cell is missing: pandas would read the texts "None", "NA", "null"
            # or "nan" as missing values too
            kwargs = {"delimiter": dialect.delimiter, "keep_default_na": False,
                      "na_values": [""]}
            if not dialect.quoted:
                kwargs["quoting"] = 3  # csv.QUOTE_NONE: `"` is text
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}; check the file") from None
    builder = {"tsv": "csv", "jsonl": "json"}.get(fmt, fmt)
    try:
        with quiet_libraries():
            # the builders read data_files as glob patterns: a run directory named with
            # brackets or a star ([x]) would match nothing
            dataset = load_dataset(builder, data_files={"data": glob.escape(str(path))},
                                   split="data", **kwargs)
    except Exception as exc:  # the builders wrap the real cause in their own error types
        said = json_rows.json_failure(path) if fmt in ("json", "jsonl") else None
        if said:
            raise InputError(said) from exc
        cause = _root_cause(exc)
        text = str(cause).strip() or type(cause).__name__
        raise InputError(f"cannot read {path} as {fmt}: {text.splitlines()[0]}") from exc
    if rows is not None and len(dataset) != rows:
        raise InputError(_count_mismatch(path, fmt, quoting, len(dataset), rows))
    remember(dataset, path)
    return dataset


def _checked_rows(path: Path, fmt: str, quoting: str) -> int | None:
    """The rows the file's lines hold (None: not counted, for parquet and a JSON object of
    columns); InputError for text that is not UTF-8, no rows, or rows that do not account for
    the lines."""
    if fmt == "parquet":
        return None
    bad_line = _first_bad_line(path)
    if bad_line:
        raise InputError(f"{path} is not valid UTF-8 text (line {bad_line}); re-encode it "
                         f"as UTF-8")
    header = 1 if fmt in ("csv", "tsv") else 0
    if _non_empty_lines(path) <= header:
        raise InputError(f"{path} holds no examples{' (only a header)' if header else ''}; "
                         f"add examples or point data.path at another file")
    if fmt in ("csv", "tsv"):
        return file_rows.check_delimited(path, file_rows.dialect_of(fmt, quoting))
    return json_rows.check_json(path, fmt)


def _count_mismatch(path: Path, fmt: str, quoting: str, read: int, rows: int) -> str:
    """The builder read another number of rows than the lines hold: name the first row one of
    them lacks."""
    first = min(read, rows)
    line = None
    if fmt in ("csv", "tsv"):
        line = file_rows.row_line(path, file_rows.dialect_of(fmt, quoting), first)
    where = f"{path} line {line}" if line else f"{path} row {first + 1}"
    return (f"{where}: the file's lines hold {rows} rows, but it was read as {read}; the rows "
            f"from here on are not read as written: check the file's quoting (data.quoting) and "
            f"format (data.format)")


@contextlib.contextmanager
def quiet_libraries():
    """The datasets library's log lines (a failed file is logged with its error before it is
    raised, which comes back as one InputError), Python warnings and progress bars, silenced
    while a file is read; RAPIDFORMER_DEBUG=1 keeps them."""
    if debug_enabled():
        yield
        return
    import datasets

    logger = logging.getLogger("datasets")
    level = logger.level
    bars = datasets.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def _non_empty_lines(path: Path, enough: int = 2) -> int:
    """Non-blank lines, counted up to `enough` (a line ends at \\n, \\r\\n or \\r, as for
    the csv builder)."""
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
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
