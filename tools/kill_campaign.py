"""Kill a training run with SIGKILL at random moments, resume it each time, and check that the
final weights equal an uninterrupted run's.

    python tools/kill_campaign.py                       # 20 kills, 2 CPU processes (gloo), fp32
    python tools/kill_campaign.py --kills 3 --iters 24  # a short one (what the CI test runs)
    python tools/kill_campaign.py --set memory=zero2    # another memory mode

First an uninterrupted reference run; then the same command, started with
`trainer.resume=auto` again and again in one run directory. Each attempt is killed (SIGKILL to
the launcher and its workers, nothing can be flushed) after a random delay, or, for every
`--write-every`-th kill, the moment a checkpoint's temporary directory appears (a kill during
the write; one that comes after the write has finished counts as a kill, and the next one
aims at a write again). When the kills are done the last attempt runs to the end. Every
attempt must start from the newest complete checkpoint (never a half-written one), and the
exported weights must equal the reference's. Writes a JSON record (every kill: its delay, what the run was doing,
the step reached, the step resumed from, the steps lost) and prints a summary.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rapidformer.checkpoint import store as checkpoint  # noqa: E402

# a small deterministic fp32 job: checkpoints every 2 steps, one log line per step
BASE = ["+recipe=quickstart", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "trainer.log_interval=1", "trainer.save_interval=2", "trainer.keep_last=2",
        "trainer.deterministic=true", "precision=fp32", "data.synthetic_train_size=512",
        "data.synthetic_eval_size=32", "trainer.micro_batch_size=8",
        "trainer.global_batch_size=16", "trainer.eval_interval=null"]
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def command(args, run_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "rapidformer", *BASE, f"launcher.nproc_per_node={args.nproc}",
            f"trainer.train_iters={args.iters}", f"trainer.output_dir={run_dir}",
            *(["trainer.resume=auto"] if resume else []), *args.set]


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    # a session of its own: the kill reaches the launcher and every worker at once
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENV}, cwd=log_path.parent)


def last_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
             if line.strip().endswith("}")]
    return max(steps, default=0)


def newest_step(run_dir: Path) -> int:
    complete, _ = checkpoint.scan(run_dir / "checkpoints")
    return int(complete[-1].name.split("_")[1]) if complete else 0


def temp_dirs(run_dir: Path) -> set[tuple[str, int]]:
    """The checkpoint temporary directories there now, by name and inode (a step written
    again after a resume gets a new directory of the same name)."""
    try:
        return {(entry.name, entry.inode()) for entry in os.scandir(run_dir / "checkpoints")
                if entry.name.startswith(".tmp-")}
    except FileNotFoundError:
        return set()


def writing(run_dir: Path, stale: set[tuple[str, int]]) -> bool:
    """A checkpoint write of this attempt is in progress (not one an earlier kill left)."""
    return bool(temp_dirs(run_dir) - stale)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


PF_EXITING = 0x4  # the kernel's task flag: the process is being torn down


def alive(pid: int) -> bool:
    """Still able to run code: not gone, not a zombie, and not exiting (a killed process with
    many threads was seen taking over 10 s to be torn down on a loaded 2-core machine)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and not int(fields[6]) & PF_EXITING


def kill_attempt(process: subprocess.Popen, run_dir: Path, delay: float, during_write: bool,
                 limit: float, stale: set[tuple[str, int]]) -> tuple[str, float] | None:
    """Kill the attempt after `delay` s, or at its next checkpoint write; None if it ended
    first. Returns (what it was doing, seconds since start)."""
    started = time.monotonic()
    workers, listed = [], -1.0
    while True:
        now = time.monotonic() - started
        if process.poll() is not None:
            return None
        if now - listed > 0.2:
            # listed ahead of time: walking /proc between seeing a write and the kill gave a
            # small checkpoint's write time to finish first
            workers, listed = descendants(process.pid), now
        if during_write and writing(run_dir, stale):
            break
        if not during_write and now >= delay:
            break
        if now > limit:
            raise SystemExit(f"attempt ran {limit:.0f} s without a checkpoint write to kill")
        time.sleep(0.001 if during_write else 0.01)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher; its workers must die with it
    process.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers):
        if time.monotonic() > deadline:
            for pid in workers:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise SystemExit(f"workers {workers} outlived their killed launcher")
        time.sleep(0.05)
    phase = ("checkpoint write" if writing(run_dir, stale)
             else "training" if last_step(run_dir) else "start-up")
    return phase, round(time.monotonic() - started, 2)


def check_resume(log_path: Path, newest: int) -> None:
    """An attempt that got as far as loading a checkpoint loaded the newest complete one."""
    found = re.search(r"resumed from \S*step_(\d{8})", log_path.read_text(errors="replace"))
    if found and int(found.group(1)) != newest:
        raise SystemExit(f"{log_path.name}: resumed from step {int(found.group(1))}, but the "
                         f"newest complete checkpoint was step {newest}")
    if newest and not found and "step 1/" in log_path.read_text(errors="replace"):
        raise SystemExit(f"{log_path.name}: started over although step {newest} was saved")


def exported_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "hf_model" / "model.safetensors"))


def campaign(args) -> dict:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    reference = work / "reference"
    began = time.monotonic()
    result = subprocess.run(command(args, reference, resume=False), capture_output=True,
                            text=True, env={**os.environ, **ENV}, cwd=work)
    if result.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{result.stderr[-3000:]}")
    reference_s = time.monotonic() - began
    print(f"reference: {args.iters} steps in {reference_s:.1f} s", flush=True)

    run_dir = work / "killed"
    kills, attempt = [], 0
    # a kill aimed at a write that had finished first counts as a kill, and the next kill aims
    # at a write again
    retry_write = False
    while True:
        if len(kills) >= args.kills + 5:
            raise SystemExit(f"{len(kills)} kills, and the last 5 aimed at checkpoint writes "
                             f"all came after the write had finished: writes end too fast to "
                             f"be hit here")
        attempt += 1
        resumed_from = newest_step(run_dir)
        before = last_step(run_dir)
        stale = temp_dirs(run_dir)  # what earlier kills left: not this attempt's writes
        process = start(command(args, run_dir, resume=attempt > 1), work / f"attempt_{attempt}.log")
        if len(kills) >= args.kills and not retry_write:
            if process.wait() != 0:
                raise SystemExit(f"the final attempt failed: see {work}/attempt_{attempt}.log")
            break
        during_write = retry_write or (args.write_every > 0
                                       and (len(kills) + 1) % args.write_every == 0)
        # never later than most of an uninterrupted run: the attempt must still be running
        delay = rng.uniform(0.5, min(args.max_delay, 0.8 * reference_s))
        outcome = kill_attempt(process, run_dir, delay, during_write, limit=reference_s * 3,
                               stale=stale)
        if outcome is None:
            if process.returncode != 0:
                raise SystemExit(f"attempt {attempt} failed on its own: see "
                                 f"{work}/attempt_{attempt}.log")
            raise SystemExit(f"the run finished after {len(kills)} kills; raise --iters")
        phase, at = outcome
        retry_write = during_write and phase != "checkpoint write"
        reached = max(last_step(run_dir), before)
        check_resume(work / f"attempt_{attempt}.log", resumed_from)
        _, broken = checkpoint.scan(run_dir / "checkpoints")
        kills.append({"kill": len(kills) + 1, "at_s": at, "phase": phase,
                      "resumed_from_step": resumed_from, "step_reached": reached,
                      "newest_complete_after": newest_step(run_dir),
                      "steps_lost": reached - newest_step(run_dir),
                      "incomplete_dirs_seen": len(broken)})
        print(json.dumps(kills[-1]), flush=True)

    check_resume(work / f"attempt_{attempt}.log", resumed_from)
    expected, got = exported_weights(reference), exported_weights(run_dir)
    assert sorted(expected) == sorted(got)
    max_diff = max(float((expected[k].float() - got[k].float()).abs().max()) for k in expected)
    lost = [k["steps_lost"] for k in kills]
    summary = {"kills": len(kills), "resumes": attempt - 1, "completed": True,
               "kills_during_checkpoint_write": sum(k["phase"] == "checkpoint write"
                                                    for k in kills),
               "steps_lost_mean": round(sum(lost) / len(lost), 2) if lost else 0,
               "steps_lost_max": max(lost, default=0),
               "final_step": last_step(run_dir), "max_abs_weight_diff": max_diff,
               "wall_s": round(time.monotonic() - began, 1)}
    return {"date": datetime.date.today().isoformat(), "nproc": args.nproc,
            "iters": args.iters, "seed": args.seed, "overrides": [*BASE, *args.set],
            "summary": summary, "kills": kills}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4000)
    parser.add_argument("--max-delay", type=float, default=14.0,
                        help="a random kill comes 0.5 s to this many seconds after a start")
    parser.add_argument("--write-every", type=int, default=4,
                        help="every Nth kill waits for a checkpoint write (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work", default="kill_campaign_work")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    record = campaign(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"]))
    return record


if __name__ == "__main__":
    main()
