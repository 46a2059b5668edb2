"""One process per device, started with PyTorch's own launcher (torch.distributed.elastic).

The parent has composed, validated and written the resolved config; each worker reads that
file (`python -m rapidformer.cli.worker --worker RUN_DIR/config.yaml RUN_DIR`; a later node's
launcher gives its workers a copy of its own, outside the run directory), so every rank runs the
same config in the same run directory. When RANK/WORLD_SIZE are already set (torchrun, srun), the
job runs in place instead. Per-rank stdout/stderr land in RUN_DIR/logs/nodeN/; local rank 0's is also shown.

A SIGTERM or SIGINT to the launcher (a scheduler's `kill -TERM -PGID`, Ctrl-C) is passed on to
every worker's process group, and the launcher waits for the workers to finish the step, write
the checkpoint and exit (runtime/preemption.py), however long that takes, then exits 75 itself;
a worker that fails meanwhile ends the wait (the others could wait for it in a collective
forever, and torch elastic stops them); a second signal more than preemption.SAME_EVENT_S later
stops them at once (torch elastic then kills what is left 30 s later). A worker that fails ends the job: the launcher names the first
rank to fail (by the rank's own nanosecond mark; a rank killed by a signal leaves none, and
is named with the signal), and exits with its exit code, 128 + N for signal N.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from rapidformer.config.schema import RunConfig
from rapidformer.errors import EXIT_PREEMPTED, RapidformerError
from rapidformer.runtime.rank_progress import describe_laggards, failure_marks

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


@contextlib.contextmanager
def workers_config(run_dir: Path, resolved: dict, holder: bool):
    """The resolved config file this node's workers read: RUN_DIR/config.yaml, which the holder
    of the directory wrote (cli/hydra_main.write_run_records); on a later node, a file of its
    own outside the run directory, removed when the workers are done. (On a shared file system
    a later node that wrote RUN_DIR/config.yaml before the first node claimed the directory
    made it refuse the directory, and the first node rewrote the file its workers were reading.)"""
    if holder:
        yield run_dir / "config.yaml"
        return
    import tempfile

    import yaml

    # (a launcher killed before its workers start leaves it in the temporary folder, private)
    with tempfile.TemporaryDirectory(prefix="rapidformer-node-") as own:
        config_file = Path(own) / "config.yaml"
        config_file.write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
        yield config_file


def logs_at_start(log_dir: Path, **options):
    """torch elastic's per-rank log files under `log_dir`, whose folder is made when the
    workers start, after the rendezvous, instead of when the launcher is configured: a later
    node's launcher reaches the rendezvous first, and by the time it completes the first node
    holds the run directory (on a shared file system, RUN_DIR/logs/ made earlier made the first
    node refuse the directory)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class LogsAtStart(DefaultLogsSpecs):
        def __init__(self):
            super().__init__(log_dir=os.devnull, **options)  # makes no folder
            self._root_log_dir = str(log_dir)  # reify makes it (DefaultLogsSpecs._make_log_dir)

    return LogsAtStart()


def launch_workers(cfg: RunConfig, run_dir: Path, resolved: dict) -> None:
    """Start the workers of this node and wait; a failed worker ends the job with its rank."""
    from rapidformer.checkpoint.run_dir import holds_directory

    with workers_config(run_dir, resolved, holds_directory(cfg.launcher)) as config_file:
        _launch(cfg, run_dir, config_file)


def _launch(cfg: RunConfig, run_dir: Path, config_file: Path) -> None:
    from torch.distributed.elastic.multiprocessing import Std
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
        logs_specs=logs_at_start(run_dir / "logs" / f"node{ln.node_rank}",
                                 redirects=Std.ALL, tee={0: Std.ALL}))
    # as torchrun does: CPU threads shared out between the workers instead of oversubscribed
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ln.nproc_per_node)))
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the parent each worker must still have
    log.info("starting %d worker(s) on node %d of %d (rendezvous %s:%d)", ln.nproc_per_node,
             ln.node_rank, ln.nnodes, addr, port)
    started_ns = time.time_ns()  # failure marks older than this are an earlier attempt's
    with _workers_stop_first() as forwarder:
        try:
            elastic_launch(config, sys.executable)("-u", "-m", "rapidformer.cli.worker",
                                                   "--worker", str(config_file), str(run_dir))
        except SignalException as exc:
            error = _after_signal(run_dir, exc.sigval, forwarder, ln, started_ns)
            if error is not None:
                raise error from exc
        except ChildFailedError as exc:
            if all(f.exitcode == EXIT_PREEMPTED for f in exc.failures.values()):
                raise _preempted(run_dir, "a signal") from exc
            marks = failure_marks(run_dir, started_ns)
            rank = first_failure(exc.failures, {r: at for r, (at, _) in marks.items()})
            failure = exc.failures[rank]
            raise WorkerFailed(rank, failure.exitcode,
                               _log_tail(run_dir, rank // ln.nproc_per_node, failure.local_rank),
                               describe_laggards(run_dir), ln, marked=rank in marks,
                               marked_exit=marks.get(rank, (0, 1))[1]) from exc


def _preempted(run_dir: Path, cause: str, exit_code: int = EXIT_PREEMPTED):
    from rapidformer.runtime.preemption import newest_checkpoint, preempted

    newest = newest_checkpoint(run_dir / "checkpoints")
    return preempted(cause, f"the newest complete checkpoint is {newest}" if newest
                     else "no complete checkpoint was written", run_dir, exit_code)


# --- a stop signal to the launcher -------------------------------------------------------------
Ranks = tuple[int | None, int | None]  # a worker's RANK and LOCAL_RANK (None: not known)


class StopForwarder:
    """The launcher's SIGTERM/SIGINT handler, in place of torch elastic's own (which forwards the
    signal and kills the workers 30 s later, whether or not their checkpoint is written, and
    keeps no exit codes): pass the signal on to each worker's process group, wait for every
    worker to exit, or for one to fail (reading exit codes without reaping: torch elastic still
    does), then let elastic's handler end the job. A second signal more than SAME_EVENT_S after
    the first is passed on too (the workers then exit at once) and stops the wait."""

    def __init__(self, elastic_handler: Callable,
                 find_workers: Callable[[], dict[int, Ranks]] | None = None):
        self.elastic_handler = elastic_handler
        self.find_workers = find_workers or own_workers
        self.signum: int | None = None
        self.second: int | None = None
        self.workers: dict[int, Ranks] = {}  # pid -> (rank, local rank)
        self.known: dict[int, Ranks] = {}  # the workers seen while they ran (remember())
        self.exits: dict[int, int] = {}  # pid -> exit code, -N for signal N (as Popen has it)
        self._first = 0.0

    def __call__(self, signum: int, frame) -> None:
        from rapidformer.runtime.preemption import SAME_EVENT_S, SIGNALS

        if signum not in SIGNALS:  # SIGHUP, SIGQUIT: torch elastic's way
            return self.elastic_handler(signum, frame)
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first = signum, now
            self.workers = self.find_workers()
            self._forward(signum)
            self.workers.update(self._exited_unreaped())
            log.warning("received %s: passed on to %d worker(s); waiting for them to finish the "
                        "step, write a checkpoint and stop (send it again to stop at once)",
                        name, len(self.workers))
            self._wait(signum)  # a second signal may interrupt this wait
            return self.elastic_handler(signum, frame)
        if now - self._first > SAME_EVENT_S:
            self.second = signum
            self._forward(signum)
            log.warning("received %s again: the workers stop at once, without a checkpoint",
                        name)
            return self.elastic_handler(signum, frame)
        return None  # the same request again (a terminal's and a scheduler's copy)

    def remember(self) -> None:
        """Note the workers running now: one that exits before a stop signal, and is not yet
        reaped, has no environment left to read its ranks from."""
        self.known.update(self.find_workers())

    def _exited_unreaped(self) -> dict[int, Ranks]:
        """The remembered workers that have exited and are still this process's children (not
        yet seen by torch elastic's monitor): their failure must end the wait too."""
        found = {}
        for pid, ranks in list(self.known.items()):  # remember() may add to it meanwhile
            if pid not in self.workers:
                exited, code = exit_code_of(pid)
                if exited and code is not None:
                    found[pid] = ranks
        return found

    def _wait(self, signum: int) -> None:
        """Until every worker has exited, or one has failed: the others may then wait for it in
        a collective that never completes (torch elastic's handler stops them)."""
        running = set(self.workers)
        while running:
            for pid in sorted(running):
                exited, code = exit_code_of(pid)
                if not exited:
                    continue
                running.discard(pid)
                if code is None:  # not a child of this process (any more)
                    continue
                self.exits[pid] = code
                if code not in (0, EXIT_PREEMPTED, -signum):
                    return
            if running:
                time.sleep(0.05)

    def _forward(self, signum: int) -> None:
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)  # the worker and its DataLoader workers, as elastic does

    def exit_codes(self) -> dict[int, tuple[int, int | None]]:
        """rank -> (exit code, local rank) of the workers that exited after the signal."""
        return {rank: (code, local_rank) for pid, code in self.exits.items()
                for rank, local_rank in [self.workers[pid]] if rank is not None}


def own_workers() -> dict[int, Ranks]:
    """This process's children that lead a process group of their own (torch elastic starts each
    worker in a session of its own): pid -> (RANK, LOCAL_RANK) from their environment. Linux
    (/proc) only; elsewhere none, and torch elastic's own handling stays."""
    me, found = os.getpid(), {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            stat = Path("/proc", name, "stat").read_text()
            ppid, group = (int(v) for v in stat[stat.rindex(")") + 2:].split()[1:3])
            if ppid != me or group != int(name):
                continue
            env = dict(e.split(b"=", 1) for e in
                       Path("/proc", name, "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        found[int(name)] = tuple(int(env[k]) if env.get(k, b"").isdigit() else None
                                 for k in (b"RANK", b"LOCAL_RANK"))
    return found


def exit_code_of(pid: int) -> tuple[bool, int | None]:
    """Whether child `pid` has exited, and its exit code (-N: killed by signal N), leaving it
    to be reaped by its Popen; (True, None) when it is not a child of this process (any
    more)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:
        return True, None
    if info is None:  # still running
        return False, None
    return True, info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


@contextlib.contextmanager
def _workers_stop_first():
    """While the workers run: a stop signal to the launcher is the StopForwarder's (None where
    it cannot be: no /proc, or a torch elastic without the handler it replaces). The signal
    handlers torch elastic installs are removed afterwards."""
    from torch.distributed.elastic.multiprocessing import api

    elastic_handler = getattr(api, "_terminate_process_handler", None)
    usable = (elastic_handler is not None and hasattr(os, "waitid") and hasattr(os, "WNOWAIT")
              and os.path.isdir("/proc"))
    forwarder = StopForwarder(elastic_handler) if usable else None
    main = threading.current_thread() is threading.main_thread()
    handled = [s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None),
                           getattr(signal, "SIGQUIT", None)) if s is not None]
    before = {s: signal.getsignal(s) for s in handled} if main else {}
    done = threading.Event()
    if forwarder is not None:
        api._terminate_process_handler = forwarder  # what elastic installs at each (re)start
        threading.Thread(target=_remember_workers, args=(forwarder, done), daemon=True,
                         name="rapidformer-workers").start()
    try:
        yield forwarder
    finally:
        done.set()
        if forwarder is not None:
            api._terminate_process_handler = elastic_handler
        for sig, handler in before.items():
            if handler is not None:
                signal.signal(sig, handler)


def _remember_workers(forwarder: StopForwarder, done: threading.Event,
                      every_s: float = 0.5) -> None:
    while not done.wait(every_s):
        forwarder.remember()


def _after_signal(run_dir: Path, sigval: int, forwarder: StopForwarder | None,
                  ln, started_ns: int = 0) -> RapidformerError | None:
    """What a stop signal to the launcher ended in: Preempted when every worker stopped (exit
    75 after its checkpoint, or ended by the signal itself outside the training loop),
    WorkerFailed for a worker that failed while stopping, None when they had all finished."""
    name = signal.Signals(sigval).name
    if forwarder is None or forwarder.signum is None:  # torch elastic's own handling
        # SIGHUP, SIGQUIT: the workers end at once, without a checkpoint of this step
        return _preempted(run_dir, name, EXIT_PREEMPTED if sigval in (signal.SIGTERM,
                                                                      signal.SIGINT)
                          else 128 + sigval)
    if forwarder.second is not None:
        return _preempted(run_dir, f"a second {signal.Signals(forwarder.second).name}",
                          128 + forwarder.second)
    name = signal.Signals(forwarder.signum).name
    codes = forwarder.exit_codes()
    if codes and all(code == 0 for code, _ in codes.values()):
        log.info("received %s after the workers had finished", name)
        return None
    marks = failure_marks(run_dir, started_ns)
    # the signal itself ended a worker that was outside the training loop (starting, exporting):
    # stopped, with no checkpoint of this step
    ended = {rank for rank, (code, _) in codes.items()
             if code == -forwarder.signum and rank not in marks}
    failed = {rank: v for rank, v in codes.items()
              if v[0] not in (0, EXIT_PREEMPTED) and rank not in ended}
    if not failed:
        return _preempted(run_dir, f"{name} (it ended {len(ended)} worker(s) outside the "
                                   f"training loop)" if ended else name)
    rank = min(failed, key=lambda r: (marks[r][0] if r in marks else float("inf"), r))
    code, local_rank = failed[rank]
    tail = _log_tail(run_dir, rank // ln.nproc_per_node if ln is not None else None,
                     local_rank or 0)
    return WorkerFailed(rank, code, tail, "", ln,
                        marked=rank in marks, marked_exit=marks.get(rank, (0, 1))[1],
                        context=f" while stopping for {name}")


# --- a failed worker ---------------------------------------------------------------------------
SIGNAL_HINTS = {"SIGKILL": "often the out-of-memory killer",
                "SIGSEGV": "a crash in native code", "SIGABRT": "an abort in native code",
                "SIGBUS": "often shared memory (/dev/shm) or a memory-mapped file that ran out"}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def first_failure(failures: dict, marks: dict[int, int]) -> int:
    """The rank that failed first, of torch elastic's failures (rank -> .exitcode, .timestamp).

    A rank's own mark (rank_progress.mark_failed, in nanoseconds) says when its code failed.
    A rank killed by a signal leaves no mark; elastic stamps it with the second it saw the exit
    (every 0.2 s it looks). SIGKILL comes from outside the job (the out-of-memory killer, a
    user, a scheduler; elastic's own only 30 s after the failure it stops the job for), never
    as the consequence of a peer's failure, so it counts from one second before that stamp: it
    goes before the errors it caused on its peers ("Connection reset by peer"). Exits that are
    the launcher's stopping of the others (75 after its SIGTERM, or SIGTERM without a mark)
    count only when nothing else failed."""
    def stopped_by_launcher(rank: int, failure) -> bool:
        return failure.exitcode == EXIT_PREEMPTED or (
            rank not in marks and failure.exitcode == -signal.SIGTERM)

    def when(rank: int, failure) -> int:
        if rank in marks:
            return marks[rank]
        seen = failure.timestamp * 10**9
        return seen - 10**9 if failure.exitcode == -signal.SIGKILL else seen

    causes = [r for r, f in failures.items() if not stopped_by_launcher(r, f)] or list(failures)
    return min(causes, key=lambda r: (when(r, failures[r]), r))


class WorkerFailed(RapidformerError):
    """A worker ended the job: `exit_code` as torch elastic has it (-N: killed by signal N);
    `marked`: its own code had failed first, choosing `marked_exit` (a signal then only ended
    its process, and the job exits with the code the worker chose)."""

    def __init__(self, rank: int, exit_code: int, tail: str, laggards: str = "",
                 launcher=None, marked: bool = False, context: str = "", marked_exit: int = 1):
        if exit_code > 0:
            self.exit_code, how = exit_code, f"failed with exit code {exit_code}"
        elif exit_code < 0 and marked:
            self.exit_code = marked_exit
            how = f"failed (its process then ended by {signal_name(-exit_code)})"
        elif exit_code < 0:
            name = signal_name(-exit_code)
            hint = f"; {SIGNAL_HINTS[name]}" if name in SIGNAL_HINTS else ""
            self.exit_code = 128 - exit_code
            how = f"was killed by {name} (signal {-exit_code}{hint})"
        else:
            self.exit_code, how = 1, "failed with exit code 0"
        detail = f"\n{tail}" if tail else ""
        cause = ""
        if laggards:
            cause = (f" {laggards}. If that rank was only slow (a long evaluation or save on it "
                     f"alone), raise launcher.collective_timeout="
                     f"{launcher.collective_timeout if launcher else '...'}.")
        restarts = (f" ({launcher.max_restarts} restart(s) of launcher.max_restarts used)"
                    if launcher is not None and launcher.max_restarts else "")
        super().__init__(f"worker rank {rank} {how}{context}; the whole job was stopped"
                         f"{restarts}.{cause} Its last output:{detail}")


def _log_tail(run_dir: Path, node_rank: int | None, local_rank: int, lines: int = 8) -> str:
    """The end of this node's worker's stderr (its traceback or error), or of its stdout (its
    log lines) when it wrote nothing there: a rank killed by a signal. `node_rank`: the failed
    rank's node (global rank // nproc_per_node; another node's worker of the same local rank
    writes beside it on a shared file system), None: any node's."""
    node = "node*" if node_rank is None else f"node{node_rank}"
    for stream in ("stderr", "stdout"):
        logs = sorted((run_dir / "logs").glob(f"{node}/*/attempt_*/{local_rank}/{stream}.log"),
                      key=lambda p: p.stat().st_mtime)
        text = logs[-1].read_text(errors="replace").strip().splitlines() if logs else []
        if text:
            return "\n".join(f"  | {line}" for line in text[-lines:])
    return ""


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
        megatron_groups = sys.modules.get("megatron.core.parallel_state")
        if megatron_groups is not None and megatron_groups.model_parallel_is_initialized():
            # megatron-core keeps its groups too: the next Megatron job of a sweep in this
            # process would otherwise reuse groups of the destroyed default group
            megatron_groups.destroy_model_parallel()
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
    # the launcher's pid from the launcher itself: read here, os.getppid() would already be
    # the reaper's pid when the launcher died while this worker was starting
    from rapidformer.runtime.parent_death import die_with

    die_with(int(os.environ.get(LAUNCHER_PID) or os.getppid()))
