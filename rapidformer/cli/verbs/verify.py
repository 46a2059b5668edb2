"""`rapidformer verify RUN_DIR|CHECKPOINT`: read every byte of every checkpoint file and compare
it with the checkpoint's manifest (sizes and sha256, as written); say which files are bad.

Exit code 0 when every checkpoint checked is intact, 2 when one is damaged or incomplete (the
damaged files are named), so that a job script can test a checkpoint before it copies, resumes
or deletes anything.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rapidformer.checkpoint import store
from rapidformer.errors import EXIT_BAD_INPUT, InputError


def checkpoints_under(path: Path) -> tuple[list[Path], list[Path]]:
    """(the checkpoints to verify, interrupted saves) that `path` names."""
    if store.NAME.match(path.name):
        return [path], []
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    complete, broken = store.scan(root)
    named = [p for p in broken if store.NAME.match(p.name)]
    interrupted = [p for p in broken if not store.NAME.match(p.name)]
    if not complete and not named:
        raise InputError(f"{path}: no checkpoint found (a run directory holds them under "
                         f"checkpoints/step_NNNNNNNN); give a run directory or one checkpoint")
    return sorted(complete + named), interrupted


def verify_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run directory or one step_NNNNNNNN directory")
    args = parser.parse_args(argv)
    if not args.path.exists():
        raise InputError(f"{args.path}: no such directory; give a run directory "
                         f"(trainer.output_dir) or a step_NNNNNNNN checkpoint")
    targets, interrupted = checkpoints_under(args.path)
    damaged = 0
    for path in targets:
        started = time.perf_counter()
        manifest = store.read_manifest(path)
        problems = store.verify(path)
        if problems:
            damaged += 1
            print(f"DAMAGED  {path}")
            for problem in problems:
                print(f"         {problem}")
            continue
        files = manifest["files"]
        size = sum(entry["bytes"] for entry in files.values())
        unhashed = [rel for rel, entry in files.items() if "sha256" not in entry]
        note = f", {len(unhashed)} without a checksum (older format): sizes only" if unhashed else ""
        print(f"ok       {path} ({len(files)} files, {size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - started:.1f} s{note})")
    for path in interrupted:
        print(f"skipped  {path} (an interrupted save; resume ignores it)")
    best = store.read_best(targets[0].parent) if targets else None
    if best is not None and not store.NAME.match(args.path.name):
        named = targets[0].parent / f"step_{best['step']:08d}"
        state = "" if named in targets else " (that checkpoint is missing)"
        print(f"best     {named.name}: {best.get('metric')}={best.get('value')}{state}")
    if damaged:
        print(f"rapidformer: error: {damaged} of {len(targets)} checkpoints are damaged; resume "
              f"skips them (trainer.resume=auto takes the newest intact one)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
