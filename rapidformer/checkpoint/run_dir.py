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

from rapidformer.checkpoint.run_start import STASH, stash, unstash
from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
RUN_MARKER = ".rapidformer-run"
MARKER_FORMAT = 1
LOCK = ".lock"
# what a run writes (and trainer.overwrite=true removes); config.yaml and .hydra/ are
# rewritten at every start anyway. checkpoints/ is emptied of what store.py writes only.
RUN_OUTPUTS = ("metrics.jsonl", "metrics.csv", "tensorboard", "hf_model", ".tmp-hf_model",
               "status.json", "tokenizer", "logs", "data_index_cache", "generations.jsonl",
               "peft_base", ".tmp-peft_base", "tuning.json")
IGNORED = {".gitkeep", ".gitignore", ".DS_Store"}  # what an empty directory may hold
STATUS_FILE = "status.json"

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


def hydra_job_entries(hydra_job: str | None) -> frozenset[str]:
    """What a directory Hydra made for a job holds before the job runs (`.hydra/`, the job's
    log) and what rapidformer wrote there when an earlier attempt was refused (status.json)."""
    return frozenset({".hydra", f"{hydra_job}.log", STATUS_FILE}) if hydra_job else frozenset()


@contextlib.contextmanager
def claimed(run_dir: str | os.PathLike, resume: str | None, overwrite: bool, held: bool = True,
            hydra_job: str | None = None, setting: str = "trainer.output_dir"):
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
    fd = _claim(path, run_dir, resume, overwrite, hydra_job_entries(hydra_job), setting)
    key = str(path.resolve())
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # releases the lock


def claim_problems(run_dir, resume: str | None, overwrite: bool,
                   expected: frozenset[str] = frozenset(),
                   setting: str = "trainer.output_dir") -> list[str]:
    """Why a run cannot take `run_dir`, read-only and without the lock (the refusal pass asks
    it before anything is written; `claimed` asks it again under the lock)."""
    path = Path(run_dir).absolute()
    if not path.is_dir():
        return []
    # the lock is the claim's own (a claim refused under it leaves it behind), when it is one:
    # a file of that name holding anything else, a link or a directory is the user's
    foreign = sorted(p.name for p in path.iterdir()
                     if p.name not in IGNORED | expected | {LOCK} or
                     (p.name == LOCK and not _is_our_lock(p)))
    if foreign and not is_run_directory(path):
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        return [f"{setting}={run_dir} holds files that no rapidformer run wrote "
                f"({shown}); a run would overwrite them: choose a new or empty directory"]
    if not resume and not overwrite and _holds_a_run(path):
        return [f"{setting}={run_dir} holds an earlier run (its checkpoints or "
                f"metrics); add trainer.resume=auto to continue it, trainer.overwrite=true to "
                f"discard it and start fresh there, or choose a new trainer.output_dir"]
    return []


# what a rapidformer sweep writes at the top of its directory (Hydra's record, the summary)
SWEEP_FILES = {"multirun.yaml", "summary.md", "summary.json", "plots",
               "optimization_results.yaml"}


def sweep_problems(sweep_dir, hydra_job: str) -> list[str]:
    """Why a sweep cannot write into `sweep_dir` (hydra.sweep.dir), asked before Hydra writes
    its multirun.yaml there and a job's `.hydra/` into each job's directory: a folder holding
    anything but a sweep's own files and job directories that a run could take (another
    Hydra application's sweep, a project folder)."""
    path = Path(sweep_dir).absolute()
    if not path.is_dir():
        return []
    expected = hydra_job_entries(hydra_job)
    foreign = []
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        if entry.name in IGNORED | SWEEP_FILES:
            continue
        if entry.is_dir() and not entry.is_symlink() and entry.name.isdigit() and \
                not claim_problems(entry, "auto", False, expected):
            continue  # a job's directory: a run's, or what Hydra or a refused job left
        foreign.append(entry.name)
    if not foreign:
        return []
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    return [f"hydra.sweep.dir={sweep_dir} holds files that no rapidformer sweep wrote "
            f"({shown}); the sweep would overwrite its multirun.yaml and its jobs' .hydra/: "
            f"choose a new or empty hydra.sweep.dir"]


def _is_our_lock(lock: Path) -> bool:
    """`.lock` as a claim leaves it: a regular file (not a link), empty or holding the
    holder's record (_record_holder)."""
    try:
        if lock.is_symlink() or not lock.is_file():
            return False
        text = lock.read_text(encoding="utf-8")
        return not text.strip() or set(json.loads(text)) == {"pid", "host", "started"}
    except (OSError, ValueError, TypeError, UnicodeDecodeError):
        return False


def _holds_a_run(path: Path) -> bool:
    checkpoints = path / "checkpoints"
    return (checkpoints.is_dir() and any(checkpoints.iterdir())) or \
        (path / "metrics.jsonl").is_file()


def _claim(path: Path, run_dir, resume: str | None, overwrite: bool,
           expected: frozenset[str], setting: str = "trainer.output_dir") -> int:
    if problems := claim_problems(run_dir, resume, overwrite, expected, setting):
        raise InputError(problems[0])
    if path.is_symlink() and not path.exists():
        raise InputError(f"{setting}={run_dir} is a symbolic link that leads nowhere "
                         f"({os.readlink(path)}); make the folder it names, remove the link, or "
                         f"choose another {setting}")
    if (path / LOCK).is_symlink():
        raise InputError(f"{path / LOCK} is a symbolic link, not the lock file a run holds: "
                         f"a run would write into what it points to; remove the link, or "
                         f"choose another trainer.output_dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # never through a link: the file it names is not the run's
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise InputError(f"{setting}={run_dir} cannot be written: "
                         f"{exc.strerror or exc}; choose a writable directory") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise InputError(f"{setting}={run_dir} is in use by another run ({holder}); "
                         f"wait for it to end, stop it, or choose another "
                         f"trainer.output_dir") from None
    try:
        if (path / STASH).is_dir() and not overwrite:
            # a trainer.overwrite=true run stopped before it trained (a kill, Ctrl-C) left the
            # earlier run aside: a resume would find no checkpoint, start fresh, and drop it
            unstash(path)
            log.warning("put back in %s the earlier run's outputs that a trainer.overwrite=true "
                        "run had moved aside (%s) and was stopped before it trained", path, STASH)
        # checked again under the lock: another run may have written here meanwhile
        if problems := claim_problems(run_dir, resume, overwrite, expected, setting):
            raise InputError(problems[0])
        if overwrite and not resume and _holds_a_run(path):
            moved = _stash_outputs(path)
            log.warning("trainer.overwrite=true: the earlier run's %s moved aside in %s, deleted "
                        "once this run has trained (put back if it is refused before)",
                        ", ".join(moved) or "outputs", path / STASH)
    except BaseException:
        os.close(fd)  # releases the lock
        raise
    _record_holder(fd)
    _write_marker(path)
    return fd


def _stash_outputs(path: Path) -> list[str]:
    """What rapidformer wrote into a run directory, moved aside (run_start.py): its outputs,
    and its checkpoints (step directories, interrupted saves and the best marker); anything
    else there stays. A link moves as a link: what it points to is not the run's."""
    from rapidformer.checkpoint import store

    shutil.rmtree(path / STASH, ignore_errors=True)  # a killed overwrite's: ours to delete
    moved = []
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        for entry in checkpoints.iterdir():
            if store.NAME.match(entry.name) or store.SET_ASIDE.match(entry.name) or \
                    entry.name.startswith(".tmp-") or entry.name == store.BEST:
                stash(path, entry)
        moved.append("checkpoints")
    for name in RUN_OUTPUTS:
        if (path / name).is_symlink() or (path / name).exists():
            stash(path, path / name)
            moved.append(name)
    return moved


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
