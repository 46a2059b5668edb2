"""Whether the rows of a .json / .jsonl data file account for its lines, checked before the
`datasets` builders read it (data/file_rows.py does the same for csv and tsv).

JSON lines: every line that is not blank is one JSON object (an object over several lines, two
on a line, or a line that is no object is refused with its line). A `.json` file is one JSON
array (its items are the rows), one object (one row), or JSON lines. Each refusal is one
InputError naming the file, the line (from 1, as an editor shows it) and the fix.
"""
from __future__ import annotations

import json
from pathlib import Path

from rapidformer.errors import InputError


def check_json(path: Path, fmt: str) -> int:
    """The number of rows of a .json/.jsonl file; an InputError where a line is no row of its
    own."""
    with open(path, "rb") as f:
        start = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if fmt == "json" and start == b"[":
        return _json_array(path)
    try:
        return _json_lines(path, fmt)
    except InputError:
        if fmt == "json" and start == b"{" and _one_json_object(path):
            return 1  # the builder reads one object as one row
        raise


def once(pairs: list) -> dict:
    """json's object_pairs_hook: the object, or KeyError naming a key it gives twice (the
    builders keep one of the two silently)."""
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise KeyError(twice)
    return dict(pairs)


def _json_array(path: Path) -> int:
    text = path.read_text(encoding="utf-8-sig")
    try:
        value = json.loads(text, object_pairs_hook=once)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} line {exc.lineno}, column {exc.colno}: not valid JSON "
                         f"({exc.msg}); fix the file") from None
    except KeyError as exc:  # the builder keeps the last of the two silently
        row, line = _item_with_a_key_twice(text)
        raise InputError(f"{path} line {line}: row {row} of its array gives the key "
                         f"{exc.args[0]!r} twice in one object; keep one of them") from None
    return len(value)


def _item_with_a_key_twice(text: str) -> tuple[int, int]:
    """(row from 1, line from 1 where it starts) of the array's first item that gives a key
    twice."""
    decoder = json.JSONDecoder(object_pairs_hook=once)
    i, row = text.index("[") + 1, 0
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        row, start = row + 1, i
        try:
            _, i = decoder.raw_decode(text, i)
        except KeyError:
            return row, text.count("\n", 0, start) + 1


def _one_json_object(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8-sig")), dict)
    except json.JSONDecodeError:
        return False


def _json_lines(path: Path, fmt: str) -> int:
    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.decode("utf-8")
            if number == 1:
                text = text.lstrip("\ufeff")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(_json_line_problem(path, fmt, number, text, exc)) from None
            if not isinstance(value, dict):
                raise InputError(_not_an_object(path, fmt, number, value))
            rows += 1
    return rows


ONE_PER_LINE = "a .jsonl file holds one JSON object per line"


def _json_line_problem(path: Path, fmt: str, number: int, text: str,
                       exc: json.JSONDecodeError) -> str:
    rule = ONE_PER_LINE if fmt == "jsonl" else \
        "a .json file holds one JSON array of objects, or one object per line"
    if exc.msg == "Extra data":
        rest = text[exc.pos:].strip()
        if rest in (",", "]", "],"):  # an array's punctuation, left when it was cut into lines
            return (f"{path} line {number} has {rest!r} after its object; {rule}, with nothing "
                    f"between them (no commas, no enclosing [ ]){_as_json(fmt)}")
        return (f"{path} line {number} holds more than one JSON value (the second starts at "
                f"column {exc.colno}); {rule}: put each object on a line of its own")
    ends = _object_end(path, number)
    value = "array" if text.lstrip().startswith("[") else "object" if \
        text.lstrip().startswith("{") else "value"
    if ends:
        return (f"{path} line {number} starts a JSON {value} that ends on line {ends}; {rule}: "
                f"write each object on one line (e.g. jq -c . FILE){_as_json(fmt)}")
    detail = f"{exc.msg}{'' if exc.msg.endswith(' at') else ' at'} column {exc.colno}"
    if exc.pos >= len(text.rstrip()):  # the value is cut off at the end of the line
        return (f"{path} line {number} starts a JSON {value} that does not end on it ({detail}, "
                f"the line's end); {rule}: write each object whole on one line{_as_json(fmt)}")
    return f"{path} line {number} is not valid JSON ({detail}); {rule}: fix the line"


def _object_end(path: Path, number: int, most: int = 200) -> int | None:
    """The line on which a JSON value starting on line `number` ends, when it spans lines (up
    to `most` of them)."""
    text, depth_lines = "", 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if n < number:
                continue
            text += raw.decode("utf-8", errors="replace")
            depth_lines += 1
            if n > number:
                try:
                    json.loads(text)
                    return n
                except json.JSONDecodeError as exc:
                    if exc.msg == "Extra data":
                        return None
            if depth_lines > most:
                return None
    return None


def _not_an_object(path: Path, fmt: str, number: int, value) -> str:
    kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
    return (f"{path} line {number} holds {kind}, not a JSON object: each row is an object of "
            f"named columns ({{\"column\": value, ...}}), one per line{_as_json(fmt)}")


def _as_json(fmt: str) -> str:
    return ("; a file that is one JSON array or object is read as .json (rename it, or set "
            "data.format=json)" if fmt == "jsonl" else "")


def json_failure(path: Path) -> str | None:
    """Why the builder could not read a JSON file whose lines are each an object (or an array
    of them), where a line says: a key given twice in one object; or no key in any row."""
    keys = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
            if not text.strip():
                continue
            try:
                value = json.loads(text, object_pairs_hook=once)
            except KeyError as exc:
                return (f"{path} line {number} gives the key {exc.args[0]!r} twice in one "
                        f"object; keep one of them")
            except json.JSONDecodeError:
                return None  # a JSON array over several lines: nothing to add
            keys += len(value) if isinstance(value, dict) else 1
    if not keys:
        return f"{path}: its rows have no columns (every object is empty); add the data"
    return None

