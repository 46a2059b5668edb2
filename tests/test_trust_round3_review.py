"""Held-out cases of issue 34's classes, found by a review after its fixes: each is a table of
variations through the real entry point (in-process CLI), the files before and after compared.

- a file named like the run's own `.lock` that is not a lock a claim left (the user's text, a
  directory, a symbolic link to a file elsewhere) is the user's: the run refuses the folder and
  writes nothing, through the link least of all;
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.test_bad_input import call

ONE_STEP = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.train_iters=1",
            "trainer.epochs=null", "trainer.export_hf=false", "data.synthetic_train_size=64",
            "data.synthetic_eval_size=16", "trainer.micro_batch_size=16"]


def tree(*roots: Path) -> dict[str, str]:
    """Every file and link under `roots`: its path, and its bytes' sha256 or its target."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    found[str(p)] = "-> " + os.readlink(p)
                elif p.is_file():
                    found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
                else:
                    found[str(p)] = "dir"
    return found


# --- a `.lock` that is not a claim's is the user's -------------------------------------------

def _user_text(folder: Path, outside: Path) -> None:
    (folder / ".lock").write_text("held by my own tool\n")


def _link_outside(folder: Path, outside: Path) -> None:
    os.symlink(outside / "victim.txt", folder / ".lock")


def _dangling_link(folder: Path, outside: Path) -> None:
    os.symlink(outside / "not_there.txt", folder / ".lock")


def _directory(folder: Path, outside: Path) -> None:
    (folder / ".lock").mkdir()
    (folder / ".lock" / "mine").write_text("x")


@pytest.mark.parametrize("plant", [_user_text, _link_outside, _dangling_link, _directory])
def test_a_lock_file_not_ours_is_refused_and_left_alone(plant, tmp_path, capsys):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("the user's file\n")
    plant(folder, outside)
    before = tree(folder, outside)
    code, err = call("rapidformer", [*ONE_STEP, f"trainer.output_dir={folder}"], capsys)
    assert code == 2, err[-2000:]
    assert "holds files that no rapidformer run wrote (.lock)" in err, err[-2000:]
    assert "Traceback" not in err
    assert tree(folder, outside) == before
    assert not (outside / "not_there.txt").exists()


@pytest.mark.parametrize("text,ours", [
    ("", True),  # a refused claim's
    (json.dumps({"pid": 4242, "host": "node7", "started": "2026-12-01T10:00:00"}), True),
    ("held by my own tool\n", False), ("[1, 2]", False), ('{"pid": 1}', False)])
def test_only_a_claims_lock_is_taken_for_one(text, ours, tmp_path):
    from rapidformer.checkpoint.run_dir import claim_problems

    (tmp_path / ".lock").write_text(text)
    problems = claim_problems(tmp_path, None, False)
    assert (problems == []) == ours, problems
