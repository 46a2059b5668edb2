"""One candidate measured in a child process: the real CLI for a few steps on the run's data.

The child is `python -m rapidformer.tuning.child OVERRIDES...` (the CLI's own entry, below a
documented test hook) with the run's overrides, the candidate's, and those that make it a
short measurement: trainer.train_iters=N, a step per log line, a fresh temporary run
directory, no checkpoint, no export. It runs in its own process group under a wall-clock
limit: an out-of-memory error, a crash or a hang ends that child alone (the group is killed).
What it measured is read back from its metrics.jsonl: each step's loss, real (non-pad)
tokens/s and window time (`window_s`), the CUDA peak where there is one (else the child's
peak resident memory, from the kernel's accounting of that process). The rate is the median
of the steps' rates after the warm-up, with their spread (summarize).
"""
from __future__ import annotations

import math
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rapidformer.errors import EXIT_DIVERGED, EXIT_OUT_OF_MEMORY
from rapidformer.observability.records import read_metrics
from rapidformer.tuning.space import Candidate, PackedRows

# settings of the run that a measurement replaces (its own directory, length, records)
MEASUREMENT_KEYS = ("trainer.train_iters", "trainer.epochs", "trainer.log_interval",
                    "trainer.output_dir", "trainer.save_last", "trainer.export_hf",
                    "trainer.progress_bar", "trainer.tensorboard", "trainer.resume",
                    "trainer.overwrite", "trainer.save_interval", "trainer.exit_interval",
                    "trainer.eval_interval", "trainer.profile_steps", "trainer.dry_run",
                    "trainer.early_stopping_patience", "trainer.best_metric")
NONFINITE = "the loss was NaN or infinite"  # templates/loop.py's stop
TRAINED_ALL = "its steps were trained"
# torch's words for a device out of memory, and the run's own message (errors.out_of_memory);
# a line that only mentions memory (the run's start warning of the plan) is not one
OOM = re.compile(r"(CUDA|HIP|MPS|XPU)( backend)? out of memory|OutOfMemoryError|"
                 r"out of GPU memory")


@dataclass
class Measurement:
    candidate: Candidate
    status: str  # ok, crashed, out_of_memory, timeout
    wall_s: float  # the child process, start to end
    losses: list[float] = field(default_factory=list)
    warmup_s: float = 0.0  # the warm-up steps' windows (compile, graph capture)
    # the child's time outside its steps: start-up, the final evaluation and test with their
    # own compilation (a compiled candidate compiles its evaluation too), paid by the run
    fixed_s: float = 0.0
    tokens_per_s: float | None = None  # real tokens per second after the warm-up (median)
    # the spread of the steps' rates after the warm-up: their median absolute deviation, as a
    # share of the median (pick.choose asks a candidate to gain more than it)
    rate_spread: float = 0.0
    tokens_per_step: float | None = None  # real tokens per optimizer step after the warm-up
    peak_mem_gb: float | None = None
    steps_per_epoch: int | None = None
    # what data.packing=true would make of the training data (an unpacked SFT run logs it)
    packed_rows: PackedRows | None = None
    # the validation loss of the evaluation at the child's end (None: no validation split):
    # the loss check of a candidate whose steps train other examples (packing)
    held_out_loss: float | None = None
    reason: str = ""

    def as_dict(self) -> dict:
        return {"label": self.candidate.label, "overrides": self.candidate.override_list(),
                "status": self.status, "wall_s": round(self.wall_s, 3),
                "losses": self.losses, "warmup_s": round(self.warmup_s, 3),
                "fixed_s": round(self.fixed_s, 3),
                "tokens_per_s": self.tokens_per_s, "rate_spread": round(self.rate_spread, 4),
                "tokens_per_step": self.tokens_per_step,
                "peak_mem_gb": self.peak_mem_gb, "held_out_loss": self.held_out_loss,
                "packed_rows": None if self.packed_rows is None else {
                    "examples": self.packed_rows.examples, "rows": self.packed_rows.rows},
                "reason": self.reason}


def child_overrides(run_overrides: list[str], candidate: Candidate, steps: int,
                    output_dir: str) -> list[str]:
    """The child's command line: the run's overrides less those a measurement replaces (and
    accelerate's own, Hydra's run directory), the candidate's, the measurement's."""
    from rapidformer.config.compose import override_key
    from rapidformer.tuning.space import kept_overrides

    # the run's logger goes too: a measurement is no run of the user's MLflow experiment or
    # W&B project (the default logger writes into the child's own folder only)
    dropped = (*MEASUREMENT_KEYS, "accelerate", "logger", "hydra.run.dir", "hydra.job.name")
    kept = [o for o in kept_overrides(run_overrides, candidate.override_list())
            if not (override_key(o).lstrip("+~") in dropped
                    or override_key(o).lstrip("+~").startswith(("accelerate.", "logger.")))]
    quoted = output_dir.replace("\\", "\\\\").replace("'", "\\'")
    return [*kept, *candidate.override_list(), "accelerate=none", "logger=tensorboard",
            f"trainer.train_iters={steps}", "trainer.log_interval=1",
            f"trainer.output_dir='{quoted}'", "trainer.save_last=false",
            "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.resume=null", "trainer.save_interval=null", "trainer.exit_interval=null",
            "trainer.profile_steps=null", "trainer.early_stopping_patience=null",
            "trainer.best_metric=null"]


class Stopped(BaseException):
    """A stop signal (search.STOP_SIGNALS) during the search, raised where it is safe: from the
    wait on a child (whose group is then killed) or between measurements. A BaseException, so
    that no `except Exception` on the search's path takes it for a candidate's failure."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# the stop signal received during the search (tuning/search.py's handler only records it:
# raised from a signal handler, it could land inside Popen, with the child started and not
# yet ours to kill)
signalled: list[int] = []


def check_stop() -> None:
    if signalled:
        raise Stopped(signalled[0])


def _wait(pid: int, limit: float) -> tuple[int | None, int]:
    """(exit status or None when past `limit` seconds, peak resident KiB of the child);
    Stopped when a stop signal came meanwhile."""
    deadline = time.monotonic() + limit
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_maxrss
        check_stop()
        if time.monotonic() > deadline:
            return None, 0
        time.sleep(0.05)


def run_child(overrides: list[str], label: str, limit: float, log_path: Path
              ) -> tuple[int | None, float, int]:
    """(exit code or None on timeout, wall seconds, peak resident KiB) of one child."""
    import subprocess

    env = {**os.environ, "RAPIDFORMER_TUNING_CANDIDATE": label,
           "RAPIDFORMER_TUNING_PARENT": str(os.getpid())}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rapidformer.tuning.child", *overrides],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own group: killed whole
        try:
            code, rss = _wait(proc.pid, limit)
        finally:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if code is None:
            os.waitpid(proc.pid, 0)
        proc.returncode = code if code is not None else -9  # reaped here, not by Popen
    return code, time.monotonic() - started, rss


def training_steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r and "window_s" in r]


def held_out_loss(records: list[dict]) -> float | None:
    """The last evaluation's validation loss in the child's metrics, if it has one."""
    found = [r["validation/loss"] for r in records
             if isinstance(r.get("validation/loss"), (int, float))]
    return float(found[-1]) if found else None


STEPS_PER_EPOCH = re.compile(r"training \d+ iterations \((\d+) per epoch")
# data/chat.py PACKING_HINT
PACKING_HINT = re.compile(r"data\.packing=true would lay the (\d+) training examples in (\d+) "
                          r"rows")


def summarize(candidate: Candidate, steps: list[dict], warmup: int, wall_s: float,
              rss_kib: int, log_text: str) -> Measurement:
    """A finished child's measurement: the rate over the steps after `warmup`, the median of
    the steps' rates (a step stalled by a loaded machine, a collection, a page fault moves a
    mean of a few steps by any factor; the median not), and their spread."""
    from statistics import median

    m = Measurement(candidate, "ok", wall_s, losses=[float(r["loss"]) for r in steps])
    timed = [r for r in steps[warmup:] if r["window_s"] > 0]
    m.warmup_s = sum(r["window_s"] for r in steps[:warmup])
    m.fixed_s = max(wall_s - sum(r["window_s"] for r in steps), 0.0)
    if timed:
        rates = [float(r["tokens_per_s"]) for r in timed]
        m.tokens_per_s = median(rates)
        m.tokens_per_step = sum(r["tokens_per_s"] * r["window_s"] for r in timed) / len(timed)
        if m.tokens_per_s > 0:
            m.rate_spread = median(abs(r - m.tokens_per_s) for r in rates) / m.tokens_per_s
    peaks = [r["peak_mem_gb"] for r in steps if "peak_mem_gb" in r]
    m.peak_mem_gb = round(max(peaks), 3) if peaks else round(rss_kib / 2**20, 3) or None
    if found := STEPS_PER_EPOCH.search(log_text):
        m.steps_per_epoch = int(found.group(1))
    if (found := PACKING_HINT.search(log_text)) and int(found.group(2)):
        m.packed_rows = PackedRows(int(found.group(1)), int(found.group(2)))
    return m


def measure(run_overrides: list[str], candidate: Candidate, steps: int, warmup: int,
            limit: float, work_dir: Path) -> Measurement:
    """Run `candidate` for `steps` steps in a child under `limit` seconds."""
    run_dir = Path(tempfile.mkdtemp(prefix="candidate-", dir=work_dir))
    out_dir = run_dir / "run"
    log_path = run_dir / "child.log"
    overrides = child_overrides(run_overrides, candidate, steps, str(out_dir))
    code, wall, rss = run_child(overrides, candidate.label, limit, log_path)
    text = log_path.read_text(errors="replace")
    tail = _last_error(text)
    records = read_metrics(out_dir)
    got = training_steps(records)
    if code is None:
        # where the time went: a child past its steps was evaluating (the whole validation and
        # test sets, as the run does at its end)
        where = f"{TRAINED_ALL}; the evaluation at its end ran past it" if len(got) >= steps \
            else f"after {len(got)} of {steps} steps"
        return Measurement(candidate, "timeout", wall,
                           reason=f"still running after {limit:.0f} s ({where}): stopped")
    if code != 0:
        # the run's own exit codes first: a stop for a non-finite loss is a divergence
        # whatever its log mentions
        status = "diverged" if code == EXIT_DIVERGED else \
            "out_of_memory" if code == EXIT_OUT_OF_MEMORY or OOM.search(text) else \
            "diverged" if NONFINITE in text else "crashed"
        return Measurement(candidate, status, wall, losses=[float(r["loss"]) for r in got],
                           reason=f"exit code {code}: {tail}")
    if len(got) < steps:
        return Measurement(candidate, "crashed", wall,
                           reason=f"{len(got)} of {steps} steps logged: {tail}")
    m = summarize(candidate, got[:steps], warmup, wall, rss, text)
    m.held_out_loss = held_out_loss(records)
    if not all(math.isfinite(x) for x in m.losses):
        m.reason = "a loss was not finite"
    return m


def _last_error(text: str) -> str:
    """The child's last meaningful line (its error), for the table."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("rapidformer: error") or "Error" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
