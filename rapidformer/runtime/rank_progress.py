"""Which rank stopped making progress, when a job dies of a collective timeout.

A rank that hangs (a deadlock in user code, a stuck file system, a GPU that stopped answering)
is not the one that fails: its peers wait for it in a collective until
launcher.collective_timeout passes, and the first of them to give up is the failure the
launcher sees. So each rank counts its forward passes in a tiny file of its own
(RUN_DIR/logs/progress/rank_N: 16 bytes rewritten in place, no rename, no fsync: a few
microseconds per micro-batch), and the launcher names the ranks that are behind.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

_RECORD = struct.Struct("<qd")  # forward passes done, wall time of the last one


def progress_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "logs" / "progress"


class RankProgress:
    """A rank's forward-pass counter (`tick()` after each forward)."""

    def __init__(self, run_dir: Path, rank: int, enabled: bool = True):
        self.count = 0
        self._fd = None
        if enabled:
            path = progress_dir(run_dir) / f"rank_{rank}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(path.name + ".timed_out").unlink(missing_ok=True)  # an earlier attempt's
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write()

    def _write(self) -> None:
        os.pwrite(self._fd, _RECORD.pack(self.count, time.time()), 0)

    def tick(self) -> None:
        self.count += 1
        if self._fd is not None:
            self._write()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_progress(run_dir: Path) -> dict[int, tuple[int, float]]:
    """rank -> (forward passes, time of the last one) for the ranks of this node."""
    found = {}
    for path in progress_dir(run_dir).glob("rank_*"):
        if not path.name[5:].isdigit():
            continue
        data = path.read_bytes()
        if len(data) >= _RECORD.size:
            found[int(path.name.split("_")[1])] = _RECORD.unpack(data[:_RECORD.size])
    return found


def mark_timed_out(run_dir: Path, rank: int) -> None:
    """This rank gave up waiting in a collective (launcher.collective_timeout)."""
    _mark(run_dir, rank, "timed_out", time.time())


def _mark(run_dir: Path, rank: int, suffix: str, value) -> None:
    path = progress_dir(run_dir) / f"rank_{rank}.{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


def mark_failed(run_dir: Path, rank: int, exit_code: int = 1) -> None:
    """The moment this rank's Python code failed, in nanoseconds, and the exit code it chose:
    torch elastic stamps a failure to the second, and a peer that errors out of a collective
    because this rank exited fails within that second too; the earlier mark is the cause. The
    code is what the job exits with even if the interpreter's teardown then ends the process
    by a signal (a collective library's thread has aborted exiting workers)."""
    _mark(run_dir, rank, "failed_at", f"{time.time_ns()} {exit_code}")


def clear_failed(run_dir: Path, rank: int) -> None:
    """At a worker's start: an earlier attempt's mark must not name this one's cause."""
    (progress_dir(run_dir) / f"rank_{rank}.failed_at").unlink(missing_ok=True)


def failure_marks(run_dir: Path, since_ns: int = 0) -> dict[int, tuple[int, int]]:
    """rank -> (the nanosecond its code failed, the exit code it chose), for the ranks of this
    node that marked it at `since_ns` or later (a worker killed before it could clear an
    earlier attempt's mark leaves that mark behind)."""
    found = {}
    for path in progress_dir(run_dir).glob("rank_*.failed_at"):
        fields = path.read_text().split()
        try:
            at, code = int(fields[0]), int(fields[1]) if len(fields) > 1 else 1
        except (ValueError, IndexError):  # a mark torn by a kill mid-write: no time to go by
            continue
        if at >= since_ns:
            found[int(path.name[5:].split(".")[0])] = (at, code)
    return found


def failure_times(run_dir: Path, since_ns: int = 0) -> dict[int, int]:
    """rank -> the nanosecond its code failed (failure_marks without the codes)."""
    return {rank: at for rank, (at, _) in failure_marks(run_dir, since_ns).items()}


def describe_laggards(run_dir: Path) -> str:
    """One sentence naming the ranks that hung or died first, or '' when it cannot tell.

    The ranks that waited in a collective until the timeout say so (`mark_timed_out`); the
    ranks that did not are the suspects. Without such a mark, ranks whose forward passes fell
    behind the others' are.
    """
    progress = read_progress(run_dir)
    if len(progress) < 2:
        return ""
    waited = sorted(int(p.name.split("_")[1].split(".")[0])
                    for p in progress_dir(run_dir).glob("rank_*.timed_out"))
    now = time.time()

    def where(rank: int) -> str:
        count, at = progress[rank]
        return f"rank {rank} (at forward pass {count}, its last {now - at:.0f} s ago)"

    if waited:
        suspects = sorted(set(progress) - set(waited))
        if not suspects:
            return ""
        return (f"{_ranks(waited)} gave up waiting in a collective; "
                f"{', '.join(where(r) for r in suspects)} did not: "
                f"{'it' if len(suspects) == 1 else 'they'} hung or died first")
    ahead = max(count for count, _ in progress.values())
    behind = sorted(rank for rank, (count, _) in progress.items() if count < ahead)
    if not behind:
        return ""
    return (f"{', '.join(where(r) for r in behind)} fell behind the others (forward pass "
            f"{ahead}): {'it' if len(behind) == 1 else 'they'} hung or died first")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
