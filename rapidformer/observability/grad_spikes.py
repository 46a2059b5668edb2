"""Gradient-norm spikes: the early sign of a run about to diverge (a bad batch, an lr too high
for this point of the schedule), worth a line in the log long before the loss turns NaN.

Checked once per log line, on the largest norm of the window's steps (kept on the device, so
no host sync per step), against the median of the previous windows' largest norms.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque

log = logging.getLogger("rapidformer")


class GradNormSpikes:
    """`check(step, window_max)` is True, and logs a warning, when `window_max` is at least
    `factor` times the median of the last `history` windows' (once `warmup` windows are seen).
    A spike joins the history too, so a new, steadily higher level stops being reported."""

    def __init__(self, factor: float | None, history: int = 50, warmup: int = 5):
        self.factor, self.warmup = factor, warmup
        self.recent: deque[float] = deque(maxlen=history)
        self.count = 0

    def check(self, step: int, window_max: float) -> bool:
        if self.factor is None or not math.isfinite(window_max):
            return False
        spike = False
        if len(self.recent) >= self.warmup:
            median = statistics.median(self.recent)
            if median > 0 and window_max >= self.factor * median:
                spike = True
                self.count += 1
                log.warning("gradient-norm spike by step %d: %.4g, %.1fx the median of the last "
                            "%d log windows (%.4g); spike %d of this run. Frequent spikes precede "
                            "divergence: consider a lower trainer.lr or trainer.clip_grad",
                            step, window_max, window_max / median, len(self.recent), median,
                            self.count)
        self.recent.append(window_max)
        return spike
