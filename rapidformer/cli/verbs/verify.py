"""`rapidformer verify RUN_DIR|CHECKPOINT`: read every byte of every checkpoint file and compare
it with the checkpoint's manifest (sizes and sha256, as written); say which files are bad and
what is wrong with each (deleted, truncated to N of M bytes, changed bytes, a missing manifest).

Exit code 0 when every checkpoint checked is intact, 2 when one is damaged or incomplete (the
damaged files are named), so that a job script can test a checkpoint before it copies, resumes
or deletes anything. Interrupted saves (`.tmp-*` directories), damaged checkpoints that a later
save set aside (`step_NNNNNNNN.damaged`) and directories that are not checkpoints are listed as
skipped.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rapidformer.checkpoint import store
from rapidformer.errors import EXIT_BAD_INPUT, InputError


def checkpoints_under(path: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the checkpoints to verify, [(a directory skipped, why)]) that `path` names."""
    if store.NAME.match(path.name) or (path / store.MANIFEST).is_file():
        return [path], []
    if path.name.startswith(store.TEMP):
        raise InputError(f"{path} is not a checkpoint: {store.interrupted_save(path)}; verify "
                         f"the run directory, {path.parent.parent}, or one of its "
                         f"step_NNNNNNNN directories")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    survey = store.Survey(root)
    skipped = [*((p, f"{store.interrupted_save(p)}; resume ignores it")
                 for p in survey.interrupted),
               *((p, "a damaged checkpoint that a later save of its step set aside; resume "
                     "ignores it") for p in survey.set_aside),
               *((p, "not a checkpoint (they are named step_NNNNNNNN); left alone")
                 for p in survey.strays)]
    if not survey.steps:
        left = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise InputError(f"{path}: no checkpoint found (a run directory holds them under "
                         f"checkpoints/step_NNNNNNNN){f'; it holds {left}' if left else ''}; "
                         f"give a run directory or one checkpoint")
    return survey.steps, skipped


def verify_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run directory or one step_NNNNNNNN directory")
    args = parser.parse_args(argv)
    if not args.path.exists() and not args.path.is_symlink():
        raise InputError(f"{args.path}: no such directory; give a run directory "
                         f"(trainer.output_dir) or a step_NNNNNNNN checkpoint")
    targets, skipped = checkpoints_under(args.path)
    damaged, intact = 0, []
    for path in targets:
        started = time.perf_counter()
        problems = store.verify(path)
        if problems:
            damaged += 1
            print(f"DAMAGED  {path}")
            for problem in problems:
                print(f"         {problem}")
            continue
        intact.append(path)
        files = store.read_manifest(path)["files"]
        size = sum(entry["bytes"] for entry in files.values())
        unhashed = [rel for rel, entry in files.items() if "sha256" not in entry]
        note = f", {len(unhashed)} without a checksum (older format): sizes only" if unhashed else ""
        print(f"ok       {path} ({len(files)} files, {size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - started:.1f} s{note})")
    for path, why in skipped:
        print(f"skipped  {path} ({why})")
    one = len(targets) == 1 and not skipped and targets[0] == args.path
    best = store.read_best(targets[0].parent) if not one else None
    if best is not None:
        named = targets[0].parent / f"step_{best['step']:08d}"
        state = "" if named in intact else (" (that checkpoint is damaged)" if named in targets
                                            else " (that checkpoint is missing)")
        print(f"best     {named.name}: {best.get('metric')}={best.get('value')}{state}")
    if damaged:
        if one:
            then = ("resume and export refuse it; choose another checkpoint (`rapidformer "
                    f"verify {args.path.parent.parent}` lists them)")
        elif intact:
            then = (f"resume skips them (trainer.resume=auto takes the newest intact one, "
                    f"{intact[-1].name})")
        else:
            then = ("none can be resumed: trainer.resume=auto refuses this run; resume from a "
                    "copy you trust with trainer.resume=PATH, or start fresh with "
                    "trainer.overwrite=true")
        print(f"rapidformer: error: {damaged} of {len(targets)} checkpoints are damaged; {then}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
