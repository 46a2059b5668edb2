"""What a run reports: the `rapidformer` logger, Megatron-style timers, and the metrics sink
(metrics.jsonl and metrics.csv always; TensorBoard events when enabled; W&B or MLflow through the logger group)."""
from __future__ import annotations

import csv
import json
import logging
import threading
import time
from pathlib import Path

from rapidformer.errors import CheckpointWriteError
from rapidformer.observability.loggers import make_loggers
from rapidformer.observability.records import drop_torn_record, scalars


def get_logger() -> logging.Logger:
    return logging.getLogger("rapidformer")


class _Timer:
    def __init__(self):
        self.elapsed = 0.0
        self._start = None

    def start(self):
        self._start = time.perf_counter()

    def stop(self):
        if self._start is not None:
            self.elapsed += time.perf_counter() - self._start
            self._start = None

    def reset(self):
        self.elapsed, self._start = 0.0, None


class Timers:
    """`timers('forward').start()` / `.stop()`; `timers.log(['forward'])` logs seconds and resets."""

    def __init__(self):
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        return self._timers.setdefault(name, _Timer())

    def log(self, names, normalizer: float = 1.0) -> str:
        parts = []
        for name in names:
            timer = self(name)
            parts.append(f"{name}: {1000 * timer.elapsed / normalizer:.2f} ms")
            timer.reset()
        line = " | ".join(parts)
        get_logger().info("time %s", line)
        return line


_TIMERS = Timers()


def get_timers() -> Timers:
    return _TIMERS


class MetricsSink:
    """Appends one json object per record to metrics.jsonl and one `step,name,value` row per
    scalar to metrics.csv, and mirrors scalars to TensorBoard and to the tracker the `logger`
    group names (W&B, MLflow). The CSV is long-form because training and evaluation records
    carry different keys: rows stay aligned across resumes and new metrics
    (`pandas.read_csv(...).pivot_table(index="step", columns="name", values="value")`)."""

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True, logger=None,
                 config: dict | None = None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._writer = None
        self._trackers: list = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            drop_torn_record(self.path)
            self._file = open(self.path, "a", encoding="utf-8")
            self.csv_path = run_dir / "metrics.csv"
            drop_torn_record(self.csv_path)
            new_csv = not self.csv_path.is_file() or self.csv_path.stat().st_size == 0
            self._csv_file = open(self.csv_path, "a", encoding="utf-8", newline="")
            self._csv = csv.writer(self._csv_file)
            if new_csv:
                self._csv.writerow(["step", "name", "value"])
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                _quiet_writer_thread_errors()
                try:
                    self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
                except OSError as exc:  # its first event is written at once
                    raise self._refused(run_dir / "tensorboard", exc) from exc
            self._trackers = make_loggers(logger, run_dir, config or {})

    def write(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        numbers = scalars(record)
        try:
            self._file.write(json.dumps({"step": step, **record}) + "\n")
            self._file.flush()
            self._csv.writerows([step, key, value] for key, value in numbers.items())
            self._csv_file.flush()
        except OSError as exc:  # a full or read-only disk: one message, not a traceback
            raise self._refused(self.path, exc) from exc
        if self._writer is not None:
            try:
                for key, value in numbers.items():
                    self._writer.add_scalar(key, value, step)
            except OSError as exc:  # raised again here from TensorBoard's writing thread
                self._writer = None  # that thread is gone: closing would wait on its queue
                raise self._refused(self.path.parent / "tensorboard", exc) from exc
        for tracker in self._trackers:
            tracker.log(step, record)

    @staticmethod
    def _refused(path: Path, exc: OSError) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"could not write {path}: {exc.strerror or exc}; the checkpoints written so far "
            f"are untouched (trainer.resume=auto resumes from the newest). Free disk space, "
            f"or choose another trainer.output_dir")

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._csv_file.close()
            if self._writer is not None:
                writer, self._writer = self._writer, None
                try:
                    writer.close()  # its last events are written now
                except OSError as exc:
                    raise self._refused(self.path.parent / "tensorboard", exc) from exc
            for tracker in self._trackers:
                tracker.close()


def _quiet_writer_thread_errors() -> None:
    """TensorBoard writes its events in a thread that, when the disk refuses a write, prints the
    error's traceback and dies; the next `add_scalar` raises the same error in the training
    thread, where it becomes the run's one message. The thread's traceback is left out."""
    hook = threading.excepthook
    if getattr(hook, "_rapidformer", False):
        return

    def excepthook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread"
                and isinstance(args.exc_value, OSError)):
            hook(args)

    excepthook._rapidformer = True
    threading.excepthook = excepthook
