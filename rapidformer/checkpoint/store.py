"""Checkpoints that are either complete or ignored, and whose every byte is checked.

A checkpoint is written into a hidden temporary directory, each file flushed to disk, a
manifest (`COMPLETE.json`: step, every file with its size and sha256) written last, and only
then renamed to `step_NNNNNNNN`. The files rank 0 writes with `torch.save` are hashed while they
are written (`HashingWriter`: no second read); files a backend writes itself (DeepSpeed's and
torch.distributed.checkpoint's shards) are read once after writing, split over the ranks. A
crash mid-save leaves a `.tmp-*` directory that resume skips and reports; a directory whose
manifest is missing or disagrees with its files is never loaded: `scan` compares sizes (cheap,
for listing), `verify` every byte (before a resume loads it, and `rapidformer verify`).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from rapidformer.errors import CheckpointWriteError, InputError
from rapidformer.file_modes import honour_umask

log = logging.getLogger("rapidformer")
MANIFEST = "COMPLETE.json"
NAME = re.compile(r"^step_(\d{8})$")
# beside the step directories: which checkpoint holds the best evaluation (trainer.best_metric);
# a file, so that scanning, resuming and verifying, which look at step directories only, pass it by
BEST = "best.json"
CHUNK = 1 << 22  # bytes hashed per read


class HashingWriter(io.RawIOBase):
    """A binary file that hashes what is written through it. torch.save reports a failed write
    as `RuntimeError: ... unexpected pos`; the OSError behind it (ENOSPC, EROFS) is kept in
    `error` so that the caller can name the cause."""

    def __init__(self, file):
        super().__init__()
        self.file, self.sha256, self.error = file, hashlib.sha256(), None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha256.update(memoryview(data)[:written])
        return written


def hashed_save(obj, path: Path) -> str:
    """torch.save(obj, path), flushed to disk; the file's sha256, computed while writing."""
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        try:
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        except RuntimeError as exc:
            if writer.error is not None:
                raise writer.error from exc
            raise
    return writer.sha256.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir(root: Path, step: int) -> Path:
    """Where step `step` is written before it is sealed (every rank of a job agrees on it)."""
    return root / f".tmp-step_{step:08d}"


def files_of(directory: Path) -> list[str]:
    """Every file under `directory`, as sorted relative paths (the manifest's order)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def write_failure(root: Path, step: int, exc: BaseException) -> CheckpointWriteError:
    """The one message for a checkpoint that could not be written: why (the OSError's text, or,
    for torch's RuntimeError that hides it, what the file system says now), and the resume
    point that is left."""
    final = root / f"step_{step:08d}"
    newest = newest_complete(root)
    left = (f"the newest complete checkpoint, {newest.name}, is untouched (trainer.resume=auto "
            f"resumes from it)" if newest else "no complete checkpoint was written before")
    return CheckpointWriteError(f"could not write checkpoint {final}: {_cause(root, exc)}; the "
                                f"partial files were removed and {left}. Free disk space, or "
                                f"choose another trainer.output_dir")


# how torch's C++ file writer reports a failed write (it hides the OSError behind it)
TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def is_write_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failed write (disk full, read-only), not a bug."""
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and any(
        text in str(exc) for text in TORCH_WRITE_FAILURES))


def _cause(root: Path, exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    folder = next((p for p in (root, *root.parents) if p.exists()), root)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if free is not None and free < 64 << 20:
        return f"no space left on device ({free / 2**20:.1f} MiB free under {folder})"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable (read-only file system or permissions)"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def prepare(root: Path, step: int) -> Path:
    """An empty temporary directory for step `step`, which every rank then writes its shards
    into (rank 0 calls this, the others wait)."""
    tmp = temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise write_failure(root, step, exc) from exc
    return tmp


def save(root: Path, step: int, tensors: dict[str, object], state: dict,
         extra: Callable[[Path], None] | None = None, keep_last: int = 2,
         prepared: bool = False, manifest: dict | None = None,
         hashes: dict[str, str] | None = None) -> Path:
    """Write `tensors` (name -> object for torch.save) and `state` (json) as step `step`.

    `prepared`: the temporary directory already holds files written by every rank (sharded
    strategies' files); they are sealed together with these, `hashes` holding the sha256 of
    those that the ranks already hashed. `manifest`: what the manifest records beside the files
    (the strategy and its layout). Any failure removes the temporary directory and raises
    CheckpointWriteError.
    """
    final = root / f"step_{step:08d}"
    tmp = temp_dir(root, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not prepared:
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(exist_ok=prepared)
        known = dict(hashes or {})
        for name, obj in tensors.items():
            known[name] = hashed_save(obj, tmp / name)
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        if extra is not None:
            extra(tmp)
        honour_umask(tmp)  # what the ranks and `extra` wrote through private temp files
        files = {}
        for rel in files_of(tmp):
            path = tmp / rel
            _fsync(path)
            files[rel] = {"bytes": path.stat().st_size,
                          "sha256": known.get(rel) or file_sha256(path)}
        seal = tmp / MANIFEST
        seal.write_text(json.dumps({"step": step, **(manifest or {}), "files": files}, indent=1))
        _fsync(seal)
        _fsync(tmp)
        if final.exists():  # the same step saved again (e.g. epoch end == exit step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except (OSError, RuntimeError) as exc:
        if not is_write_failure(exc):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(root, step, exc) from exc
    prune(root, keep_last)
    return final


def read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest


def is_complete(path: Path) -> bool:
    """Sealed, with every file of its manifest present at its size (no bytes read)."""
    if not NAME.match(path.name):
        return False
    manifest = read_manifest(path)
    if manifest is None:
        return False
    return all((path / rel).is_file() and (path / rel).stat().st_size == entry["bytes"]
               for rel, entry in manifest["files"].items())


def verify(path: Path, only: list[str] | None = None) -> list[str]:
    """What is wrong with checkpoint `path`, file by file (empty: every byte matches its
    manifest). `only`: check these files of the manifest (a rank's share), not all."""
    manifest = read_manifest(path)
    if manifest is None:
        return [f"{MANIFEST} is missing or unreadable (an interrupted save)"]
    problems = []
    for rel, entry in manifest["files"].items():
        if only is not None and rel not in only:
            continue
        f = path / rel
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{rel}: {f.stat().st_size} bytes, the manifest says {entry['bytes']}")
        elif "sha256" not in entry:
            if only is None:  # written before every file was hashed: sizes are all there is
                log.info("%s: no checksum in the manifest (an older checkpoint); size checked",
                         f)
        elif file_sha256(f) != entry["sha256"]:
            problems.append(f"{rel}: its bytes changed since it was written (sha256 differs)")
    return problems


def scan(root: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints oldest first, incomplete directories), by sizes only."""
    if not root.is_dir():
        return [], []
    complete, broken = [], []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(".tmp-") or (NAME.match(path.name) and not is_complete(path)):
            broken.append(path)
        elif NAME.match(path.name):
            complete.append(path)
    return complete, broken


def newest_complete(root: Path) -> Path | None:
    complete, _ = scan(root)
    return complete[-1] if complete else None


def latest(root: Path, verify_files: Callable[[Path], list[str]] = verify) -> Path | None:
    """The newest checkpoint under `root` whose bytes all match its manifest; damaged and
    interrupted ones are reported and skipped."""
    complete, broken = scan(root)
    for path in broken:
        log.warning("ignoring incomplete checkpoint %s (a save was interrupted)", path)
    for path in reversed(complete):
        problems = verify_files(path)
        if not problems:
            return path
        log.warning("ignoring damaged checkpoint %s: %s", path, "; ".join(problems))
    return None


def require_intact(path: Path, problems: list[str], given: str) -> None:
    if problems:
        raise InputError(f"{given}: checkpoint {path} is damaged: {'; '.join(problems)}; resume "
                         f"from another checkpoint (`rapidformer verify` lists them) or start "
                         f"fresh")


def prune(root: Path, keep_last: int) -> None:
    """Remove complete checkpoints beyond the newest `keep_last`, except the one the best
    marker names, and what interrupted saves left (called right after a save is sealed or the
    marker moved: no other save is in flight then)."""
    complete, broken = scan(root)
    best = read_best(root)
    kept = f"step_{best['step']:08d}" if best else None
    old = [p for p in (complete[:-keep_last] if keep_last > 0 else []) if p.name != kept]
    for path in [*old, *broken]:
        shutil.rmtree(path, ignore_errors=True)


def read_best(root: Path) -> dict | None:
    """The best marker (step, metric, mode, value, ...), or None when there is none or it is
    unreadable (a marker is only ever replaced whole, so unreadable means not written by us)."""
    try:
        best = json.loads((root / BEST).read_text())
        best["step"] = int(best["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return best


def write_best(root: Path, record: dict) -> None:
    """Replace the best marker atomically: a crash leaves the old marker or the new one, never
    half of one (a half-written marker would unprotect the best checkpoint from pruning)."""
    tmp = root / f".tmp-{BEST}"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, root / BEST)
        _fsync(root)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(f"could not write {root / BEST}: {_cause(root, exc)}; the "
                                   f"checkpoints are intact. Free disk space, or choose another "
                                   f"trainer.output_dir") from exc


def load(path: Path, name: str):
    return torch.load(path / name, map_location="cpu", weights_only=True)
