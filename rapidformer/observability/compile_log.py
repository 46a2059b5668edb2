"""What graph=compile is doing while the first steps seem to hang: a line before the first
compiled step and one after it with its seconds, the same for the first evaluation (eval mode
without gradients is compiled on its own), and at the end how many graphs were compiled after
those two (recompiles: new shapes or guards; TORCH_LOGS=recompiles says why).

The lines come from hooks on the outermost module, which run outside the compiled region; the
graph count is torch._dynamo's own counter of compiled frames, read as a difference because
it counts for the whole process.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("rapidformer")


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _guard_failure_counts() -> dict:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


class CompileLog:
    """Attach with `CompileLog.attach(model, enabled)`; the loop calls `step_done()` after each
    step and `finish()` at the run's end, `detach()` when it leaves."""

    def __init__(self, model: torch.nn.Module | None):
        self.model = model
        self.handles: list = []
        self.started = None  # perf_counter of the phase being compiled
        self.phase = None  # "first step" or "first evaluation", while it runs
        self.seen: set[str] = set()
        self.frames_before = compiled_frames() if model is not None else 0
        self.phase_frames = 0  # the count when the phase began
        self.warmup_frames = 0  # compiled by the first step and the first evaluation
        self.failures_before = _guard_failure_counts()
        self.expected = None  # recompiles the batch shapes explain (set by attach)

    @classmethod
    def attach(cls, model, enabled: bool, expected: int | None = None) -> CompileLog:
        if not enabled or not isinstance(model, torch.nn.Module):
            return cls(None)
        self = cls(model)
        self.expected = expected
        self.handles = [model.register_forward_pre_hook(self._before),
                        model.register_forward_hook(self._after)]
        return self

    def _before(self, module, args) -> None:
        phase = "first step" if module.training and torch.is_grad_enabled() \
            else "first evaluation"
        if phase in self.seen:
            return
        self.seen.add(phase)
        self.phase, self.started, self.phase_frames = phase, time.perf_counter(), compiled_frames()
        log.info("graph=compile: compiling (%s)...", phase)

    def _after(self, module, args, output) -> None:
        # a training step ends after its backward and optimizer step (step_done); an
        # evaluation's compile is its first forward
        if self.phase == "first evaluation":
            self._done("first evaluation batch")

    def step_done(self) -> None:
        if self.phase == "first step":
            self._done("first step")

    def _done(self, what: str) -> None:
        log.info("graph=compile: %s compiled and ran in %.1f s", what,
                 time.perf_counter() - self.started)
        self.phase = None
        self.warmup_frames += compiled_frames() - self.phase_frames
        if len(self.seen) == 2:  # both compiled: nothing left to announce
            self.detach()

    def finish(self) -> None:
        """The run's end: the graphs compiled in all, and those after the first step's and the
        first evaluation's compiles."""
        if self.model is None:
            return
        total = compiled_frames() - self.frames_before
        recompiles = total - self.warmup_frames
        log.info("graph=compile: %d graphs compiled, %d of them after the first step and "
                 "evaluation (recompiles%s)", total, recompiles,
                 "; TORCH_LOGS=recompiles says why" if recompiles else "")
        if self.expected is not None and recompiles > self.expected:
            causes = "; ".join(f"{n} x {reason}" for reason, n in self.new_guard_failures()[:3])
            log.warning("graph=compile: %d recompiles, more than the %d the batch shapes explain "
                        "(data.pad_to): each costs a compile and, with CUDA graphs, a new "
                        "graph. The guards that failed: %s", recompiles, self.expected,
                        causes or "not recorded (TORCH_LOGS=recompiles)")

    def new_guard_failures(self) -> list[tuple[str, int]]:
        """(the failed guard, how often) since attach, most frequent first: torch._dynamo's
        record of why compiled frames were not reused."""
        from collections import Counter

        from torch._dynamo.utils import guard_failures

        counts: Counter = Counter()
        for code, reasons in guard_failures.items():
            for reason in reasons[self.failures_before.get(code, 0):]:
                # '1/0: tensor 'x' size mismatch at index 1. expected 64, actual 80  # file:line'
                first = reason.split("\n")[0].split("#")[0].strip()
                counts[f"{first} (in {code.co_name})"] += 1
        return counts.most_common()

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
