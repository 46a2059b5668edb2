"""What stops `preprocess_data`, or makes it skip a line: its errors, and how their messages
name a JSON value."""
from __future__ import annotations

import signal

from rapidformer.errors import InputError


class PreprocessError(InputError):
    """Input, tokenizer files or output paths that preprocessing cannot use."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT, raised in the main thread so that the `finally` clauses remove the
    temporary files. A BaseException, as KeyboardInterrupt is: no `except Exception` on the
    way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.name = signal.Signals(signum).name
        self.progress = "before any document was written"


class LineError(ValueError):
    """A line of the input that cannot be used; `where` is what follows 'line N' (a column,
    a key)."""

    def __init__(self, what: str, where: str = ""):
        super().__init__(what)
        self.what, self.where = what, where


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    return {dict: "an object", list: "an array", str: "a string"}[type(value)]
