"""Signals the way schedulers and the kernel send them: SIGTERM to a whole process group (DataLoader
workers included) still stops the run at a step boundary with a checkpoint and exit code 75, the
launcher passes a stop signal on and waits for its workers, a worker killed by a signal is
named with it, and the stop message names the run directory to resume."""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rapidformer.checkpoint import store as checkpoint
from rapidformer.errors import EXIT_PREEMPTED
from tests.conftest import FAST, OFFLINE_ENV, run_cli, train_losses

# timing-sensitive (deadlines, signals at moments): run alone, after the parallel tests
pytestmark = pytest.mark.serial

ARGS = [*FAST, "scheduler=constant", "scheduler.warmup_fraction=null", "trainer.export_hf=false",
        "data.num_workers=1"]


def start_in_own_group(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rapidformer", *args], cwd=cwd,
                            env={**os.environ, **OFFLINE_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_training(find_run, process: subprocess.Popen, step: int = 3,
                      limit: float = 240) -> Path:
    """The run directory, once its metrics show `step`."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        run = find_run()
        if run is not None and (run / "metrics.jsonl").is_file() and \
                max(train_losses(run), default=0) >= step:
            return run
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the run did not reach step {step} in {limit} s")


def _communicate_or_fail(process: subprocess.Popen, limit: float) -> tuple[str, str]:
    """The process's output once it exits; past `limit` seconds a failure that shows what it had
    printed (the workers of a launcher are in sessions of their own and may hold the pipes)."""
    try:
        return process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        try:
            out, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired as late:
            out, err = (v.decode(errors="replace") if v else "" for v in (late.stdout,
                                                                           late.stderr))
        pytest.fail(f"no exit within {limit} s of the signal\n--- stdout:\n{out[-4000:]}"
                    f"\n--- stderr:\n{err[-4000:]}")


def the_only_run(root: Path):
    def find() -> Path | None:
        runs = [p.parent for p in root.glob("outputs/*/*/metrics.jsonl")]
        return runs[0] if len(runs) == 1 else None
    return find


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_process_group_sigterm_with_loader_workers_checkpoints_and_exits_75(tmp_path, nproc):
    """`kill -TERM -PGID` reaches the DataLoader workers too (one process), or the launcher
    passes it on to each worker's whole group (two): the loader workers must leave it to the
    process that trains. With the default, timestamped run directory, the advice printed names
    it, and following it continues the run there."""
    launcher = [f"launcher.nproc_per_node={nproc}"]
    process = start_in_own_group([*ARGS, *launcher, "trainer.train_iters=100000"], tmp_path)
    try:
        run = wait_for_training(the_only_run(tmp_path), process)
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = _communicate_or_fail(process, 120)
    finally:  # nothing of the group left behind, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr and "DataLoader worker" not in stderr, stderr[-3000:]
    complete, broken = checkpoint.scan(run / "checkpoints")
    assert complete and not broken
    assert json.loads((run / "status.json").read_text())["status"] == "preempted"
    advice = f"to continue, add trainer.output_dir={run.absolute()} trainer.resume=auto to the " \
             f"same command (exit code 75)"
    assert advice in stderr, stderr[-3000:]
    if nproc == 2:
        return  # two processes' resume: tests/test_preemption.py
    stopped_at = int(complete[-1].name.split("_")[1])
    added = shlex.split(stderr.split("to continue, add ")[1].split(" to the same command")[0])
    resumed = run_cli([*ARGS, *launcher, f"trainer.train_iters={stopped_at + 2}", *added],
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step_{stopped_at:08d}" in resumed.stdout + resumed.stderr
    assert max(train_losses(run)) == stopped_at + 2
    assert the_only_run(tmp_path)() == run  # no second run directory


def test_a_worker_killed_by_sigkill_is_named_with_the_signal(tmp_path):
    """The out-of-memory killer's way: rank 1 gets SIGKILL; rank 0 then fails in a collective
    and gets the launcher's SIGTERM. The job names rank 1 and the signal, and exits 128 + 9."""
    script = tmp_path / "oom.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        from rapidformer import RapidformerEngine
        from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


        class Killed(SequenceClassificationFinetuner):
            calls = 0

            def run_forward_step(self, batch, model):
                Killed.calls += 1
                if self.engine.rank == 1 and Killed.calls == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return super().run_forward_step(batch, model)


        Killed(engine=RapidformerEngine()).train()
    """))
    result = run_cli([f"user_script={script}", *FAST, "launcher.nproc_per_node=2",
                      "trainer.export_hf=false", "trainer.train_iters=6",
                      f"trainer.output_dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr[-3000:]
    assert "rapidformer: error: worker rank 1 was killed by SIGKILL (signal 9; often the " \
           "out-of-memory killer); the whole job was stopped" in result.stderr, \
        result.stderr[-3000:]


# --- the parts, one by one -----------------------------------------------------------------------
class _Probe(torch.utils.data.Dataset):
    """What a loader worker's start left it: both stop signals ignored, neither blocked, the
    user's own init run."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return (signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
                not blocked & {signal.SIGTERM, signal.SIGINT},
                os.environ.get("USERS_INIT_RAN") == "yes")


def _users_init(worker_id: int) -> None:
    os.environ["USERS_INIT_RAN"] = "yes"


def _python(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A fresh interpreter (nothing has fixed its start method or started helper processes)
    that imports this repository and modules in `cwd`."""
    path = [str(p) for p in (cwd, Path(__file__).parents[1]) if p is not None]
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})


@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver"])
def test_loader_workers_leave_stop_signals_to_the_main_process_and_run_the_users_init(start):
    from rapidformer.runtime.loader_workers import DataLoader, ignore_stop_signals, \
        loader_worker_init

    assert loader_worker_init() is ignore_stop_signals
    composed = loader_worker_init(_users_init)
    assert loader_worker_init(composed) is composed
    pickle.dumps(composed)  # a spawned worker gets it pickled
    for init_fn, users_ran in [(None, False), (_users_init, True), (composed, True)]:
        loader = DataLoader(_Probe(), batch_size=None, num_workers=1, worker_init_fn=init_fn,
                            multiprocessing_context=start)
        assert [tuple(map(bool, b)) for b in loader] == [(True, True, True, users_ran)] * 2
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # this process: untouched
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGTERM, signal.SIGINT}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_a_loader_worker_starts_leaves_it_working(tmp_path, monkeypatch, sig):
    """torch's worker loop installs its own SIGTERM handler (death) before it runs the init
    function: a group's signal in between took the worker down. The window is widened here
    (forked workers inherit the patch), and the signal comes from another process, as a
    scheduler's does."""
    from torch.utils.data._utils import signal_handling

    from rapidformer.runtime.loader_workers import DataLoader

    starting, original = tmp_path / "starting", signal_handling._set_worker_signal_handlers

    def slow_start(*args):
        original(*args)
        starting.write_text(str(os.getpid()))
        time.sleep(1.5)

    monkeypatch.setattr(signal_handling, "_set_worker_signal_handlers", slow_start)
    batches = iter(DataLoader(_Probe(), batch_size=None, num_workers=1))
    deadline = time.monotonic() + 30
    while not starting.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    subprocess.run([sys.executable, "-c", f"import os; os.kill({starting.read_text()}, {sig})"],
                   check=True, timeout=30)
    assert [tuple(map(bool, b)) for b in batches] == [(True, True, True, False)] * 2


SLOW_START = """
import os, signal, sys, time
import torch


class SlowStart(torch.utils.data.Dataset):
    \"\"\"Unpickled slowly in a spawned or fork-server worker, before torch's worker loop runs;
    its pid is written first.\"\"\"

    def __init__(self, flag):
        self.flag = flag

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.flag, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(1.5)

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
"""

COLD_START = """
import multiprocessing, os, signal, sys, threading, time
from slow_start import SlowStart
from rapidformer.runtime.loader_workers import DataLoader


def signal_it(flag):
    while not os.path.exists(flag):
        time.sleep(0.01)
    time.sleep(0.05)
    os.kill(int(open(flag).read()), signal.SIGTERM)


if __name__ == "__main__":
    multiprocessing.set_start_method(sys.argv[1])
    for epoch in range(2):  # a fresh process: the first loader starts the helper processes
        flag = f"started_{epoch}"
        batches = iter(DataLoader(SlowStart(flag), batch_size=None, num_workers=1))
        threading.Thread(target=signal_it, args=(flag,), daemon=True).start()
        print([bool(b) for b in batches], flush=True)
"""


def test_a_stop_signal_while_a_spawned_loader_worker_starts_leaves_it_working(tmp_path):
    """A spawned worker is exposed for its whole interpreter start (seconds), and
    multiprocessing's resource tracker unblocks the signals as it starts: in a fresh process,
    a SIGTERM to each epoch's worker while it is unpickled must not end it."""
    (tmp_path / "slow_start.py").write_text(SLOW_START)
    (tmp_path / "cold_start.py").write_text(COLD_START)
    result = _python(["cold_start.py", "spawn"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[True, True]"] * 2, result.stderr[-3000:]


AFTER_A_FORKSERVER_LOADER = """
import multiprocessing, time
import torch
from rapidformer.runtime.loader_workers import DataLoader

if __name__ == "__main__":
    multiprocessing.set_start_method("forkserver")
    assert list(DataLoader(torch.arange(2), batch_size=None, num_workers=1)) == [0, 1]
    later = multiprocessing.Process(target=time.sleep, args=(60,))
    later.start()
    time.sleep(0.5)
    later.terminate()
    later.join(20)
    print(later.exitcode)
"""


def test_a_fork_server_the_user_chose_is_left_as_it_was(tmp_path):
    """Workers of a fork server inherit its signal mask: one started blocked would leave every
    later process of it (the user's own too) deaf to SIGTERM, so a loader on a fork server the
    user chose blocks nothing (its workers are exposed while they start, as torch's are)."""
    script = tmp_path / "after_loader.py"
    script.write_text(AFTER_A_FORKSERVER_LOADER)
    result = _python([str(script)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(-signal.SIGTERM)]


def test_the_loaders_fork_where_a_fork_server_is_only_pythons_default(monkeypatch):
    """Python 3.14 on Linux starts processes through a fork server unless told otherwise; the
    loaders then fork, as Python did before, so that their workers start protected."""
    import multiprocessing

    from rapidformer.runtime.loader_workers import DataLoader

    monkeypatch.setattr(multiprocessing, "get_all_start_methods",
                        lambda: ["forkserver", "fork", "spawn"])
    for chosen, given, workers, used in [
            (None, None, 1, "fork"), ("forkserver", None, 1, None), (None, "spawn", 1, "spawn"),
            (None, "forkserver", 1, "forkserver"), (None, None, 0, None)]:
        monkeypatch.setattr(multiprocessing, "get_start_method",
                            lambda allow_none=False, chosen=chosen: chosen)
        loader = DataLoader(_Probe(), batch_size=None, num_workers=workers,
                            multiprocessing_context=given)
        context = loader.multiprocessing_context
        assert (context and context.get_start_method()) == used, (chosen, given, workers)
        assert len(list(loader)) == 2


def test_a_loader_without_workers_leaves_the_start_method_unfixed():
    """Iterating must not fix multiprocessing's default start method: the user's later
    set_start_method would fail."""
    result = _python(["-c", textwrap.dedent("""
        import multiprocessing
        from rapidformer.runtime.loader_workers import DataLoader
        assert list(DataLoader(list(range(3)), batch_size=None)) == [0, 1, 2]
        assert multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("spawn")
    """)])
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_stop_signal_held_back_while_workers_start_reaches_the_process_after():
    from rapidformer.runtime.loader_workers import stop_signals_blocked

    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with stop_signals_blocked():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


CHILD = """
import signal, sys, time
def stop(signum, frame):
    print("got", signum, flush=True)
    {action}
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _children(*actions: str) -> list[subprocess.Popen]:
    children = [subprocess.Popen([sys.executable, "-c", CHILD.format(action=action)],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
                for action in actions]
    for child in children:
        assert child.stdout.readline() == "ready\n"
    return children


def _lines(child: subprocess.Popen, count: int, limit: float = 20) -> list[str]:
    """The child's next `count` lines of output, or what came within `limit` seconds."""
    text, deadline = b"", time.monotonic() + limit
    while text.count(b"\n") < count and time.monotonic() < deadline:
        if select.select([child.stdout], [], [], 0.1)[0]:
            text += os.read(child.stdout.fileno(), 4096)  # past the (empty) line buffer
    return text.decode().splitlines(keepends=True)


class _Ended(Exception):
    pass


def _elastic_handler(signum, frame):
    raise _Ended(signum)


def test_the_launcher_passes_a_stop_signal_on_and_waits_for_its_workers():
    from rapidformer.runtime.launch import StopForwarder

    slow, quick = _children("time.sleep(1.0); sys.exit(75)", "sys.exit(75)")
    try:
        forwarder = StopForwarder(_elastic_handler, lambda: {slow.pid: (0, 0),
                                                             quick.pid: (1, 1)})
        started = time.monotonic()
        with pytest.raises(_Ended):
            forwarder(signal.SIGTERM, None)
        assert time.monotonic() - started >= 1.0  # it waited for the slow one's "checkpoint"
        assert forwarder.exit_codes() == {0: (75, 0), 1: (75, 1)}
        # still theirs to reap, with their codes (torch elastic's Popen objects do)
        assert (slow.wait(5), quick.wait(5)) == (75, 75)
        assert slow.stdout.read() == f"got {signal.SIGTERM.value}\n"
    finally:
        for child in (slow, quick):
            child.kill()
            child.wait()


def _the_wait_ends_naming_rank_1(forwarder, stuck: subprocess.Popen, code_of, tmp_path: Path):
    """A stop signal to `forwarder` returns within seconds though `stuck` (rank 0) never exits,
    and the job is rank 1's failure, with the exit code `code_of()`."""
    from rapidformer.runtime.launch import WorkerFailed, _after_signal

    started = time.monotonic()
    with pytest.raises(_Ended):
        forwarder(signal.SIGTERM, None)
    assert time.monotonic() - started < 5
    assert stuck.poll() is None  # left to torch elastic's handler to stop
    assert forwarder.exit_codes() == {1: (code_of(), 1)}
    failed = _after_signal(tmp_path, signal.SIGTERM, forwarder, None)
    assert isinstance(failed, WorkerFailed) and "worker rank 1 " in str(failed)


@pytest.mark.parametrize("failure", ["sys.exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_worker_that_fails_while_stopping_ends_the_launchers_wait(tmp_path, failure):
    """A rank that fails while the others stop (its loader broke, it ran out of memory) leaves
    them waiting for it in a collective: the launcher must not wait for them forever."""
    from rapidformer.runtime.launch import StopForwarder

    stuck, failing = _children("pass", f"import os; {failure}")
    try:
        forwarder = StopForwarder(_elastic_handler, lambda: {stuck.pid: (0, 0),
                                                             failing.pid: (1, 1)})
        _the_wait_ends_naming_rank_1(forwarder, stuck, lambda: failing.wait(5), tmp_path)
    finally:
        for child in (stuck, failing):
            child.kill()
            child.wait()


def test_a_worker_that_failed_just_before_the_signal_ends_the_wait_too(tmp_path):
    """A rank that exited before the signal, not yet reaped by torch elastic's monitor, has no
    environment left to name its ranks by: the launcher remembers its workers while they run."""
    from rapidformer.runtime.launch import StopForwarder

    stuck, failed = _children("pass", "pass")
    try:
        alive = {stuck.pid: (0, 0), failed.pid: (1, 1)}
        forwarder = StopForwarder(_elastic_handler, lambda: dict(alive))
        forwarder.remember()
        failed.send_signal(signal.SIGUSR1)  # its default action: the process ends
        while not os.waitid(os.P_PID, failed.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG):
            time.sleep(0.01)
        del alive[failed.pid]  # what /proc shows of a zombie: no environment
        _the_wait_ends_naming_rank_1(forwarder, stuck, lambda: -signal.SIGUSR1, tmp_path)
    finally:
        for child in (stuck, failed):
            child.kill()
            child.wait()


def test_a_second_stop_signal_to_the_launcher_stops_its_wait(monkeypatch):
    from rapidformer.runtime import preemption
    from rapidformer.runtime.launch import StopForwarder

    monkeypatch.setattr(preemption, "SAME_EVENT_S", 0.3)
    (stubborn,) = _children("pass")  # a worker that never reaches its step boundary
    forwarder = StopForwarder(_elastic_handler, lambda: {stubborn.pid: (0, 0)})
    previous = signal.signal(signal.SIGTERM, forwarder)
    main = threading.main_thread().ident
    # while the handler waits, only a signal to this (the main) thread interrupts the wait
    again = [threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGTERM)),  # same request
             threading.Timer(0.8, signal.pthread_kill, (main, signal.SIGTERM))]  # a second one
    try:
        started = time.monotonic()
        with pytest.raises(_Ended):
            for timer in again:
                timer.start()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        assert time.monotonic() - started < 5
        assert forwarder.second == signal.SIGTERM and forwarder.exits == {}
        # the first and the second request reached it, the same request's copy did not
        assert _lines(stubborn, 2) == [f"got {signal.SIGTERM.value}\n"] * 2
    finally:
        for timer in again:
            timer.join()
        signal.signal(signal.SIGTERM, previous)
        stubborn.kill()
        stubborn.wait()
    assert stubborn.stdout.read() == ""


def test_what_the_workers_exit_codes_after_a_stop_signal_make_of_the_job(tmp_path):
    from rapidformer.errors import Preempted
    from rapidformer.runtime.launch import StopForwarder, WorkerFailed, _after_signal

    def after(*codes: int):
        forwarder = StopForwarder(_elastic_handler, dict)
        forwarder.signum = signal.SIGTERM
        forwarder.workers = {100 + rank: (rank, rank) for rank in range(len(codes))}
        forwarder.exits = {100 + rank: code for rank, code in enumerate(codes)}
        return _after_signal(tmp_path, signal.SIGTERM, forwarder, None)

    stopped = after(EXIT_PREEMPTED, EXIT_PREEMPTED)
    assert isinstance(stopped, Preempted) and stopped.exit_code == EXIT_PREEMPTED
    assert f"add trainer.output_dir={tmp_path} trainer.resume=auto" in str(stopped)
    # a worker that was exporting (no handler of its own any more) is ended by the signal
    assert isinstance(after(EXIT_PREEMPTED, -signal.SIGTERM), Preempted)
    failed = after(EXIT_PREEMPTED, 1)
    assert isinstance(failed, WorkerFailed) and failed.exit_code == 1
    assert str(failed).startswith("worker rank 1 failed with exit code 1 while stopping for "
                                  "SIGTERM")
    assert after(0, 0) is None  # they had finished: the job succeeded


WORKER_THAT_RAISES = """
import sys
import rapidformer.cli.worker as worker

def raise_it(*args):
    raise {error}

worker.build_run_config = lambda resolved: None
worker._run_worker = raise_it
worker.worker_main(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("error, exit_code, marked", [
    ("KeyboardInterrupt", -signal.SIGINT, False),  # Ctrl-C while it starts: a stop
    ("RuntimeError('broken')", 1, True),
    ("SystemExit(3)", 3, True),
    ("SystemExit(0)", 0, False),
])
def test_a_worker_marks_failures_not_a_ctrl_c_while_it_starts(tmp_path, error, exit_code,
                                                                marked):
    """The launcher names a marked rank as failed; a SIGINT it forwarded before the training
    loop took the signal over ends the worker by KeyboardInterrupt, and the job is a stop."""
    from rapidformer.runtime.launch import StopForwarder, WorkerFailed, _after_signal
    from rapidformer.runtime.rank_progress import failure_marks

    (tmp_path / "config.yaml").write_text("{}\n")
    started_ns = time.time_ns()
    result = subprocess.run([sys.executable, "-c", WORKER_THAT_RAISES.format(error=error),
                             str(tmp_path / "config.yaml"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == exit_code, result.stderr[-2000:]
    assert (0 in failure_marks(tmp_path, started_ns)) == marked
    forwarder = StopForwarder(_elastic_handler, dict)
    forwarder.signum, forwarder.workers = signal.SIGINT, {100: (0, 0)}
    forwarder.exits = {100: result.returncode}
    outcome = _after_signal(tmp_path, signal.SIGINT, forwarder, None, started_ns)
    assert isinstance(outcome, WorkerFailed) == (exit_code not in (0, -signal.SIGINT))


def test_the_first_failure_is_the_signalled_rank_not_the_peer_it_took_down():
    from rapidformer.runtime.launch import WorkerFailed, first_failure

    now = time.time()
    seen = int(now)  # torch elastic's stamp: the second it saw the exit
    # rank 1 got SIGKILL; rank 0's collective failed a moment later (its own mark), and the
    # launcher's SIGTERM then ended its process
    failures = {0: SimpleNamespace(exitcode=-15, timestamp=seen),
                1: SimpleNamespace(exitcode=-9, timestamp=seen)}
    assert first_failure(failures, {0: int(now * 1e9) + 10**6}) == 1
    # rank 1 exited 7; rank 0 only got the launcher's SIGTERM (no mark), or stopped with 75
    for stopped in (-15, EXIT_PREEMPTED):
        failures = {0: SimpleNamespace(exitcode=stopped, timestamp=seen),
                    1: SimpleNamespace(exitcode=7, timestamp=seen)}
        assert first_failure(failures, {1: int(now * 1e9)}) == 1
    # a rank that hung and was stopped is not the cause; the one that timed out first is
    failures = {0: SimpleNamespace(exitcode=1, timestamp=seen),
                1: SimpleNamespace(exitcode=-15, timestamp=seen - 5)}
    assert first_failure(failures, {0: int(now * 1e9)}) == 0

    killed = WorkerFailed(1, -9, "")
    assert killed.exit_code == 137
    assert str(killed).startswith("worker rank 1 was killed by SIGKILL (signal 9; often the "
                                  "out-of-memory killer); the whole job was stopped")
    after_error = WorkerFailed(0, -15, "", marked=True)
    assert after_error.exit_code == 1
    assert str(after_error).startswith("worker rank 0 failed (its process then ended by SIGTERM)")
    # a worker that refused its input (exit 2) and was then aborted in the interpreter's
    # teardown: the job still exits with the code the worker chose
    assert WorkerFailed(0, -6, "", marked=True, marked_exit=2).exit_code == 2
    assert WorkerFailed(1, 7, "").exit_code == 7


def test_an_earlier_attempts_failure_mark_does_not_name_this_ones_cause(tmp_path):
    """A worker killed before it clears its old mark (at start-up) leaves an earlier attempt's
    mark: the launcher counts only marks made since it started."""
    from rapidformer.runtime.launch import first_failure
    from rapidformer.runtime.rank_progress import failure_marks, failure_times, mark_failed
    from rapidformer.runtime.rank_progress import progress_dir

    started_ns = time.time_ns()
    progress_dir(tmp_path).mkdir(parents=True)  # the earlier attempt's rank 0 failed a minute ago
    (progress_dir(tmp_path) / "rank_0.failed_at").write_text(f"{started_ns - 60 * 10**9}\n")
    assert failure_times(tmp_path) and failure_times(tmp_path, started_ns) == {}
    assert failure_marks(tmp_path)[0][1] == 1  # a mark without a code: a failure, exit 1
    seen = int(time.time())
    failures = {0: SimpleNamespace(exitcode=-15, timestamp=seen),
                1: SimpleNamespace(exitcode=-9, timestamp=seen)}
    assert first_failure(failures, failure_times(tmp_path, started_ns)) == 1
    assert first_failure(failures, failure_times(tmp_path)) == 0  # what the stale mark did
    mark_failed(tmp_path, 1, 2)
    at, code = failure_marks(tmp_path, started_ns)[1]
    assert code == 2 and at >= started_ns
