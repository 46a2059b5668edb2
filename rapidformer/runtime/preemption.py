"""Preemption: SIGTERM or SIGINT stop a run at the next step boundary, with a checkpoint.

Schedulers (Slurm, Kubernetes) send SIGTERM before they kill; Ctrl-C sends SIGINT. The first
signal sets a flag; the training loop checks it after every optimizer step, all ranks agree on
it (one tiny all-reduce on the CPU over a gloo group, so no rank starts a step that another will
not, and the GPU stream is never waited on), the checkpoint is
written as any other, and the run exits with code 75 (`EXIT_PREEMPTED`): "temporary failure,
resume me" — `trainer.resume=auto` continues from it. A second signal exits at once (code
128 + signal). A terminal's Ctrl-C reaches the launcher and the workers together and the
launcher then forwards its own signal to the workers: signals within `SAME_EVENT_S` of the
first count as that one request.

Under the launcher (runtime/launch.py) the launcher passes its signal on to every worker and
waits for them to write the checkpoint and exit, however long that takes; a second signal more
than `SAME_EVENT_S` after the first stops them at once. DataLoader workers ignore both signals
(runtime/loader_workers.py): a process-group kill must not take them down under the process
that trains.

The stop message names the run directory to resume: with the default, timestamped
trainer.output_dir, the same command again would start a fresh run in a new directory.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
import time
from pathlib import Path

import torch

from rapidformer.errors import EXIT_PREEMPTED, Preempted

log = logging.getLogger("rapidformer")

SAME_EVENT_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self):
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}
        self._group = None

    def install(self, world_size: int = 1) -> StopSignals:
        """Every rank calls it at the same point (with several, it creates a process group)."""
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if world_size > 1:
            import torch.distributed as dist

            # CPU votes: with NCCL the default group would make every step wait for the GPU
            self._group = dist.new_group(backend="gloo")
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first = signum, now
            log.warning("received %s: finishing this step, writing a checkpoint, then stopping "
                        "(send it again to stop at once, without a checkpoint)", self.name)
        elif now - self._first > SAME_EVENT_S:
            os._exit(128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def requested(self) -> bool:
        """Whether any rank received a stop signal (a collective when there are several)."""
        flag = self.signum is not None
        if self._group is not None:
            import torch.distributed as dist

            votes = torch.tensor([int(flag)])
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self._group)
            flag = bool(votes.item())
            if flag and self.signum is None:
                self.signum = signal.SIGTERM  # another rank's signal: stop with it
        return flag

    def error(self, step: int, root: Path) -> Preempted:
        """The run's stop after step `step`; `root` is its checkpoint directory
        (RUN_DIR/checkpoints)."""
        newest = newest_checkpoint(root)
        if newest == f"step_{step:08d}":
            where = f"checkpoint {newest} written"
        else:  # the step's loss was not finite, so it was not saved
            where = (f"no checkpoint at this step; the newest complete one is {newest}"
                     if newest else "no checkpoint was written")
        return preempted(f"{self.name} at step {step}", where, Path(root).parent)


def newest_checkpoint(root: Path) -> str | None:
    """The name of the newest complete checkpoint under `root`, the run's resume point."""
    from rapidformer.checkpoint.store import newest_complete

    newest = newest_complete(root)
    return newest.name if newest else None


def resume_advice(run_dir: Path) -> str:
    """The overrides that continue the run in `run_dir`, quoted for a shell where needed."""
    from rapidformer.config.compose import override

    return (f"{shlex.quote(override('trainer.output_dir', Path(run_dir).absolute()))} "
            f"trainer.resume=auto")


def preempted(cause: str, where: str, run_dir: Path,
              exit_code: int = EXIT_PREEMPTED) -> Preempted:
    error = Preempted(f"stopped by {cause}: {where}; to continue, add {resume_advice(run_dir)} "
                      f"to the same command (exit code {exit_code})")
    error.exit_code = exit_code
    return error
