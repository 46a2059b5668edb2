"""One process per device, started with PyTorch's own launcher (torch.distributed.elastic).

The parent has composed, validated and written the resolved config; each worker reads that
file (`python -m rapidformer.cli.worker --worker RUN_DIR/config.yaml`), so every rank runs the same
config in the same run directory. When RANK/WORLD_SIZE are already set (torchrun, srun), the
job runs in place instead. Per-rank stdout/stderr land in RUN_DIR/logs/nodeN/; local rank 0's is also shown.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import EXIT_PREEMPTED, RapidformerError
from rapidformer.runtime.rank_progress import describe_laggards, failure_times

log = logging.getLogger("rapidformer")
LAUNCHER_PID = "RAPIDFORMER_LAUNCHER_PID"


def already_launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_workers(cfg: RunConfig) -> bool:
    return (cfg.launcher.nproc_per_node > 1 or cfg.launcher.nnodes > 1) and not already_launched()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_workers(cfg: RunConfig, run_dir: Path, config_file: Path) -> None:
    """Start the workers of this node and wait; a failed worker ends the job with its rank."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    ln = cfg.launcher
    # one node: a fresh port, so that runs (and multirun jobs) never share a process group
    port = ln.master_port if ln.nnodes > 1 else free_port()
    addr = ln.master_addr if ln.nnodes > 1 else "127.0.0.1"
    run_id = f"rapidformer-{addr}-{port}" if ln.nnodes > 1 else uuid.uuid4().hex[:8]
    config = LaunchConfig(
        min_nodes=ln.nnodes, max_nodes=ln.nnodes, nproc_per_node=ln.nproc_per_node,
        run_id=run_id, rdzv_backend="static", rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs={"rank": ln.node_rank, "timeout": ln.rendezvous_timeout},
        max_restarts=ln.max_restarts, monitor_interval=0.2, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / f"node{ln.node_rank}"),
                                    redirects=Std.ALL,
                                    tee={0: Std.ALL}))
    # as torchrun does: CPU threads shared out between the workers instead of oversubscribed
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ln.nproc_per_node)))
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the parent each worker must still have
    log.info("starting %d worker(s) on node %d of %d (rendezvous %s:%d)", ln.nproc_per_node,
             ln.node_rank, ln.nnodes, addr, port)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "rapidformer.cli.worker", "--worker",
                                               str(config_file))
    except SignalException as exc:
        # the launcher was signalled and forwarded it: the workers stopped at a step boundary
        # with a checkpoint, if they had the time (torch elastic's 30 s)
        raise _preempted(run_dir, signal.Signals(exc.sigval).name) from exc
    except ChildFailedError as exc:
        if all(f.exitcode == EXIT_PREEMPTED for f in exc.failures.values()):
            raise _preempted(run_dir, "a signal") from exc
        # the root cause: the earliest failure that was not the launcher's own SIGTERM, by the
        # workers' own nanosecond marks where they left one (torch elastic's are in seconds)
        marks = failure_times(run_dir)
        failures = [(marks.get(rank, f.timestamp * 10**9), rank, f)
                    for rank, f in exc.failures.items() if f.exitcode > 0]
        _, rank, failure = min(failures or [(f.timestamp * 10**9, r, f)
                                            for r, f in exc.failures.items()])
        raise WorkerFailed(rank, failure.exitcode, _log_tail(run_dir, failure.local_rank),
                           describe_laggards(run_dir), ln) from exc


def _preempted(run_dir: Path, cause: str):
    from rapidformer.runtime.preemption import newest_checkpoint, preempted

    newest = newest_checkpoint(run_dir / "checkpoints")
    return preempted(cause, f"the newest complete checkpoint is {newest}" if newest
                     else "no complete checkpoint was written")


class WorkerFailed(RapidformerError):
    def __init__(self, rank: int, exit_code: int, tail: str, laggards: str = "",
                 launcher=None):
        self.exit_code = exit_code if exit_code > 0 else 1
        detail = f"\n{tail}" if tail else ""
        cause = ""
        if laggards:
            cause = (f" {laggards}. If that rank was only slow (a long evaluation or save on it "
                     f"alone), raise launcher.collective_timeout="
                     f"{launcher.collective_timeout if launcher else '...'}.")
        restarts = (f" ({launcher.max_restarts} restart(s) of launcher.max_restarts used)"
                    if launcher is not None and launcher.max_restarts else "")
        super().__init__(f"worker rank {rank} failed with exit code {exit_code}; the whole job "
                         f"was stopped{restarts}.{cause} Its last output:{detail}")


def _log_tail(run_dir: Path, local_rank: int, lines: int = 8) -> str:
    logs = sorted((run_dir / "logs").glob(f"node*/*/attempt_*/{local_rank}/stderr.log"),
                  key=lambda p: p.stat().st_mtime)
    if not logs:
        return ""
    text = logs[-1].read_text(errors="replace").strip().splitlines()
    return "\n".join(f"  | {line}" for line in text[-lines:])


def resume_after_restart(cfg: RunConfig, run_dir: Path, restart: int) -> None:
    """An elastic restart (launcher.max_restarts) continues from the newest complete
    checkpoint this run wrote; with none yet, it starts as the first attempt did."""
    from rapidformer.runtime.preemption import newest_checkpoint

    if restart == 0:
        return
    newest = newest_checkpoint(run_dir / "checkpoints")
    if newest is not None:
        cfg.trainer.resume = "auto"
    log.warning("restart %d of launcher.max_restarts=%d: %s", restart, cfg.launcher.max_restarts,
                f"resuming from the newest complete checkpoint, {newest}" if newest
                else f"no checkpoint yet, starting again with trainer.resume={cfg.trainer.resume}")


def is_collective_timeout(exc: BaseException) -> bool:
    """gloo's and NCCL's 'a peer never answered' errors."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "Timed out waiting" in text or ("timed out" in text.lower()
                                        and "collective" in text.lower()))


def shutdown_process_group() -> None:
    """Leave together: a rank that exits with its process group alive can abort the
    collective library's threads and take its peers on other nodes down with it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        deepspeed_comm = sys.modules.get("deepspeed.comm")
        if deepspeed_comm is not None and getattr(deepspeed_comm.comm, "cdb", None) is not None:
            # DeepSpeed keeps its own references to the groups: the next job of a sweep in
            # this process would find them destroyed ("Group ... is not registered")
            deepspeed_comm.destroy_process_group()
        else:
            dist.destroy_process_group()


def die_with_launcher() -> None:
    """Linux: this worker gets SIGKILL when the launcher dies. torch elastic starts workers in
    sessions of their own, so a launcher killed with SIGKILL (the OOM killer, `kill -9`, a
    scheduler) would leave them training on, and a restarted job would then share the run
    directory, and its checkpoints, with them."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    # the launcher's pid from the launcher itself: read here, os.getppid() would already be
    # the reaper's pid when the launcher died while this worker was starting
    launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid())
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the request was in place
        os._exit(128 + signal.SIGKILL)
