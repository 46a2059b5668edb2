"""Preemption: SIGTERM or SIGINT stop a run at the next step boundary, with a checkpoint.

Schedulers (Slurm, Kubernetes) send SIGTERM before they kill; Ctrl-C sends SIGINT. The first
signal sets a flag; the training loop checks it after every optimizer step, all ranks agree on
it (one tiny all-reduce, so no rank starts a step that another will not), the checkpoint is
written as any other, and the run exits with code 75 (`EXIT_PREEMPTED`): "temporary failure,
resume me" — `trainer.resume=auto` continues from it. A second signal exits at once (code
128 + signal). A terminal's Ctrl-C reaches the launcher and the workers together and the
launcher then forwards its own signal to the workers: signals within `SAME_EVENT_S` of the
first count as that one request.

Under the launcher, torch.distributed.elastic gives workers 30 s after forwarding the signal
before it kills them: checkpoints that take longer need `trainer.save_interval` instead.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

log = logging.getLogger("rapidformer")

SAME_EVENT_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self):
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
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

    def requested(self, world_size: int, device: torch.device) -> bool:
        """Whether any rank received a stop signal (a collective when there are several)."""
        flag = self.signum is not None
        if world_size > 1:
            import torch.distributed as dist

            votes = torch.tensor([int(flag)], device=device)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
            flag = bool(votes.item())
            if flag and self.signum is None:
                self.signum = signal.SIGTERM  # another rank's signal: stop with it
        return flag

    def message(self, step: int, root) -> str:
        from rapidformer.checkpoint import scan

        complete, _ = scan(root)
        newest = complete[-1].name if complete else None
        if newest == f"step_{step:08d}":
            where = f"checkpoint {newest} written"
        else:  # the step's loss was not finite, so it was not saved
            where = (f"no checkpoint at this step; the newest complete one is {newest}"
                     if newest else "no checkpoint was written")
        return (f"stopped by {self.name} at step {step}: {where}; run the same command with "
                f"trainer.resume=auto to continue (exit code 75)")
