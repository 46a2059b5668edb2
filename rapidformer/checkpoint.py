"""Checkpoints that are either complete or ignored.

A checkpoint is written into a hidden temporary directory, each file flushed to disk, a
manifest (`COMPLETE.json`: step, files, sizes, sha256 of the small ones) written last, and only
then renamed to `step_NNNNNNNN`. A crash mid-save leaves a `.tmp-*` directory that resume skips
and reports; a directory whose manifest is missing or disagrees with its files is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
MANIFEST = "COMPLETE.json"
NAME = re.compile(r"^step_(\d{8})$")
SMALL_FILE = 1 << 20  # files below 1 MiB get a checksum in the manifest


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temp_dir(root: Path, step: int) -> Path:
    """Where step `step` is written before it is sealed (every rank of a job agrees on it)."""
    return root / f".tmp-step_{step:08d}"


def _write_error(final: Path, exc: OSError) -> InputError:
    return InputError(f"could not write checkpoint {final}: {exc.strerror or exc}; free disk "
                      f"space or choose another trainer.output_dir (earlier checkpoints are "
                      f"untouched)")


def prepare(root: Path, step: int) -> Path:
    """An empty temporary directory for step `step`, which every rank then writes its shards
    into (rank 0 calls this, the others wait)."""
    tmp = temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise _write_error(root / f"step_{step:08d}", exc) from exc
    return tmp


def save(root: Path, step: int, tensors: dict[str, object], state: dict,
         extra: Callable[[Path], None] | None = None, keep_last: int = 2,
         prepared: bool = False, manifest: dict | None = None) -> Path:
    """Write `tensors` (name -> object for torch.save) and `state` (json) as step `step`.

    `prepared`: the temporary directory already holds files written by every rank (sharded
    strategies' files); they are sealed together with these. `manifest`: what the manifest
    records beside the files (the strategy and its layout).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = temp_dir(root, step)
    if not prepared:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(exist_ok=prepared)
        for name, obj in tensors.items():
            torch.save(obj, tmp / name)
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        if extra is not None:
            extra(tmp)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            entry = {"bytes": path.stat().st_size}
            if entry["bytes"] < SMALL_FILE:
                entry["sha256"] = _sha256(path)
            files[str(path.relative_to(tmp))] = entry
        seal = tmp / MANIFEST
        seal.write_text(json.dumps({"step": step, **(manifest or {}), "files": files}, indent=1))
        _fsync(seal)
        _fsync(tmp)
        if final.exists():  # the same step saved again (e.g. epoch end == exit step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(final, exc) from exc
    prune(root, keep_last)
    return final


def is_complete(path: Path) -> bool:
    manifest = path / MANIFEST
    if not NAME.match(path.name) or not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != entry["bytes"]:
            return False
        if "sha256" in entry and _sha256(f) != entry["sha256"]:
            return False
    return True


def scan(root: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints oldest first, incomplete directories)."""
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


def latest(root: Path) -> Path | None:
    complete, broken = scan(root)
    for path in broken:
        log.warning("ignoring incomplete checkpoint %s (a save was interrupted)", path)
    return complete[-1] if complete else None


def prune(root: Path, keep_last: int) -> None:
    """Remove complete checkpoints beyond the newest `keep_last`, and what interrupted saves
    left (called right after a save is sealed: no other save is in flight then)."""
    complete, broken = scan(root)
    for old in [*(complete[:-keep_last] if keep_last > 0 else []), *broken]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, name: str):
    return torch.load(path / name, map_location="cpu", weights_only=True)


def read_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())
