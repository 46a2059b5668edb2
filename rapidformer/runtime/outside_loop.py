"""A stop signal outside the training loop, in the process that runs it.

The loop turns SIGTERM and SIGINT into a checkpoint and exit code 75 (runtime/preemption.py).
Before it (composing, reading data, building the model) and after it (the final evaluation,
test and export), SIGINT was Python's KeyboardInterrupt traceback and SIGTERM a silent death:
nothing said, and a `trainer.overwrite=true` start left the earlier run aside. Here both end the
run as one exception (`StoppedOutsideLoop`, SIGINT's KeyboardInterrupt too) that the entry point
turns into one line, the run directory put back when nothing was trained, and exit 128 + the
signal's number.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class StoppedOutsideLoop(BaseException):
    """Not an Exception: nothing on the way up may take it for an error and carry on."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise(signum, _frame):
    raise StoppedOutsideLoop(signum)


@contextlib.contextmanager
def stops_outside_loop():
    """SIGTERM raises StoppedOutsideLoop while the block runs (where it has the default action:
    a caller's own handler, or an ignored SIGTERM, stays). The loop installs its own in turn
    and puts this one back when its steps end."""
    previous = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def signal_number(exc: BaseException) -> int:
    return exc.signum if isinstance(exc, StoppedOutsideLoop) else signal.SIGINT
