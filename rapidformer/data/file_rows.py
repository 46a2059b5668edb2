"""Whether the rows a data file is read as account for its lines, checked before the `datasets`
builders read it (their readers follow a runaway quote or a broken line silently).

Delimited files (csv, tsv), under `data.quoting` (docs/data.md, "Local files: lines and rows"):

- without quoting (a tsv's default: GLUE and MSR files never quote, `"` is text there) every
  line that is not blank is one row, and must have as many fields as the header;
- with quoting (a csv's default, or `data.quoting=csv`) a field that starts with `"` runs to the
  next `"` that is not doubled, and may span lines. Such a field is a runaway quote, and the file
  is refused at the line where the quote opens, when its quote never closes, when the quote that
  closes it is followed by more text before the next delimiter, when its row ends with another
  number of fields than the header, or when it swallows rows: every line it spans, read alone,
  is a row (the header's number of fields, two or more, and in each column that the one-line
  rows fill with numbers, or with a few values over many rows, such a value);
- every row, one line or several, has the header's number of fields.

JSON and JSON lines files: data/json_rows.py.

Each refusal is one InputError naming the file, the line and the fix. The line numbers are the
ones an editor shows, the header and blank lines counted, from 1 (a line ends at \\n, \\r\\n or
\\r, as for the builders).
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

from rapidformer.errors import InputError

QUOTE = '"'
KEEP_LINES = 1000  # the lines of a field spanning lines that are kept to read alone
KIND_ROWS = 20_000  # the one-line rows a column's kind is learnt from
# a column of at most FEW_VALUES distinct values holds labels, not text, when it has at least
# MANY_ROWS one-line rows (4 a value on average), or 2 a value that are single words (pos, B-PER)
FEW_VALUES, MANY_ROWS = 16, 20
WORD = re.compile(r"[^\s,]{1,24}")
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class Dialect:
    delimiter: str
    quoted: bool
    fmt: str  # "csv" or "tsv", as the messages name the file's kind

    @property
    def separator(self) -> str:
        return "tab" if self.delimiter == "\t" else "comma" if self.delimiter == "," else \
            repr(self.delimiter)


def dialect_of(fmt: str, quoting: str) -> Dialect:
    """The reading of a csv or tsv file under data.quoting (auto: a tsv unquoted, a csv quoted)."""
    quoted = quoting == "csv" if fmt == "tsv" else quoting != "none"
    return Dialect("\t" if fmt == "tsv" else ",", quoted, fmt)


# --- delimited files ----------------------------------------------------------------------------
@dataclass
class Span:
    """A quoted field that spans lines."""
    opens: int  # the line its quote opens on
    lines: list[str]  # its lines, from the start of the one it opens on (at most KEEP_LINES)
    closes: int | None = None  # the line its quote closes on; None: the file ends inside it
    trailing: str = ""  # text between the closing quote and the next delimiter


@dataclass
class Record:
    start: int
    end: int
    fields: int
    spans: list[Span] = field(default_factory=list)


# the states of the scan within a record
FIELD_START, UNQUOTED, QUOTED, CLOSED, END = range(5)


def records(path: Path, dialect: Dialect):
    """Every record of the file that is not blank (the header first), as the builders read it:
    a quote is special at the start of a field only, a doubled quote inside a quoted field is
    one quote, text after a closing quote joins the field."""
    d, quoted = dialect.delimiter, dialect.quoted
    rec = span = None
    state = FIELD_START
    with open(path, encoding="utf-8-sig", newline="") as f:
        for number, line in enumerate(f, start=1):
            body = line.rstrip("\r\n")
            if rec is None:
                if d not in body and not body.strip(" \t"):
                    continue  # blank: the builders skip it
                if not quoted or QUOTE not in body:
                    yield Record(number, number, body.count(d) + 1)
                    continue
                rec, span, state, opened = Record(number, number, 1), None, FIELD_START, 0
            else:  # the line goes on with a quoted field
                rec.end = number
                if len(span.lines) < KEEP_LINES:
                    span.lines.append(body)
            i, n = 0, len(body)
            while True:
                if state == QUOTED:
                    j = body.find(QUOTE, i)
                    if j < 0:
                        break  # the field goes on past this line
                    if j + 1 < n and body[j + 1] == QUOTE:  # "": a quote of the text
                        i = j + 2
                        continue
                    i, state = j + 1, CLOSED
                    if span is not None:
                        span.closes = number
                        rec.spans.append(span)
                    continue
                if state == CLOSED:
                    j = body.find(d, i)
                    if span is not None and span.closes is not None:
                        span.trailing = body[i:] if j < 0 else body[i:j]
                    if j < 0:
                        state = END
                        break
                    rec.fields, i, state, span = rec.fields + 1, j + 1, FIELD_START, None
                    continue
                if state == FIELD_START:
                    if i < n and body[i] == QUOTE:
                        state, opened, i = QUOTED, number, i + 1
                        continue
                    state = UNQUOTED
                j = body.find(d, i)  # UNQUOTED: a quote here is text
                if j < 0:
                    state = END
                    break
                rec.fields, i, state = rec.fields + 1, j + 1, FIELD_START
            if state == QUOTED:
                if span is None:  # the quoted field goes on to the next line
                    span = Span(opened, [line.rstrip("\r\n")])
                continue
            yield rec
            rec, span = None, None
    if rec is not None:  # the file ended inside a quoted field
        if span is None:
            span = Span(opened, [])
        rec.spans.append(span)
        yield rec


def check_delimited(path: Path, dialect: Dialect) -> int:
    """The number of data rows (the header not counted), or an InputError where the rows do not
    account for the lines (the module docstring)."""
    header, rows, spans = None, 0, []
    for rec in records(path, dialect):
        for span in rec.spans:
            if span.closes is None or span.trailing:
                _refuse_earlier_runaway(path, dialect, header, spans, span.opens)
                raise InputError(_broken_quote(path, dialect, span))
        if header is None:
            header = rec
            _refuse_a_name_twice(path, dialect, rec.start)
            continue
        if rec.fields != header.fields:
            where = rec.spans[0].opens if rec.spans else rec.start
            _refuse_earlier_runaway(path, dialect, header, spans, where)
            raise InputError(_field_count(path, dialect, rec, header))
        spans += rec.spans
        rows += 1
    _refuse_earlier_runaway(path, dialect, header, spans, None)
    return rows


def _refuse_a_name_twice(path: Path, dialect: Dialect, line: int) -> None:
    """Refuse a header that names a column twice: the builders read one of the two under the
    name and rename the other (`label.1`), so a task reads one of two columns silently."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        for number, text in enumerate(f, start=1):
            if number == line:
                break
    names = next(csv.reader([text.rstrip("\r\n")], delimiter=dialect.delimiter,
                            quoting=csv.QUOTE_MINIMAL if dialect.quoted else csv.QUOTE_NONE),
                 [])
    seen: dict[str, int] = {}
    for column, name in enumerate(names, start=1):
        if name.strip() and name in seen:
            raise InputError(
                f"{path} line {line}: the header names the column {name!r} twice (columns "
                f"{seen[name]} and {column}); the file would be read with one of them under "
                f"that name and the other renamed ({name}.1), so a task would read one of the "
                f"two without a word: rename or remove one of them")
        seen.setdefault(name, column)


def _refuse_earlier_runaway(path: Path, dialect: Dialect, header: Record | None, spans: list,
                            before: int | None) -> None:
    """Refuse the first field spanning lines (before line `before`) that swallows rows."""
    spans = [s for s in spans if before is None or s.opens < before]
    if not spans or header is None or header.fields < 2:
        return
    kinds = _column_kinds(path, dialect, header.fields, spans)
    for span in spans:
        if _swallows_rows(span, dialect, header.fields, kinds):
            raise InputError(
                f"{path} line {span.opens}: a quote opens a field there and runs on to line "
                f"{span.closes}, so lines {span.opens}-{span.closes} would be read as one "
                f"field, but each of them reads as a row of its own ({header.fields} fields); "
                f"{_quote_fix(dialect)}")


def _swallows_rows(span: Span, dialect: Dialect, width: int, kinds: list) -> bool:
    lines = [line for line in span.lines if line.strip(" \t")]
    return len(lines) >= 2 and all(_is_row(split_alone(line, dialect), width, kinds)
                                   for line in lines)


def _is_row(values: list[str], width: int, kinds: list) -> bool:
    return len(values) == width and all(kind is None or kind.holds(v.strip())
                                        for kind, v in zip(kinds, values))


def split_alone(line: str, dialect: Dialect) -> list[str]:
    """The fields of one line read alone; a quote that does not close on it is text."""
    if not dialect.quoted or QUOTE not in line:
        return line.split(dialect.delimiter)
    try:
        return next(csv.reader([line], delimiter=dialect.delimiter, strict=True))
    except csv.Error:
        return line.split(dialect.delimiter)


@dataclass
class Kind:
    """What the one-line rows hold in a column: numbers (and whether empty cells), or a few
    values each repeated."""
    numbers: bool
    empty: bool
    values: frozenset | None

    def holds(self, value: str) -> bool:
        if self.numbers:
            return bool(NUMBER.fullmatch(value)) or (self.empty and not value)
        return value in self.values


def _column_kinds(path: Path, dialect: Dialect, width: int, spans: list) -> list:
    """Per column, its Kind when it is closed (numbers, or a few repeated values), else None."""
    inside = [(s.opens, s.closes or s.opens) for s in spans]  # in the file's order
    seen = [set() for _ in range(width)]
    numbers, empty, rows = [True] * width, [False] * width, 0
    lines = _one_line_rows(path, dialect, width, inside)
    for values in lines:
        rows += 1
        for c, value in enumerate(values):
            value = value.strip()
            if not value:
                empty[c] = True
            elif not NUMBER.fullmatch(value):
                numbers[c] = False
            if len(seen[c]) <= FEW_VALUES:
                seen[c].add(value)
        if rows >= KIND_ROWS:
            break
    kinds = []
    for c in range(width):
        filled = any(v for v in seen[c])
        if rows and numbers[c] and filled:
            kinds.append(Kind(True, empty[c], None))
        elif 0 < len(seen[c]) <= FEW_VALUES and (
                rows >= max(MANY_ROWS, 4 * len(seen[c]))
                or (rows >= 2 * len(seen[c]) and all(WORD.fullmatch(v) for v in seen[c]))):
            kinds.append(Kind(False, empty[c], frozenset(seen[c])))
        else:
            kinds.append(None)
    return kinds


def _one_line_rows(path: Path, dialect: Dialect, width: int, inside: list):
    """The fields of the data rows on one line each, outside the fields that span lines
    (`inside`: their first and last lines, in the file's order)."""
    header, k = True, 0
    with open(path, encoding="utf-8-sig", newline="") as f:
        for number, line in enumerate(f, start=1):
            while k < len(inside) and inside[k][1] < number:
                k += 1
            if k < len(inside) and inside[k][0] <= number:
                continue  # a line of a field that spans lines
            body = line.rstrip("\r\n")
            if dialect.delimiter not in body and not body.strip(" \t"):
                continue
            if header:
                header = False
                continue
            values = split_alone(body, dialect)
            if len(values) == width:
                yield values


def _quote_fix(dialect: Dialect) -> str:
    fix = ('close the quote where the field ends (a quote inside a quoted field is written '
           'twice: ""), or remove it')
    if dialect.fmt == "tsv":
        fix += (", or read every quote as text with data.quoting=none (the default for tsv: "
                "GLUE and MSR files do not quote)")
    else:
        fix += ', or read every quote as text with data.quoting=none'
    return fix


def _broken_quote(path: Path, dialect: Dialect, span: Span) -> str:
    if span.closes is None:
        return (f"{path} line {span.opens}: a quote opens a field there and never closes (the "
                f"file ends inside it); {_quote_fix(dialect)}")
    return (f"{path} line {span.opens}: a quote opens a field there and is closed only on line "
            f"{span.closes}, by a quote followed by more text ({span.trailing[:30]!r}), so "
            f"lines {span.opens}-{span.closes} would be read as one field; "
            f"{_quote_fix(dialect)}")


def _field_count(path: Path, dialect: Dialect, rec: Record, header: Record) -> str:
    sep, width = dialect.separator, header.fields
    if rec.spans:
        span = rec.spans[0]
        return (f"{path} line {span.opens}: a quote opens a field there and runs on to line "
                f"{span.closes}, leaving a row of {rec.fields} fields where the header (line "
                f"{header.start}) has {width}; {_quote_fix(dialect)}")
    said = (f"{path} line {rec.start} has {rec.fields} {sep}-separated fields, the header "
            f"(line {header.start}) has {width}")
    line = _line(path, rec.start)
    if dialect.fmt == "tsv" and not dialect.quoted and QUOTE in line:
        return (f"{said}; if this file quotes its fields (a field in \"...\" holding tabs or line "
                f"breaks), read it with data.quoting=csv; else fix the line")
    if rec.fields > width:
        fix = ('a field that holds a comma must be quoted ("...")' if dialect.fmt == "csv"
               else "remove the extra tabs, or name every column in the header")
    else:
        fix = ("add the missing fields (an empty field is nothing between two "
               f"{'tabs' if sep == 'tab' else 'commas'}), or join the line to the one it was "
               f"broken from")
    return f"{said}; {fix}"


def _line(path: Path, number: int) -> str:
    with open(path, encoding="utf-8-sig", newline="") as f:
        for n, line in enumerate(f, start=1):
            if n == number:
                return line
    return ""


def row_line(path: Path, dialect: Dialect, index: int) -> int | None:
    """The line on which data row `index` (from 0) starts, or None past the last row."""
    for i, rec in enumerate(records(path, dialect)):
        if i == index + 1:  # record 0 is the header
            return rec.start
    return None
