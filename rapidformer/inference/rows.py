"""The rows `rapidformer predict` reads and writes: jsonl (one JSON object a line) or csv/tsv (a
header line), told apart by the file's extension. Lists and objects in a csv cell are JSON text.
Quotes follow the training data's convention (data.quoting, docs/data.md): a tsv is unquoted
(`"` is text, as in GLUE's files), a csv quoted."""
from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

from rapidformer.errors import InputError
from rapidformer.file_modes import honour_umask

FORMATS = {".jsonl": "jsonl", ".csv": "csv", ".tsv": "tsv"}


def format_of(path: Path, flag: str) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"{flag} {path}: cannot tell its format from the name; use a .jsonl, "
                         f".csv or .tsv file")
    return fmt


def read_rows(path: Path, quoting: str = "auto") -> tuple[list[dict], list[int], list[str]]:
    """(rows, the line each row starts on, the columns), or one error naming the file and line.
    `quoting`: the run's data.quoting (auto: a tsv unquoted, a csv quoted)."""
    fmt = format_of(path, "--input")
    if not path.is_file():
        raise InputError(f"--input {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise InputError(f"{path} is not valid UTF-8 text (line {line}); re-encode it as "
                         f"UTF-8") from exc
    rows, lines, columns = [], [], {}
    if fmt == "jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise InputError(f"{path}:{number} is not JSON ({exc}); each line of a .jsonl "
                                 f"file is one object such as {{\"sentence1\": \"...\"}}") from exc
            if not isinstance(row, dict):
                raise InputError(f"{path}:{number} holds {type(row).__name__}, not an object; "
                                 f"each line of a .jsonl file is one object of named columns")
            rows.append(row)
            lines.append(number)
            columns.update(dict.fromkeys(row))
    else:
        quoted = quoting == "csv" or (quoting == "auto" and fmt == "csv")
        reader = csv.DictReader(text.splitlines(), delimiter="\t" if fmt == "tsv" else ",",
                                quoting=csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE)
        columns = dict.fromkeys(reader.fieldnames or [])
        for row in reader:
            if None in row:
                raise InputError(f"{path}:{reader.line_num} has more cells than the header "
                                 f"names ({len(columns)}); quote cells that hold the delimiter")
            rows.append(row)
            lines.append(reader.line_num)
    if not rows:
        raise InputError(f"--input {path} holds no rows{' (only a header)' if columns else ''}; "
                         f"give a file with one example a row")
    return rows, lines, list(columns)


def require(path: Path, rows: list[dict], lines: list[int], columns: list[str],
            wanted: dict[str, str]) -> None:
    """Every column the run's data config names ({config key: column}) is in the file and every
    row; one error naming the file, the column and the names expected."""
    expected = ", ".join(f"{column} ({key})" for key, column in wanted.items())
    for key, column in wanted.items():
        if column not in columns:
            raise InputError(f"{path}: no column '{column}' ({key}); the run reads the columns "
                             f"{expected}, this file has: {', '.join(columns) or 'none'}. Rename "
                             f"the file's columns to those names")
        for row, line in zip(rows, lines):
            if row.get(column) is None:
                raise InputError(f"{path}:{line} has no value in column '{column}' ({key}); "
                                 f"every row needs {expected}")


def write_rows(path: Path, fmt: str, rows: list[dict]) -> None:
    """Written whole or not at all (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            if fmt == "jsonl":
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                columns = list(dict.fromkeys(k for row in rows for k in row))
                writer = csv.DictWriter(f, columns, delimiter="\t" if fmt == "tsv" else ",")
                writer.writeheader()
                for row in rows:
                    writer.writerow({k: _cell(v) for k, v in row.items()})
        honour_umask(Path(tmp))  # mkstemp's file is 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cell(value):
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else value
