"""Paths checked before any work: where the run writes, what it resumes from, the white-box
script it runs. A run that would fail at its first checkpoint, or after minutes of data
preparation, fails now."""
from __future__ import annotations

import os
from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import InputError


def check_paths(cfg: RunConfig, output_dir: str) -> None:
    problems = []
    out = Path(output_dir).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        problems.append(f"trainer.output_dir={output_dir} cannot be created: {existing} is a "
                        f"file, not a directory; choose another trainer.output_dir")
    elif not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"trainer.output_dir={output_dir} cannot be created or written: {existing} "
                        f"is read-only (or belongs to another user); choose a writable "
                        f"trainer.output_dir")
    resume = cfg.trainer.resume
    if resume and resume != "auto" and not Path(resume).exists():
        problems.append(f"trainer.resume={resume}: no such checkpoint directory; use "
                        f"trainer.resume=auto (the newest complete checkpoint in "
                        f"trainer.output_dir) or the path of a step_NNNNNNNN directory")
    elif resume and resume != "auto":
        from rapidformer.checkpoint.protocol import resume_path_problem

        if problem := resume_path_problem(resume):  # a file, a folder of no checkpoint
            problems.append(problem)
    if cfg.user_script and (problem := user_script_problem(cfg.user_script)):
        problems.append(problem)
    if problems:
        raise InputError("; ".join(problems))


def user_script_problem(path) -> str | None:
    """Why user_script cannot be run as the white-box script, or None."""
    if Path(path).is_file():
        return None
    return (f"user_script={path}: no such file; give the path to your Python script (relative "
            f"to the directory you run from)")
