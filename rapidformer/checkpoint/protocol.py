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
        """The checkpoint trainer.resume=`choice` names, verified (collective)."""
        if not choice:
            return None
        if choice == "auto":
            found = checkpoint.latest(self.root, self.verified)
            if found is None:
                log.info("trainer.resume=auto: no complete checkpoint in %s; starting fresh",
                         self.root)
            return found
        path = Path(choice)
        if path.is_dir() and not checkpoint.NAME.match(path.name):
            found = (checkpoint.latest(path / "checkpoints", self.verified)
                     or checkpoint.latest(path, self.verified))
            if found is not None:
                return found
        if not path.exists():
            raise InputError(f"trainer.resume={choice}: no such checkpoint directory; use "
                             f"trainer.resume=auto or a path to a step_NNNNNNNN directory")
        if not checkpoint.is_complete(path):
            raise InputError(f"trainer.resume={choice} is not a complete checkpoint (its "
                             f"{checkpoint.MANIFEST} is missing or does not match its files)")
        checkpoint.require_intact(path, self.verified(path), f"trainer.resume={choice}")
        return path


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

