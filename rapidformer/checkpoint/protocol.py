"""The checkpoint directory protocol across a job's ranks: who writes what, how every byte gets
its checksum, how a failed write on any rank ends the save on all of them, and which
checkpoint a resume loads.

Saving: rank 0 prepares the temporary directory; every rank's strategy writes its shards into
it; the ranks hash the files the strategy wrote, each a share of them; rank 0 writes the
replicated states (hashed while written) and seals the manifest. After each phase the ranks
agree on whether it failed, so a full disk on one rank removes the partial checkpoint and stops
every rank with one message, instead of leaving the others waiting in a collective.

Resuming: the checkpoint trainer.resume names is located and verified byte by byte (each rank
hashing a share of its files) when the engine is built, a point every rank passes together.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch.distributed as dist

from rapidformer.checkpoint import reading
from rapidformer.checkpoint import store as checkpoint
from rapidformer.errors import CheckpointWriteError, InputError

log = logging.getLogger("rapidformer")


class CheckpointProtocol:
    def __init__(self, root: Path, rank: int, world_size: int, strategy, keep_last: int):
        self.root, self.rank, self.world_size = root, rank, world_size
        self.strategy, self.keep_last = strategy, keep_last

    # --- collectives (plain values when the job is one process) -------------------------------
    def gather_objects(self, value) -> list:
        """`value` of every rank, in rank order."""
        if self.world_size == 1:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def _agree(self, step: int, failure: BaseException | None) -> None:
        """Raise on every rank if the phase failed on any (rank 0 removes the partial files)."""
        reports = self.gather_objects(None if failure is None else str(failure))
        failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(checkpoint.temp_dir(self.root, step), ignore_errors=True)
        self._barrier()
        if isinstance(failure, CheckpointWriteError):
            raise failure
        if failure is not None:
            raise checkpoint.write_failure(self.root, step, failure) from failure
        rank, text = failed[0]
        raise CheckpointWriteError(f"rank {rank}: {text}")

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- saving ------------------------------------------------------------------------------
    def save(self, step: int, state: dict, rng: list, extra=None, manifest: dict | None = None
             ) -> Path:
        tmp = checkpoint.temp_dir(self.root, step)
        failure = None
        if self.rank == 0:
            failure = _attempt(lambda: checkpoint.prepare(self.root, step))
        self._agree(step, failure)
        tensors = {}

        def write_shards():
            tensors.update(self.strategy.save(tmp))
        self._agree(step, _attempt(write_shards))
        hashes = {}

        def hash_share():
            files = checkpoint.files_of(tmp)
            hashes.update({rel: checkpoint.file_sha256(tmp / rel)
                           for rel in files[self.rank::self.world_size]})
        failure = _attempt(hash_share)
        for share in self.gather_objects(hashes):
            hashes.update(share)
        self._agree(step, failure)
        path = self.root / f"step_{step:08d}"
        if self.rank == 0:
            failure = _attempt(lambda: checkpoint.save(
                self.root, step, {**tensors, "rng.pt": {"ranks": rng}}, state, extra,
                self.keep_last, prepared=True, manifest=manifest, hashes=hashes))
        self._agree(step, failure)
        if self.rank == 0:
            log.info("saved checkpoint %s", path)
        self._barrier()
        return path

    # --- resuming ----------------------------------------------------------------------------
    def verified(self, path: Path) -> list[str]:
        """What is wrong with checkpoint `path` (collective: each rank hashes a share)."""
        manifest = checkpoint.read_manifest(path)
        files = sorted(manifest["files"]) if manifest else []
        mine = checkpoint.verify(path, only=files[self.rank::self.world_size])
        problems = []
        for share in self.gather_objects(mine):
            problems.extend(p for p in share if p not in problems)
        return problems

    def locate(self, choice: str | None) -> Path | None:
        """The checkpoint trainer.resume=`choice` names, verified (collective). `auto`: the
        newest intact one in this run's checkpoints (a fresh start when there is none); a
        run directory: the newest intact one in it; a checkpoint directory: that one. Where
        checkpoints exist and none can be read, refused, naming each damaged file: nothing is
        loaded, and nothing pruned or replaced because it could not be read."""
        if not choice:
            return None
        if choice == "auto":
            return self._newest_intact(self.root, "trainer.resume=auto", self.root.parent)
        path, given = Path(choice), f"trainer.resume={choice}"
        problem = resume_path_problem(choice)
        if problem:
            raise InputError(problem)
        if checkpoint.NAME.match(path.name) or (path / checkpoint.MANIFEST).is_file():
            run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
            reading.require_intact(
                path, self.verified(path), given,
                f"resume from an intact one (`rapidformer verify {run_dir}` lists them) with "
                f"trainer.resume=PATH or trainer.resume=auto, or start fresh (a new "
                f"trainer.output_dir, or trainer.overwrite=true without trainer.resume)")
            return path
        root = next(r for r in (path / "checkpoints", path) if checkpoint.Survey(r).steps)
        return self._newest_intact(root, given, path, fresh=False)

    def _newest_intact(self, root: Path, given: str, run_dir: Path, fresh: bool = True
                       ) -> Path | None:
        """The newest checkpoint under `root` whose every byte matches its manifest (damaged
        newer ones are reported and left as they are); None (start fresh) when `fresh` and
        `root` holds no checkpoint at all, not even a damaged one; otherwise refused."""
        survey = checkpoint.Survey(root)
        for path in survey.interrupted:
            log.warning("ignoring %s: %s (the next save removes it)", path,
                        checkpoint.interrupted_save(path))
        for path in survey.strays:
            log.info("%s: leaving %s alone: not a checkpoint (they are named step_NNNNNNNN)",
                     given, path)
        for path in survey.set_aside:
            log.info("%s: leaving %s alone: a damaged checkpoint that a later save of its step "
                     "set aside", given, path)
        found, damaged = None, []
        for path in reversed(survey.steps):
            problems = self.verified(path)
            if not problems:
                found = path
                break
            damaged.append((path, problems))
        if found is not None:
            for path, problems in damaged:
                log.warning("ignoring damaged checkpoint %s: %s; resuming from the older %s, "
                            "and leaving it as it is (a save of its step sets it aside as "
                            "%s.damaged)", path, "; ".join(problems), found.name, path.name)
            for path in survey.steps[:survey.steps.index(found)]:  # older: sizes only, no read
                if problems := checkpoint.verify(path, read_bytes=False):
                    log.warning("damaged checkpoint %s (older than %s, which is resumed): %s; "
                                "left as it is (trainer.keep_last removes it by age, as it "
                                "would an intact one)", path, found.name, "; ".join(problems))
            return found
        if damaged:
            interrupted = (f" (and {len(survey.interrupted)} interrupted save(s): "
                           f"{', '.join(p.name for p in survey.interrupted)})"
                           if survey.interrupted else "")
            report = "; ".join(f"{path}: {', '.join(why)}" for path, why in damaged)
            raise InputError(
                f"{given}: no checkpoint in {root} can be resumed, {len(damaged)} damaged"
                f"{interrupted}: {report}. Nothing was loaded, "
                f"removed or replaced. Check them with `rapidformer verify {run_dir}`; then "
                f"resume from a copy you trust with trainer.resume=PATH, or discard this run's "
                f"checkpoints and start fresh with trainer.overwrite=true (without "
                f"trainer.resume)")
        if not fresh:  # the callers ask only of a directory with checkpoints
            raise InputError(f"{given}: no checkpoint under {root}")
        log.info("%s: no checkpoint in %s%s; starting fresh", given, root,
                 " (only interrupted saves)" if survey.interrupted else "")
        return None


def _attempt(write) -> BaseException | None:
    """Run one write phase; the failure that a full or read-only disk causes, or None (any
    other error is a bug and propagates)."""
    try:
        write()
    except CheckpointWriteError as exc:
        return exc
    except (OSError, RuntimeError) as exc:
        if not checkpoint.is_write_failure(exc):
            raise
        return exc
    return None


def resume_path_problem(choice: str) -> str | None:
    """Why trainer.resume=`choice` (a path) names no checkpoint to resume from, by its shape
    alone (no file is read, nothing collective): the run's refusal, which the refusal pass asks
    too so that validate and the run's start refuse it alike. None: a step_NNNNNNNN directory
    (whose files `locate` verifies) or a run directory with one."""
    path, given = Path(choice), f"trainer.resume={choice}"
    if not path.exists() and not path.is_symlink():
        return (f"{given}: no such checkpoint directory; use trainer.resume=auto or a path to "
                f"a step_NNNNNNNN directory")
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if path.name.startswith(checkpoint.TEMP):
        return (f"{given} is not a checkpoint: {checkpoint.interrupted_save(path)}; resume from "
                f"a step_NNNNNNNN directory beside it (`rapidformer verify {run_dir}` lists the "
                f"intact ones) or with trainer.resume=auto")
    if checkpoint.NAME.match(path.name) or (path / checkpoint.MANIFEST).is_file():
        return None
    if path.is_dir():
        for root in (path / "checkpoints", path):
            if checkpoint.Survey(root).steps:
                return None
        if (path / "checkpoints").is_dir():
            left = checkpoint.Survey(path / "checkpoints").interrupted
            return (f"{given}: no checkpoint under {path / 'checkpoints'}"
                    + (f" (only interrupted saves: {', '.join(p.name for p in left)})"
                       if left else "")
                    + "; give a step_NNNNNNNN directory, or start fresh")
    aside = (" (a damaged checkpoint that a later save of its step set aside)"
             if checkpoint.SET_ASIDE.match(path.name) else "")
    return (f"{given} is not a checkpoint{aside}: neither a step_NNNNNNNN directory nor a run "
            f"directory with checkpoints under checkpoints/; give one of those, or "
            f"trainer.resume=auto")
