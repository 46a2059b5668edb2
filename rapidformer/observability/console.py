"""Log lines while a progress bar is drawn: through the bar's writer (tqdm.write), which clears
the bar, prints the line and draws the bar again below it. A handler that writes to the
terminal directly would glue the line onto the bar's last drawing instead.

The console handlers are the root logger's (Hydra's job logging puts its console handler
there, and a worker's logging.basicConfig does too); file handlers keep writing as before.
"""
from __future__ import annotations

import contextlib
import logging
import sys


class _BarWriter(logging.StreamHandler):
    """A console handler's stream, format, level and filters, written through tqdm.write."""

    def __init__(self, original: logging.StreamHandler, tqdm_class):
        super().__init__(original.stream)
        self.tqdm_class = tqdm_class
        self.setFormatter(original.formatter)
        self.setLevel(original.level)
        for log_filter in original.filters:
            self.addFilter(log_filter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tqdm_class.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(
        handler, logging.FileHandler) and getattr(handler, "stream", None) in (
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


@contextlib.contextmanager
def logs_through(bar):
    """While inside: the root logger's console handlers write through `bar`'s tqdm.write; a
    disabled bar (other ranks, trainer.progress_bar=false) changes nothing."""
    root = logging.getLogger()
    if getattr(bar, "disable", True) or not any(is_console(h) for h in root.handlers):
        yield
        return
    original = list(root.handlers)
    root.handlers = [_BarWriter(h, type(bar)) if is_console(h) else h for h in original]
    try:
        yield
    finally:
        root.handlers = original
