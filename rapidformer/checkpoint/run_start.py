"""A run directory as it was before a run started in it, put back when the run is refused
before it trained.

A run writes into its directory before it can know whether it will be refused: Hydra's
`.hydra/` and log, `config.yaml`, `environment.json`, `status.json`, the marker, generated data,
a trained tokenizer, LoRA's copy of its base; and a resume is refused only once its model is
built. So the entry point takes `RunStart` before anything is written, and a run refused before
its first metrics record or checkpoint (exit code 2 or 3) gets every byte put back: files it
changed restored, entries it added removed, the log cut back to its length, directories it
made removed. `trainer.overwrite=true` moves the earlier run's outputs aside (`STASH`) instead
of deleting them at once: they come back with the rest if the run is refused, and are deleted
once it has trained (or by the next overwrite, after a kill). A run without overwrite that finds
them aside (an overwrite stopped by a kill or Ctrl-C before it trained) puts them back first
(run_dir.claimed), so that a resume continues the earlier run.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

STASH = ".rapidformer-overwritten"
# what a start rewrites at the top of an existing run directory (read back whole), and the
# logs it appends to (cut back to their length)
REWRITTEN = ("config.yaml", "environment.json", "status.json", ".rapidformer-run")
APPENDED = ("rapidformer.log",)


class RunStart:
    def __init__(self, run_dir):
        self.path = Path(run_dir).absolute()
        self.started = time.time()
        self.created = _missing_ancestors(self.path)
        self.entries = set(os.listdir(self.path)) if self.path.is_dir() else set()
        self.files = {rel: (self.path / rel).read_bytes() for rel in self._small_files()}
        self.sizes = {name: (self.path / name).stat().st_size for name in APPENDED
                      if (self.path / name).is_file()}

    def _small_files(self) -> list[str]:
        hydra = self.path / ".hydra"
        files = [name for name in REWRITTEN if (self.path / name).is_file()]
        return files + ([str(p.relative_to(self.path)) for p in hydra.rglob("*") if p.is_file()]
                        if hydra.is_dir() else [])

    def trained(self) -> bool:
        """Whether the run wrote a metrics record or a checkpoint since it started."""
        def since(path: Path) -> bool:
            return path.is_file() and path.stat().st_mtime >= self.started
        return since(self.path / "metrics.jsonl") or any(
            since(step / "COMPLETE.json")
            for step in (self.path / "checkpoints").glob("step_*"))

    def put_back(self) -> None:
        """The directory as it was before the run started."""
        if self.created:
            shutil.rmtree(self.created[0], ignore_errors=True)
            for parent in self.created[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only when empty: a sibling run may have appeared
            return
        if not self.path.is_dir():
            return
        for name in set(os.listdir(self.path)) - self.entries - {STASH}:
            _remove(self.path / name)
        self._unstash()
        hydra = self.path / ".hydra"
        for stale in (p for p in hydra.rglob("*") if p.is_file()) if hydra.is_dir() else ():
            if str(stale.relative_to(self.path)) not in self.files:
                stale.unlink()
        for rel, data in self.files.items():
            (self.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.path / rel).write_bytes(data)
        for name, size in self.sizes.items():
            with contextlib.suppress(OSError), open(self.path / name, "rb+") as f:
                f.truncate(size)

    def _unstash(self) -> None:
        unstash(self.path)

    def drop_stash(self) -> None:
        """The run trained: the earlier run's outputs it moved aside go."""
        shutil.rmtree(self.path / STASH, ignore_errors=True)


def unstash(run_dir: Path) -> None:
    """What an overwrite moved aside, back where it was (over what a start wrote since)."""
    stash_dir = Path(run_dir) / STASH
    if not stash_dir.is_dir():
        return
    for entry in stash_dir.iterdir():
        # checkpoints/ was emptied of rapidformer's entries only: they go back into it
        moved = list(entry.iterdir()) if entry.name == "checkpoints" else [entry]
        for item in moved:
            target = Path(run_dir) / item.relative_to(stash_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove(target)
            os.rename(item, target)
    shutil.rmtree(stash_dir, ignore_errors=True)


def stash(run_dir: Path, entry: Path) -> None:
    """Move `entry` (in `run_dir`) aside, under the stash, keeping its relative path."""
    target = run_dir / STASH / entry.relative_to(run_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(entry, target)


def _missing_ancestors(path: Path) -> list[Path]:
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove(target: Path) -> None:
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
