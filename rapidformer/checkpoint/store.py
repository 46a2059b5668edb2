"""Checkpoints that are either complete or ignored, and whose every byte is checked.

A checkpoint is written into a hidden temporary directory, each file flushed to disk, a
manifest (`COMPLETE.json`: step, every file with its size and sha256) written last, and only
then renamed to `step_NNNNNNNN`. The files rank 0 writes with `torch.save` are hashed while they
are written (`HashingWriter`: no second read); files a backend writes itself (DeepSpeed's and
torch.distributed.checkpoint's shards) are read once after writing, split over the ranks. A
crash mid-save leaves a `.tmp-*` directory that resume skips and reports; a directory whose
manifest is missing or disagrees with its files is never loaded: `scan` compares sizes (cheap,
for listing), `verify` every byte (before a resume loads it, and `rapidformer verify`), and
names each file and what is wrong with it (deleted, truncated to N of M bytes, changed bytes).

A checkpoint is never removed or replaced because it could not be read: `prune` removes by age
alone (the checkpoints beyond trainer.keep_last, the best one kept; a damaged one only where an
intact one in its place would go too) and what interrupted saves left; a save of a step whose
directory is there but damaged sets that directory aside (`step_NNNNNNNN.damaged`) instead of
deleting it.
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

from rapidformer.errors import CheckpointWriteError
from rapidformer.file_modes import honour_umask

log = logging.getLogger("rapidformer")
MANIFEST = "COMPLETE.json"
NAME = re.compile(r"^step_(\d{8})$")
# a damaged checkpoint that a later save of its step moved out of the way (kept for the user)
SET_ASIDE = re.compile(r"^step_(\d{8})\.damaged(?:\.\d+)?$")
TEMP = ".tmp-"  # what a save writes into, then renames; whatever holds it is an interrupted save
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
    CheckpointWriteError. A directory of this step that is there already is replaced when it
    is intact, and set aside (`step_NNNNNNNN.damaged`) when it is not: never deleted because it
    could not be read.
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
        replaced = _make_way(final, step)
        os.rename(tmp, final)
        _fsync(root)
        _sealed[str(final)] = _inode(final)
        if replaced is not None:
            _remove(replaced)
    except (OSError, RuntimeError) as exc:
        if not is_write_failure(exc):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(root, step, exc) from exc
    prune(root, keep_last)
    return final


# step directory -> its inode, for the checkpoints this process sealed: the same step saved
# again (an own loop's, an epoch's end that is also the exit step) replaces its own checkpoint
# without a warning
_sealed: dict[str, int | None] = {}


def _make_way(final: Path, step: int) -> Path | None:
    """Free the name `final` for a new save of its step. What is there is replaced when it is
    intact or holds nothing (renamed to a `.tmp-` name, returned, and removed once the new one
    is in place: a crash in between leaves an interrupted save, never half a step directory);
    a damaged one is set aside under a name of its own, kept, and reported."""
    if not (final.exists() or final.is_symlink()):
        return None
    problems = verify(final)
    empty = final.is_dir() and not final.is_symlink() and not any(final.iterdir())
    if not problems or empty:
        if empty or _sealed.get(str(final)) != _inode(final):
            log.warning("the save of step %d replaces %s: %s", step, final,
                        "an empty directory" if empty else "an intact checkpoint that this "
                        "run did not write (it resumed from an older one)")
        replaced = final.parent / f"{TEMP}replaced-{final.name}"
        _remove(replaced)
        os.rename(final, replaced)
        return replaced
    aside, k = final.with_name(f"{final.name}.damaged"), 1
    while aside.exists() or aside.is_symlink():  # the first free step_N.damaged[.K]
        k += 1
        aside = final.with_name(f"{final.name}.damaged.{k}")
    os.rename(final, aside)
    log.warning("checkpoint %s could not be read (%s); this run saves step %d under its name "
                "and keeps the damaged one as %s (nothing in it was deleted; remove it when "
                "you no longer need it)", final, "; ".join(problems), step, aside)
    return None


def _inode(path: Path) -> int | None:
    return path.lstat().st_ino if path.exists() or path.is_symlink() else None


def _remove(target: Path) -> None:
    """Remove a file, a link (as a link: what it points to is not ours) or a directory tree."""
    if target.is_symlink() or target.is_file():
        target.unlink(missing_ok=True)
    elif target.is_dir():
        shutil.rmtree(target, ignore_errors=True)


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(the manifest of checkpoint `path`, or None and what is wrong with it)."""
    seal = path / MANIFEST
    if not seal.is_file():
        return None, "missing"
    try:
        manifest = json.loads(seal.read_text())
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    except ValueError as exc:  # a save writes it whole: its bytes changed since
        return None, f"not valid JSON ({exc}): its bytes changed since it was written"
    try:
        for entry in manifest["files"].values():
            int(entry["bytes"])
    except (KeyError, TypeError, AttributeError, ValueError):
        return None, "not a checkpoint manifest (it lists no files with their sizes)"
    return manifest, None


def read_manifest(path: Path) -> dict | None:
    return _read_manifest(path)[0]


def is_complete(path: Path) -> bool:
    """Sealed, with every file of its manifest present at its size (no bytes read)."""
    if not NAME.match(path.name):
        return False
    manifest = read_manifest(path)
    if manifest is None:
        return False
    return all((path / rel).is_file() and (path / rel).stat().st_size == entry["bytes"]
               for rel, entry in manifest["files"].items())


def interrupted_save(path: Path) -> str:
    """What a `.tmp-*` directory beside the checkpoints is: what a save, a replacement or
    pruning left when the run stopped before it finished (the next save removes it)."""
    if path.name.startswith(f"{TEMP}pruned-"):
        return (f"an interrupted removal: {path.name} is a checkpoint that trainer.keep_last "
                f"was removing when the run stopped")
    if path.name.startswith(f"{TEMP}replaced-"):
        return (f"an interrupted replacement: {path.name} is a checkpoint that a newer save of "
                f"its step replaced, left by a crash before it was removed")
    return (f"an interrupted save: {path.name} is the temporary directory a save writes into "
            f"and renames to step_NNNNNNNN only once every file is sealed; it never was")


def verify(path: Path, only: list[str] | None = None, read_bytes: bool = True) -> list[str]:
    """What is wrong with checkpoint `path`, each problem naming the file and what is wrong
    with it (empty: every byte matches its manifest). `only`: check these files of the manifest
    (a rank's share), not all. `read_bytes=False`: sizes only (no file is read)."""
    if path.name.startswith(TEMP):
        return [interrupted_save(path)]
    if path.is_symlink() and not path.exists():
        return [f"a link to {os.readlink(path)}, which does not exist"]
    if not path.exists():
        return ["does not exist"]
    if not path.is_dir():
        return ["a file, not a checkpoint directory"]
    manifest, wrong = _read_manifest(path)
    if manifest is None:
        held = files_of(path)
        if not held:
            return [f"empty: it holds no files, not even its manifest {MANIFEST} (a save puts "
                    f"a checkpoint in place only with its files sealed: it was emptied since)"]
        if wrong != "missing":
            return [f"{MANIFEST}: {wrong}; none of its files can be checked"]
        shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
        return [f"{MANIFEST} is missing: deleted since the checkpoint was written (a save puts "
                f"a checkpoint in place only once its manifest is written), so none of its "
                f"{len(held)} files ({shown}) can be checked"]
    if not manifest["files"]:
        return [f"{MANIFEST} lists no files: not a manifest a save writes"]
    problems = []
    for rel, entry in manifest["files"].items():
        if only is not None and rel not in only:
            continue
        f, size = path / rel, int(entry["bytes"])
        if not f.exists():
            problems.append(f"{rel}: deleted ({MANIFEST} lists it, {size} bytes; it is not "
                            f"there)")
        elif not f.is_file():
            problems.append(f"{rel}: not a file ({MANIFEST} lists a file of {size} bytes)")
        elif f.stat().st_size < size:
            problems.append(f"{rel}: truncated to {f.stat().st_size} of {size} bytes")
        elif f.stat().st_size > size:
            problems.append(f"{rel}: {f.stat().st_size} bytes, {f.stat().st_size - size} more "
                            f"than the {size} written (bytes appended since)")
        elif "sha256" not in entry:
            if only is None and read_bytes:  # written before every file was hashed: sizes only
                log.info("%s: no checksum in the manifest (an older checkpoint); size checked",
                         f)
        elif read_bytes:
            try:
                changed = file_sha256(f) != entry["sha256"]
            except OSError as exc:
                problems.append(f"{rel}: cannot be read ({exc.strerror or exc})")
                continue
            if changed:
                problems.append(f"{rel}: its bytes changed since it was written (sha256 "
                                f"differs)")
    return problems


def scan(root: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints oldest first, incomplete directories), by sizes only."""
    if not root.is_dir():
        return [], []
    complete, broken = [], []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(TEMP) or (NAME.match(path.name) and not is_complete(path)):
            broken.append(path)
        elif NAME.match(path.name):
            complete.append(path)
    return complete, broken


class Survey:
    """What a checkpoints directory holds: `steps` (every entry named step_NNNNNNNN, intact or
    not, oldest first), `interrupted` (what saves left that never finished: `.tmp-*`
    directories), `set_aside` (damaged checkpoints a later save moved out of the way) and
    `strays` (other directories, not rapidformer's: left alone)."""

    def __init__(self, root: Path):
        self.root = root
        self.steps, self.interrupted, self.set_aside, self.strays = [], [], [], []
        entries = sorted(root.iterdir()) if root.is_dir() else []
        for path in entries:
            if NAME.match(path.name):
                self.steps.append(path)
            elif path.name.startswith(TEMP) and path.is_dir():
                self.interrupted.append(path)
            elif SET_ASIDE.match(path.name):
                self.set_aside.append(path)
            elif path.is_dir():
                self.strays.append(path)


def newest_complete(root: Path) -> Path | None:
    complete, _ = scan(root)
    return complete[-1] if complete else None


def latest(root: Path, verify_files: Callable[[Path], list[str]] = verify) -> Path | None:
    """The newest checkpoint under `root` whose bytes all match its manifest (None when there
    is none); the damaged newer ones and interrupted saves are reported and skipped (left as
    they are). Whether to start fresh or refuse when there is none is the caller's."""
    survey = Survey(root)
    for path in survey.interrupted:
        log.warning("ignoring %s: %s", path, interrupted_save(path))
    for path in reversed(survey.steps):
        problems = verify_files(path)
        if not problems:
            return path
        log.warning("ignoring damaged checkpoint %s: %s", path, "; ".join(problems))
    return None


def prune(root: Path, keep_last: int) -> None:
    """Remove, by age alone, the checkpoints beyond the newest `keep_last` complete ones (the
    one the best marker names is kept), and what interrupted saves left (called right after a
    save is sealed or the marker moved: no other save is in flight then). A damaged step
    directory goes only where an intact one would: when `keep_last` complete checkpoints are
    newer. Damaged directories newer than those, the ones set aside, and directories that are
    not rapidformer's stay."""
    survey = Survey(root)
    complete, _ = scan(root)
    best = read_best(root)
    kept = f"step_{best['step']:08d}" if best else None
    old = []
    if keep_last > 0 and len(complete) >= keep_last:
        oldest_kept = _step(complete[-keep_last])
        old = [p for p in survey.steps if _step(p) < oldest_kept and p.name != kept]
    for path in old:
        # renamed first: a crash while it is deleted leaves an interrupted save's leftovers,
        # never a step directory with half its files (it would look damaged)
        doomed = path.parent / f"{TEMP}pruned-{path.name}"
        try:
            _remove(doomed)
            os.rename(path, doomed)
        except OSError:
            doomed = path
        _remove(doomed)
    for path in survey.interrupted:
        _remove(path)


def _step(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


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
