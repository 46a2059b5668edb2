"""A worker of a launched job (`python -m rapidformer.cli.worker --worker RUN_DIR/config.yaml
RUN_DIR`, started by rapidformer.runtime.launch): read the resolved config the parent wrote,
and run it."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import yaml

from rapidformer.config.schema import RunConfig
from rapidformer.config.validate import build_run_config
from rapidformer.errors import Preempted, RapidformerError, debug_enabled, out_of_memory
from rapidformer.factory import run
from rapidformer.runtime.fast_exit import install as exit_fast
from rapidformer.runtime.launch import die_with_launcher, is_collective_timeout, resume_after_restart
from rapidformer.runtime.rank_progress import clear_failed, mark_failed, mark_timed_out


def worker_main(config_file: str, run_dir: str | None = None) -> None:
    """A worker: read the resolved config the parent wrote, and run it in `run_dir` (by default
    the config file's folder)."""
    die_with_launcher()
    exit_fast()  # the error exits; a finished run leaves through os._exit below
    rank = int(os.environ.get("RANK", 0))
    # log lines on stdout, as Hydra's console handler has them in the launcher and in a
    # single-process run or sweep; rapidformer's own messages go to stderr in all of them
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"[%(asctime)s][rank {rank}][%(levelname)s] - %(message)s")
    resolved = yaml.safe_load(Path(config_file).read_text())
    cfg = build_run_config(resolved)
    run_dir = Path(run_dir) if run_dir else Path(config_file).parent
    clear_failed(run_dir, rank)
    try:
        _run_worker(cfg, run_dir, resolved, rank)
    except BaseException as exc:
        # Ctrl-C before the training loop handles it (the launcher forwards it while the worker
        # starts): a stop, which the launcher reports as one, not a failure
        stopped = isinstance(exc, KeyboardInterrupt) or \
            (isinstance(exc, SystemExit) and exc.code in (0, None))
        if not stopped:
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            mark_failed(run_dir, rank, code)  # the launcher names the rank that failed first
        raise
    # The run is complete: files closed, process group left together. Skip the interpreter's
    # teardown, where a native thread of the collective library has been seen to abort a
    # finished worker (SIGABRT, "terminate called without an active exception") and with it
    # a successful job.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_worker(cfg: RunConfig, run_dir: Path, resolved: dict, rank: int) -> None:
    resume_after_restart(cfg, run_dir, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    try:
        run(cfg, str(run_dir), resolved)
    except RapidformerError as exc:
        if debug_enabled():
            raise
        # a stop that was asked for (SIGTERM, SIGINT) is not an error
        kind = "stopped" if isinstance(exc, Preempted) else "error"
        print(f"rapidformer: {kind} (rank {rank}): {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Exception as exc:
        if (oom := out_of_memory(exc)) is not None and not debug_enabled():
            print(f"rapidformer: error (rank {rank}): {oom}", file=sys.stderr)
            sys.exit(oom.exit_code)
        if debug_enabled() or not is_collective_timeout(exc):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        mark_timed_out(run_dir, rank)
        print(f"rapidformer: error (rank {rank}): a collective operation did not complete within "
              f"launcher.collective_timeout={cfg.launcher.collective_timeout} s: another rank "
              f"stopped responding ({first_line})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--worker":
        worker_main(*sys.argv[2:])
    else:
        sys.exit("usage: python -m rapidformer.cli.worker --worker CONFIG_FILE [RUN_DIR] (started "
                 "by python -m rapidformer; not meant to be run by hand)")
