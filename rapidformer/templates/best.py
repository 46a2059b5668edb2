"""The best evaluation (trainer.best_metric) and early stopping (trainer.early_stopping_patience).

After every evaluation the metric is compared with the best so far. The record of that
comparison (`BestRecord`) travels in two places: the checkpoint's train state (`state.best`),
so a resumed run keeps it, and the marker `checkpoints/best.json`, which names the checkpoint
that pruning keeps and the export reads. The marker is rewritten after every evaluation; the
train state only when a checkpoint is written, so the marker can know of evaluations the
checkpoint does not (the final evaluation runs after the last checkpoint).
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

from rapidformer.checkpoint import store
from rapidformer.checkpoint.early_stop import inferred_mode
from rapidformer.errors import ConfigError

log = logging.getLogger("rapidformer")

@dataclass
class BestRecord:
    metric: str
    mode: str
    step: int | None = None        # the best evaluation's step: its checkpoint is kept
    value: float | None = None
    evaluated_at: int = -1         # the last evaluation compared
    evaluations_without_improvement: int = 0  # in a row, for early stopping


class BestTracker:
    """The comparison for one run. `record` is None without trainer.best_metric."""

    def __init__(self, trainer_cfg, checkpoint_root, is_main_process: bool):
        self.t, self.root, self.is_main = trainer_cfg, checkpoint_root, is_main_process
        self.record: BestRecord | None = None
        self.metric = trainer_cfg.best_metric
        if self.metric:
            self.mode = inferred_mode(self.metric, trainer_cfg.best_mode)
            self.record = BestRecord(self.metric, self.mode)

    def resume(self, saved: dict | None, step: int) -> None:
        """Continue the record of a resumed checkpoint at `step` (its train state's `saved`),
        or the marker's when the marker knows of later evaluations up to `step`. A record of
        another metric or mode starts afresh: its best is not comparable."""
        if self.record is None:
            return
        marker = store.read_best(self.root)
        candidates = [r for r in (saved, marker) if r and r.get("evaluated_at", -1) <= step
                      and (r.get("metric"), r.get("mode")) == (self.metric, self.mode)]
        if not candidates:
            if saved or marker:
                log.info("trainer.best_metric=%s (%s): the earlier best was of another metric "
                         "or mode, or of evaluations after step %d; the best starts afresh",
                         self.metric, self.mode, step)
            return
        newest = max(candidates, key=lambda r: r.get("evaluated_at", -1))
        self.record = BestRecord(**{k: newest[k] for k in BestRecord.__dataclass_fields__
                                    if k in newest})
        if self.record.step is not None:
            log.info("the best so far: %s=%.4f at step %d", self.metric, self.record.value,
                     self.record.step)

    def judge(self, step: int, metrics: dict) -> BestRecord:
        """The record after the evaluation at `step` (not yet committed): a new best when it
        beats the best so far; early stopping counts it as an improvement only when it beats
        it by more than trainer.early_stopping_min_delta."""
        if self.metric not in metrics:
            available = ", ".join(sorted(metrics)) or "none (no validation data was evaluated)"
            raise ConfigError([f"trainer.best_metric={self.metric}: the evaluation at step "
                               f"{step} produced no such metric; it produced: {available}. "
                               f"Set trainer.best_metric to one of them"])
        value, r = float(metrics[self.metric]), self.record
        new = BestRecord(**asdict(r))
        new.evaluated_at = step
        if math.isnan(value):  # never the best, and never an improvement
            new.evaluations_without_improvement += 1
            return new
        if r.value is None or self._beats(value, r.value, 0.0):
            new.step, new.value = step, value
        enough = r.value is None or self._beats(value, r.value, self.t.early_stopping_min_delta)
        new.evaluations_without_improvement = 0 if enough else \
            r.evaluations_without_improvement + 1
        return new

    def _beats(self, value: float, best: float, delta: float) -> bool:
        return value > best + delta if self.mode == "max" else value < best - delta

    def commit(self, record: BestRecord) -> None:
        """Take `record`; rank 0 rewrites the marker (the best checkpoint exists by now) and
        prunes what the old marker kept."""
        self.record = record
        if self.is_main and record.step is not None:
            store.write_best(self.root, asdict(record))
            store.prune(self.root, self.t.keep_last)

    @property
    def patience_over(self) -> bool:
        patience = self.t.early_stopping_patience
        return bool(self.record and patience
                    and self.record.evaluations_without_improvement >= patience)

    def checkpoint_of_best(self):
        """The best checkpoint's directory, or None (no best_metric, no evaluation yet)."""
        if self.record is None or self.record.step is None:
            return None
        return self.root / f"step_{self.record.step:08d}"
