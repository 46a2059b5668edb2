"""DataLoader worker processes leave SIGTERM and SIGINT to the process that trains.

A scheduler stops a job by signalling every process of its process group (`kill -TERM -PGID`:
Slurm, most batch systems, a terminal's Ctrl-C), and the launcher passes a signal on to each
worker's whole process group, as torch elastic does. DataLoader workers are in that group: with
the default action they die at once, and the training process's next batch then fails with
"DataLoader worker (pid ...) is killed by signal: Terminated" instead of stopping at the step
boundary with a checkpoint (runtime/preemption.py). So every loader's workers ignore both
signals; the training process stops them when it stops (and a worker whose training process is
gone exits by itself within torch's 5 s status check).

A worker is exposed from its start until its `worker_init_fn` runs: torch's worker loop first
installs a SIGTERM handler that dies by the signal, then seeds, then calls the init function.
Workers start with every new iterator (each epoch and evaluation, unless persistent), so a
signal that lands while one starts is not rare. The loader therefore starts its workers with both signals blocked
(a blocked signal stays pending; the mask is inherited through fork and exec), and the init
function ignores them before it unblocks them: the pending one is discarded. The training
process gets its own pending signal as soon as the workers are started. Spawned workers inherit
the mask through exec. Fork-server workers inherit the server's mask, not this process's, and a
server started blocked would keep every later process of it (the user's own too) deaf to
SIGTERM: a loader asked to use a fork server (`multiprocessing_context="forkserver"`, or
`multiprocessing.set_start_method("forkserver")`) gets no block, and its workers are exposed
while they start, as torch's are. Where the fork server is only Python's default (POSIX
systems but macOS from Python 3.14, while nothing has fixed the start method: a
`multiprocessing.Queue()` made earlier does), the loaders fork instead, as Python did before.

Workers that ignore SIGTERM also ignore the one way Python's exit stops them: at exit,
multiprocessing terminates (SIGTERM) its daemon children and then joins them, and a worker of an
iterator that is still referenced then (a run that failed mid-epoch: the traceback holds it; a
module-level iterator) waits for indices forever while its parent waits for it: the process
never exits. So an exit hook, which runs before multiprocessing's, shuts down the workers of
every iterator still alive and kills (SIGKILL) any that do not stop.

    DataLoader(dataset, ..., num_workers=n)  # this module's DataLoader, not torch's
    DataLoader(dataset, ..., worker_init_fn=users_own_init_fn)  # theirs runs after ours
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit hook before ours: ours runs first
import os
import signal
import threading
import weakref
from multiprocessing import resource_tracker
from typing import Callable

import torch.utils.data

from rapidformer.runtime.preemption import SIGNALS

MASKS = hasattr(signal, "pthread_sigmask")  # POSIX


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: this worker ignores SIGTERM and SIGINT (a copy of them
    that came while it started, blocked, is discarded)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if MASKS:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


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


@contextlib.contextmanager
def stop_signals_blocked():
    """SIGTERM and SIGINT held back in this thread (a process started meanwhile inherits the
    mask); one that came meanwhile is delivered when the block ends. POSIX only (MASKS)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose worker processes leave the stop signals to the process that
    trains, from the moment they start (the module's docstring says why and how)."""

    def __init__(self, *args, worker_init_fn: Callable[[int], None] | None = None, **kwargs):
        super().__init__(*args, worker_init_fn=loader_worker_init(worker_init_fn), **kwargs)
        if self.num_workers > 0 and self.multiprocessing_context is None and \
                _forkserver_by_default():
            self.multiprocessing_context = "fork"

    def _get_iterator(self):
        if self.num_workers == 0:
            return self._started_iterator()
        before = set(multiprocessing.active_children())
        try:  # the workers noted even where starting the iterator fails after they started
            iterator = self._started_iterator()
        finally:
            _WORKERS.update(p for p in multiprocessing.active_children()
                            if p.daemon and p not in before)  # torch's workers are daemons
        _WITH_WORKERS.add(iterator)
        return iterator

    def _started_iterator(self):
        method = self._start_method() if self.num_workers > 0 and MASKS else None
        if method in (None, "forkserver"):
            return super()._get_iterator()
        if method != "fork":
            # the resource tracker unblocks both signals when it starts (a spawn context's
            # queues start it): started first, it cannot undo the block
            resource_tracker.ensure_running()
        with stop_signals_blocked():  # the workers start in here (persistent ones: once)
            return super()._get_iterator()

    def _start_method(self) -> str:
        # multiprocessing.get_context() would fix the default start method, and a later
        # set_start_method of the user's would then fail
        if self.multiprocessing_context is not None:
            return self.multiprocessing_context.get_start_method()
        return (multiprocessing.get_start_method(allow_none=True)
                or multiprocessing.get_all_start_methods()[0])  # the first is the default


def _forkserver_by_default() -> bool:
    """Whether Python would start workers through a fork server, its default where nothing has
    fixed the start method yet (POSIX systems but macOS, from Python 3.14): the loaders then
    fork, as Python did before."""
    return (multiprocessing.get_start_method(allow_none=True) is None
            and multiprocessing.get_all_start_methods()[0] == "forkserver")


_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()  # iterators of ours that started workers
# their worker processes, kept apart: an iterator whose start failed, or one dropped while a
# worker was stuck (torch's SIGTERM, ignored, was its last word), leaves workers behind it;
# multiprocessing keeps a Process until it is joined, so the weak reference holds while it runs
_WORKERS: weakref.WeakSet = weakref.WeakSet()


def _forget_workers() -> None:
    """In a forked child: the workers are its parent's, not its own to stop at its exit."""
    _WITH_WORKERS.clear()
    _WORKERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


SHUTDOWN_S = 15.0  # torch's shutdown waits 5 s a worker that does not stop


@atexit.register
def _stop_workers_at_exit() -> None:
    """The workers of every iterator still alive at exit stopped (the module's docstring says
    why): torch's own shutdown, in a thread given SHUTDOWN_S (parts of it join without a time
    limit), then SIGKILL for any worker still alive; nothing of theirs is waited for after."""
    iterators, workers = list(_WITH_WORKERS), list(_WORKERS)
    if not iterators and not workers:
        return

    def shut_down() -> None:
        for iterator in iterators:
            with contextlib.suppress(Exception):
                iterator._shutdown_workers()

    stopping = threading.Thread(target=shut_down, name="loader-workers-exit", daemon=True)
    stopping.start()
    stopping.join(SHUTDOWN_S)
    for worker in workers:  # every iterator's workers are among them
        with contextlib.suppress(Exception):
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
    for iterator in iterators:
        queues = [*getattr(iterator, "_index_queues", ()),
                  getattr(iterator, "_worker_result_queue", None)]
        for queue in queues:  # their feeder threads would wait on pipes no one reads now
            with contextlib.suppress(Exception):
                queue.cancel_join_thread()
