"""The errors a user can act on. Each message says what is wrong, where, and how to fix it.

`__main__` prints them without a traceback (unless RAPIDFORMER_DEBUG=1) and exits non-zero.
"""
from __future__ import annotations

import errno
import os
from typing import NamedTuple

# exit codes: 2 for bad input (config, data, paths), 3 for a feature not available here,
# 4 for a run whose loss stopped being finite, 5 for a run out of GPU memory, 74 (EX_IOERR) for
# a run that could not write its checkpoint or run directory (disk full, read-only), 75
# (EX_TEMPFAIL) for a run stopped by SIGTERM/SIGINT after writing a resumable checkpoint
EXIT_BAD_INPUT = 2
EXIT_NOT_AVAILABLE = 3
EXIT_DIVERGED = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_WRITE_FAILED = 74
EXIT_PREEMPTED = 75


class RapidformerError(Exception):
    exit_code = EXIT_BAD_INPUT


class ConfigError(RapidformerError):
    """One or more problems in the composed config, all reported at once."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = f"invalid config: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            text = f"invalid config ({len(self.problems)} problems):\n{lines}"
        super().__init__(text)


class InputError(RapidformerError):
    """Data, files or paths that cannot be used as given."""


class NotAvailableError(RapidformerError):
    """A valid setting whose feature is not built yet or not installed on this machine."""

    exit_code = EXIT_NOT_AVAILABLE


class Problem(NamedTuple):
    """One reason a run cannot start: its sentence (what, where, the fix) and the exit code it
    earns on its own (bad input, or a feature not available here)."""
    text: str
    exit_code: int = EXIT_BAD_INPUT


def caught(check, *args) -> list[Problem]:
    """The problems a raising check reports (none when it returns)."""
    try:
        check(*args)
    except ConfigError as exc:
        return [Problem(text) for text in exc.problems]
    except RapidformerError as exc:
        return [Problem(str(exc), exc.exit_code)]
    return []


def refusal(problems: list[Problem]) -> RapidformerError:
    """The one error for every problem a check found: ConfigError (exit 2) when any is bad
    input, NotAvailableError (exit 3) when all are what this machine lacks."""
    texts = list(dict.fromkeys(p.text for p in problems))
    if any(p.exit_code == EXIT_BAD_INPUT for p in problems):
        return ConfigError(texts)
    if len(texts) == 1:
        return NotAvailableError(texts[0])
    lines = "\n".join(f"  - {t}" for t in texts)
    return NotAvailableError(f"not available here ({len(texts)} problems):\n{lines}")


def debug_enabled() -> bool:
    return os.environ.get("RAPIDFORMER_DEBUG", "") not in ("", "0", "false", "False")


class Preempted(RapidformerError):
    """Stopped by a signal at a step boundary, with a checkpoint to resume from."""

    exit_code = EXIT_PREEMPTED


class CheckpointWriteError(RapidformerError):
    """A checkpoint or a run file could not be written (no space left, read-only directory);
    the partial checkpoint is removed, the earlier ones are untouched."""

    exit_code = EXIT_WRITE_FAILED


# a write the file system refused for want of room or permission, wherever it happens (a
# metrics line, the export, generated data): one message and exit code 74, not a traceback
WRITE_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def refused_write(exc: BaseException) -> CheckpointWriteError | None:
    """The error to report for a refused write: an OSError of one, or a library's own error
    that carries the system's words (safetensors' "No space left on device"); None for any
    other error."""
    if isinstance(exc, OSError) and exc.errno in WRITE_REFUSED:
        said = f"{exc.strerror or exc}" + (f" writing {exc.filename}" if exc.filename else "")
    elif not isinstance(exc, OSError) and \
            any(os.strerror(code) in str(exc) for code in WRITE_REFUSED):
        said = str(exc).splitlines()[0]
    else:
        return None
    return CheckpointWriteError(
        f"{said}; free space (or choose a writable directory) and run "
        f"again: a run's complete checkpoints are untouched, and trainer.resume=auto continues "
        f"from the newest")


class NonFiniteLoss(RapidformerError):
    """The loss was NaN or infinite for trainer.max_nonfinite_steps steps in a row."""

    exit_code = EXIT_DIVERGED


class OutOfMemory(RapidformerError):
    """The device ran out of memory during the run (torch.OutOfMemoryError)."""

    exit_code = EXIT_OUT_OF_MEMORY


def out_of_memory(exc: BaseException) -> OutOfMemory | None:
    """The error to report for a device out of memory, with what lowers a run's memory; None
    for any other error. torch raises OutOfMemoryError (older code paths a RuntimeError that
    says "CUDA out of memory")."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if type(exc).__name__ != "OutOfMemoryError" and "CUDA out of memory" not in said:
        return None
    said = said.split(". Of the allocated", 1)[0].split(" Including non-PyTorch", 1)[0]
    return OutOfMemory(
        f"out of GPU memory ({said.rstrip('. ')}). `rapidformer plan` with the same settings "
        f"gives each memory mode's estimate for a micro batch at data.max_seq_length, the "
        f"longest a run meets; what lowers it: memory=auto (a mode the plan says fits), "
        f"trainer.checkpoint_activations=true, a smaller trainer.micro_batch_size (its "
        f"trainer.global_batch_size kept), a shorter data.max_seq_length, precision=bf16, and "
        f"for task=sft data.packing=true; accelerate=auto measures them (in evaluation: a "
        f"smaller trainer.eval_micro_batch_size, which the plan does not size). The run's "
        f"complete checkpoints are untouched: trainer.resume=auto continues from the newest")
