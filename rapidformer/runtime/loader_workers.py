"""DataLoader worker processes leave SIGTERM and SIGINT to the process that trains.

A scheduler stops a job by signalling every process of its process group (`kill -TERM -PGID`:
Slurm, most batch systems, a terminal's Ctrl-C), and the launcher passes a signal on to each
worker's whole process group, as torch elastic does. DataLoader workers are in that group: with
the default action they die at once, and the training process's next batch then fails with
"DataLoader worker (pid ...) is killed by signal: Terminated" instead of stopping at the step
boundary with a checkpoint (runtime/preemption.py). So every loader's workers ignore both
signals from their start; the training process stops them when it stops (and a worker whose
training process is gone exits by itself within torch's 5 s status check).

    DataLoader(dataset, ..., num_workers=n, worker_init_fn=loader_worker_init())
    DataLoader(dataset, ..., worker_init_fn=loader_worker_init(users_own_init_fn))
"""
from __future__ import annotations

import signal
from typing import Callable

from rapidformer.runtime.preemption import SIGNALS


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: this worker ignores SIGTERM and SIGINT."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _IgnoreThen:
    """`ignore_stop_signals`, then the user's own worker_init_fn (a class, not a closure:
    loaders whose workers are spawned pickle it)."""

    def __init__(self, init_fn: Callable[[int], None]):
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        ignore_stop_signals(worker_id)
        self.init_fn(worker_id)

    def __repr__(self) -> str:
        return f"loader_worker_init({self.init_fn!r})"


def loader_worker_init(init_fn: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """The worker_init_fn for a DataLoader: the stop signals left to the training process,
    then `init_fn` (a user's own, or None). Wrapping twice adds nothing."""
    if init_fn is None or init_fn is ignore_stop_signals or isinstance(init_fn, _IgnoreThen):
        return init_fn or ignore_stop_signals
    return _IgnoreThen(init_fn)
