"""Reading a checkpoint that a run still training may prune meanwhile (trainer.keep_last): the
verbs (export, eval, predict) take the newest again, or say that it was removed, where the
missing files would otherwise read as damage; and the one message for a damaged checkpoint."""
from __future__ import annotations

import contextlib
from pathlib import Path

from rapidformer.checkpoint import store
from rapidformer.errors import InputError


def newest_verified(root: Path, attempts: int = 3) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint under `root`, what is wrong with it); taken again when a
    run still training pruned it while its bytes were read (trainer.keep_last)."""
    path, problems = None, []
    for _ in range(attempts):
        path = store.newest_complete(root)
        if path is None:
            return None, []
        problems = store.verify(path)
        if not problems or not gone(path):
            break
    return path, problems


def require_intact(path: Path, problems: list[str], given: str, advice: str | None = None
                   ) -> None:
    if problems and gone(path):  # renamed away by pruning, then deleted
        raise removed_while_read(path, given)
    if problems:
        raise InputError(f"{given}: checkpoint {path} is damaged: {'; '.join(problems)}; "
                         + (advice or f"choose another checkpoint (`rapidformer verify "
                                      f"{path.parent.parent}` lists the intact ones)"))


def removed_while_read(path: Path, given: str) -> InputError:
    return InputError(f"{given}: checkpoint {path} was removed while it was read: the run that "
                      f"wrote it is still training and keeps only its newest trainer.keep_last "
                      f"checkpoints; run the command again (it takes the newest then), or once "
                      f"the run has finished")


@contextlib.contextmanager
def named_if_pruned(path: Path, given: str):
    """A failure while checkpoint `path` is read, because pruning removed it meanwhile, is said
    as such (not as the library's missing file)."""
    try:
        yield
    except Exception as exc:
        if gone(path):
            raise removed_while_read(path, given) from exc
        raise


def require_present(path: Path, given: str) -> None:
    """After a checkpoint's weights were read: it is still there, so what is read next from it
    (its tokenizer) is its own, not a fallback's."""
    if gone(path):
        raise removed_while_read(path, given)


def gone(path: Path) -> bool:
    return not (path.exists() or path.is_symlink())
