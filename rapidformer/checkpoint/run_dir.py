"""A run directory belongs to one run at a time, and a fresh run never mixes with an old one.

`claimed(run_dir, resume, overwrite)` holds the directory for the block; it is entered before
anything is written into the directory (before Hydra writes `.hydra/`):

- a directory that holds files no rapidformer run wrote is refused: the run would overwrite
  them (`trainer.output_dir=.`). A run directory is recognised by `RUN_MARKER`, which
  rapidformer alone writes (a JSON record of the run directory's format; an empty file in the
  releases before it), never by what other tools also leave (Hydra's `.hydra/`): a sweep job's
  directory, which Hydra makes and writes `.hydra/` into just before the job starts, is
  claimed with those entries expected (`hydra_job`);
- a second run while one holds the directory is refused, naming the holder (pid, host, start):
  an exclusive `flock` on `RUN_DIR/.lock`, which the kernel releases when its process ends, so a
  killed run leaves no stale lock (on NFS, locks are as good as the server's lock manager);
- a fresh run (trainer.resume unset) into an earlier run's directory that has checkpoints is
  refused unless trainer.overwrite=true, which removes that run's outputs first: otherwise its
  checkpoints would be pruned by, interleaved with, or resumed instead of the new run's. Only
  what rapidformer writes goes (`RUN_OUTPUTS`; in `checkpoints/` only its step directories and
  best marker): a file of the user's in the directory stays.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
RUN_MARKER = ".rapidformer-run"
MARKER_FORMAT = 1
LOCK = ".lock"
# what a run writes (and trainer.overwrite=true removes); config.yaml and .hydra/ are
# rewritten at every start anyway. checkpoints/ is emptied of what store.py writes only.
RUN_OUTPUTS = ("metrics.jsonl", "metrics.csv", "tensorboard", "hf_model", ".tmp-hf_model",
               "status.json", "tokenizer", "logs", "data_index_cache", "generations.jsonl",
               "peft_base", ".tmp-peft_base")
IGNORED = {".gitkeep", ".gitignore", ".DS_Store"}  # what an empty directory may hold

_held: dict[str, int] = {}  # run directory -> the lock's file descriptor, for this process


def is_run_directory(path: Path) -> bool:
    """Written by a rapidformer run: its marker is there (a JSON record, or the empty file of
    the releases before it; anything else in a file of that name is not ours)."""
    marker = path / RUN_MARKER
    if not marker.is_file():
        return False
    try:
        text = marker.read_text()
        return not text.strip() or json.loads(text).get("rapidformer_run") is not None
    except (OSError, ValueError, AttributeError):
        return False


def _write_marker(path: Path) -> None:
    marker = path / RUN_MARKER
    if not marker.is_file() or not marker.read_text().strip():
        marker.write_text(json.dumps({"rapidformer_run": MARKER_FORMAT}) + "\n")


def holds_directory(launcher) -> bool:
    """Whether this process takes the run directory for its job: the first node's process, or,
    started by torchrun or srun (RANK set), global rank 0; the job's other processes share the
    directory that process holds."""
    return launcher.node_rank == 0 and os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def claimed(run_dir: str | os.PathLike, resume: str | None, overwrite: bool, held: bool = True,
            hydra_job: str | None = None):
    """Hold `run_dir` for this process's run during the block, or raise InputError saying why
    not. Re-entered for a directory this process already holds (the entry point, then the
    Hydra job inside it), it checks nothing again; with `held` false (another process of the
    job holds it, `holds_directory`) it does nothing. `hydra_job`: the name of the Hydra job
    whose directory this is, made by Hydra, which wrote `.hydra/` and the job's log there."""
    if not held:
        yield
        return
    if not str(run_dir).strip():
        raise InputError("trainer.output_dir is empty; give the directory the run writes to")
    path = Path(run_dir).absolute()
    if path.exists() and str(path.resolve()) in _held:
        yield
        return
    fd = _claim(path, run_dir, resume, overwrite,
                {".hydra", f"{hydra_job}.log"} if hydra_job else set())
    key = str(path.resolve())
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # releases the lock


def _claim(path: Path, run_dir, resume: str | None, overwrite: bool, expected: set[str]) -> int:
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if p.name not in IGNORED | expected)
        if foreign and not is_run_directory(path):
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise InputError(f"trainer.output_dir={run_dir} holds files that no rapidformer "
                             f"run wrote ({shown}); a run would overwrite them: choose a new "
                             f"or empty directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise InputError(f"trainer.output_dir={run_dir} cannot be written: "
                         f"{exc.strerror or exc}; choose a writable directory") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise InputError(f"trainer.output_dir={run_dir} is in use by another run ({holder}); "
                         f"wait for it to end, stop it, or choose another "
                         f"trainer.output_dir") from None
    try:
        _refuse_mixing(path, run_dir, resume, overwrite)
    except BaseException:
        os.close(fd)  # releases the lock
        raise
    _record_holder(fd)
    _write_marker(path)
    return fd


def _refuse_mixing(path: Path, given, resume: str | None, overwrite: bool) -> None:
    if resume:
        return
    checkpoints = path / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(checkpoints.iterdir())
    if not has_checkpoints and not (path / "metrics.jsonl").is_file():
        return
    if not overwrite:
        raise InputError(f"trainer.output_dir={given} holds an earlier run (its checkpoints or "
                         f"metrics); add trainer.resume=auto to continue it, "
                         f"trainer.overwrite=true to discard it and start fresh there, or "
                         f"choose a new trainer.output_dir")
    removed = _remove_outputs(path)
    log.warning("trainer.overwrite=true: removed the earlier run's %s from %s",
                ", ".join(removed) or "outputs", path)


def _remove_outputs(path: Path) -> list[str]:
    """What rapidformer wrote into a run directory: its outputs, and its checkpoints (step
    directories, interrupted saves and the best marker); anything else there stays."""
    from rapidformer.checkpoint import store

    removed = []
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        for entry in checkpoints.iterdir():
            if store.NAME.match(entry.name) or entry.name.startswith(".tmp-") or \
                    entry.name == store.BEST:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        with contextlib.suppress(OSError):
            checkpoints.rmdir()  # only when nothing of the user's is left in it
        removed.append("checkpoints")
    for name in RUN_OUTPUTS:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _record_holder(fd: int) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": datetime.datetime.now().isoformat(timespec="seconds")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "its pid is not recorded yet"


# what only a run that trained writes: a directory with one of them is kept whatever happens
TRAINED = ("checkpoints", "metrics.jsonl", "tensorboard", "hf_model", "wandb", "mlflow.db")


def missing_ancestors(path: str | os.PathLike) -> list[Path]:
    """`path` and its parents that do not exist yet, nearest first: what this run creates."""
    missing = []
    for folder in [Path(path).absolute(), *Path(path).absolute().parents]:
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_if_unstarted(created: list[Path]) -> bool:
    """After a run refused before training (bad input, a missing model or dataset): remove
    the directories it created (`missing_ancestors`, taken before; so everything in them is
    this run's) unless it trained (`TRAINED`), so that a refused command leaves the disk as it
    was. The message the user needs was printed already."""
    if not created or not created[0].is_dir():
        return False
    run_dir = created[0]
    if any((run_dir / name).exists() for name in TRAINED):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in created[1:]:
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when empty: a sibling run may have appeared meanwhile
    return True
