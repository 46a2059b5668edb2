"""Faults a process can meet under a scheduler, at random moments: SIGKILL of one worker of a
2-process job (the out-of-memory killer's way), and SIGTERM to the whole process group (what
Slurm and Kubernetes send), with the run resumed after each.

    python tools/fault_campaign.py --out docs/reliability/fault_campaign.json
    python tools/fault_campaign.py --modes fsdp --kills 3 --tasks masked_lm   # a short one

Worker kills, per memory mode (default zero3 and fsdp): an uninterrupted reference run, then the
same command with `trainer.resume=auto` again and again in one run directory; each attempt loses
one worker (a random rank) to SIGKILL at a random moment (mostly of its training, one in five
during start-up) or, every second kill, the moment a checkpoint's temporary directory appears. The launcher must then end the job naming the killed
rank and the signal, every attempt must resume from the newest complete checkpoint, and the
final exported weights must equal the reference's. Recorded per kill: when, what the job was
doing, the steps lost, and the seconds from the kill to the launcher's exit.

Process-group SIGTERM, per task (one process, a DataLoader worker process): the run is signalled
once it is training; it must exit 75 with a checkpoint of the step it reached, and the same
command with `trainer.resume=auto` must finish. Recorded: the exit code, the seconds from the
signal to the exit, the checkpoint, whether the resumed run finished.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from kill_campaign import (ENV, alive, check_resume, exported_weights, last_step,  # noqa: E402
                           newest_step, temp_dirs, writing)

# a small deterministic fp32 job on 2 processes: a checkpoint every 2 steps
WORKER_JOB = ["+recipe=quickstart", "trainer.progress_bar=false", "trainer.tensorboard=false",
              "trainer.log_interval=1", "trainer.save_interval=2", "trainer.keep_last=2",
              "trainer.deterministic=true", "precision=fp32", "data.synthetic_train_size=512",
              "data.synthetic_eval_size=32", "trainer.micro_batch_size=8",
              "trainer.global_batch_size=16", "trainer.eval_interval=null",
              "launcher.nproc_per_node=2"]
COMMON = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=1",
          "trainer.export_hf=false", "data.num_workers=1", "trainer.micro_batch_size=16",
          "trainer.global_batch_size=32"]
SYNTHETIC = ["model=bert_tiny", "data=synthetic", "model.vocab_size=400", "trainer.epochs=null"]
# task -> its command (pretraining tasks read Megatron files made by `pretraining_files`)
TASKS = {
    "sequence_classification": ["+recipe=quickstart", "data.synthetic_train_size=2048",
                                "trainer.epochs=null"],
    "token_classification": ["+recipe=bert_ner", *SYNTHETIC, "data.synthetic_train_size=2048"],
    "question_answering": ["+recipe=bert_squad", *SYNTHETIC, "data.max_seq_length=64",
                           "task.doc_stride=16", "data.synthetic_train_size=2048"],
    "masked_lm": ["+recipe=bert_mlm", *SYNTHETIC, "data.synthetic_train_size=2048"],
    "seq2seq_lm": ["+recipe=t5_summarize", "model=t5_tiny", "data=synthetic",
                   "task.source_prefix=", "data.max_seq_length=48", "task.max_target_length=16",
                   "data.synthetic_train_size=2048", "trainer.epochs=null",
                   "trainer.eval_interval=null"],
    "bert_pretraining": ["+recipe=bert_pretrain", "model=bert_tiny", "data.path={bert}",
                         "model.tokenizer={vocab}", "data.max_seq_length=64",
                         "trainer.eval_iters=2"],
    "causal_lm_pretraining": ["+recipe=gpt_pretrain", "model=gpt2_tiny", "data.path={gpt}",
                              "model.tokenizer={gpt2_vocab}", "model.merge_file={merges}",
                              "data.max_seq_length=64", "data.split=90,5,5",
                              "trainer.eval_iters=2"],
}


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENV}, cwd=log_path.parent)


def rapidformer(*args: str) -> list[str]:
    return [sys.executable, "-m", "rapidformer", *args]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


# --- SIGKILL of one worker ------------------------------------------------------------------------

def kill_one_worker(process: subprocess.Popen, run_dir: Path, delay: float | None,
                    during_write: bool, limit: float, stale: set, before: int,
                    rng: random.Random) -> dict | None:
    """SIGKILL one worker (a direct child of the launcher) at the next checkpoint write, or
    `delay` s after this attempt's first logged step (None: during start-up, 1-10 s after the
    launch); None if the attempt ended first."""
    started, training_since = time.monotonic(), None
    startup_delay = rng.uniform(1.0, 10.0)
    while True:
        now = time.monotonic() - started
        if process.poll() is not None:
            return None
        if training_since is None and last_step(run_dir) > before:
            training_since = now
        workers = [pid for pid in children(process.pid) if alive(pid)]
        if during_write:
            due = writing(run_dir, stale)
        elif delay is None:
            due = now >= startup_delay
        else:
            due = training_since is not None and now - training_since >= delay
        if due and len(workers) >= 2:
            break
        if now > limit:
            raise SystemExit(f"attempt ran {limit:.0f} s without a moment to kill")
        time.sleep(0.001 if during_write else 0.01)
    victim = rng.choice(sorted(workers))
    phase = "checkpoint write" if writing(run_dir, stale) else (
        "training" if last_step(run_dir) > before else "start-up")
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise SystemExit("the launcher did not end the job within 300 s of a worker's SIGKILL")
    return {"phase": phase, "at_s": round(killed - started, 2),
            "exit_s": round(time.monotonic() - killed, 2), "launcher_exit_code": code}


def worker_campaign(mode: str, args, work: Path, rng: random.Random) -> dict:
    work.mkdir(parents=True, exist_ok=True)

    def command(run_dir: Path, resume: bool) -> list[str]:
        return rapidformer(*WORKER_JOB, f"memory={mode}", f"trainer.train_iters={args.iters}",
                           f"trainer.output_dir={run_dir}",
                           *(["trainer.resume=auto"] if resume else []))

    began = time.monotonic()
    reference = work / "reference"
    result = subprocess.run(command(reference, False), capture_output=True, text=True,
                            env={**os.environ, **ENV}, cwd=work)
    if result.returncode != 0:
        raise SystemExit(f"{mode}: the reference run failed:\n{result.stderr[-3000:]}")
    reference_s = time.monotonic() - began
    print(f"{mode}: reference {args.iters} steps in {reference_s:.1f} s", flush=True)

    run_dir, kills, attempt, retry_write = work / "killed", [], 0, False
    while True:
        attempt += 1
        resumed_from, before, stale = newest_step(run_dir), last_step(run_dir), temp_dirs(run_dir)
        log_path = work / f"attempt_{attempt}.log"
        process = start(command(run_dir, attempt > 1), log_path)
        if len(kills) >= args.kills and not retry_write:
            if process.wait() != 0:
                raise SystemExit(f"{mode}: the final attempt failed: see {log_path}")
            break
        if len(kills) >= args.kills + 5:
            raise SystemExit(f"{mode}: the last kills aimed at writes all missed them")
        during_write = retry_write or (len(kills) + 1) % 2 == 0
        # of the other kills, one in five during start-up, the rest at a random moment of
        # training
        delay = None if rng.random() < 0.2 else rng.uniform(0.0, args.max_delay)
        outcome = kill_one_worker(process, run_dir, delay, during_write, reference_s * 3, stale,
                                  before, rng)
        if outcome is None:
            raise SystemExit(f"{mode}: attempt {attempt} ended before its kill (exit "
                             f"{process.returncode}); raise --iters: see {log_path}")
        retry_write = during_write and outcome["phase"] != "checkpoint write"
        text = log_path.read_text(errors="replace")
        named = "was killed by SIGKILL" in text
        check_resume(log_path, resumed_from)
        reached = max(last_step(run_dir), before)
        kills.append({"kill": len(kills) + 1, **outcome, "named_in_message": named,
                      "resumed_from_step": resumed_from, "step_reached": reached,
                      "newest_complete_after": newest_step(run_dir),
                      "steps_lost": reached - newest_step(run_dir)})
        print(f"{mode}: {json.dumps(kills[-1])}", flush=True)
    check_resume(work / f"attempt_{attempt}.log", resumed_from)
    expected, got = exported_weights(reference), exported_weights(run_dir)
    max_diff = max(float((expected[k].float() - got[k].float()).abs().max()) for k in expected)
    lost, exits = [k["steps_lost"] for k in kills], [k["exit_s"] for k in kills]
    return {"mode": mode, "kills": len(kills), "resumes": attempt - 1,
            "kills_during_checkpoint_write": sum(k["phase"] == "checkpoint write" for k in kills),
            "killed_rank_named": sum(k["named_in_message"] for k in kills),
            "steps_lost_mean": round(sum(lost) / len(lost), 2), "steps_lost_max": max(lost),
            "exit_s_mean": round(sum(exits) / len(exits), 2), "exit_s_max": max(exits),
            "max_abs_weight_diff": max_diff, "wall_s": round(time.monotonic() - began, 1),
            "events": kills}


# --- SIGTERM to the process group -----------------------------------------------------------------

def pretraining_files(work: Path) -> dict:
    """A generated corpus preprocessed for BERT (sentences) and GPT (documents with EOD)."""
    from rapidformer.data.corpus import write_pretraining_sample

    return write_pretraining_sample(work / "pretraining_data")


def sigterm_task(task: str, args, work: Path, files: dict, rng: random.Random) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / task
    base = [a.format(**files) for a in TASKS[task]]
    cmd = rapidformer(*base, *COMMON, f"trainer.train_iters={args.task_iters}",
                      f"trainer.output_dir={run_dir}")
    process = start(cmd, work / f"{task}.log")
    wanted = rng.randint(2, 6)  # signalled after this many logged steps
    deadline = time.monotonic() + 600
    while last_step(run_dir) < wanted:
        if process.poll() is not None:
            raise SystemExit(f"{task}: ended (exit {process.returncode}) before it was "
                             f"signalled: see {work}/{task}.log")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise SystemExit(f"{task}: no step {wanted} within 600 s")
        time.sleep(0.02)
    at_step = last_step(run_dir)
    os.killpg(process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = process.wait(timeout=600)
    exit_s = time.monotonic() - signalled
    saved = newest_step(run_dir)
    resumed = subprocess.run([*cmd, "trainer.resume=auto"], capture_output=True, text=True,
                             env={**os.environ, **ENV}, cwd=work)
    (work / f"{task}.resume.log").write_text(resumed.stdout + resumed.stderr)
    return {"task": task, "signalled_at_step": at_step, "exit_code": code,
            "exit_s": round(exit_s, 2), "checkpoint_step": saved,
            "resumed_exit_code": resumed.returncode,
            "resumed_to_step": last_step(run_dir)}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["zero3", "fsdp"])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--max-delay", type=float, default=8.0,
                        help="a random kill comes up to this many seconds into training")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--task-iters", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="fault_campaign_work")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    work = Path(args.work).resolve()
    rng = random.Random(args.seed)
    record = {"date": datetime.date.today().isoformat(), "seed": args.seed,
              "worker_kills": [], "process_group_sigterm": []}
    for mode in args.modes:
        record["worker_kills"].append(worker_campaign(mode, args, work / mode, rng))
        print(json.dumps({k: v for k, v in record["worker_kills"][-1].items() if k != "events"}),
              flush=True)
    pretraining = {t for t in args.tasks if "pretraining" in t}
    files = pretraining_files(work) if pretraining else {}
    for task in args.tasks:
        record["process_group_sigterm"].append(sigterm_task(task, args, work / "sigterm",
                                                            files, rng))
        print(json.dumps(record["process_group_sigterm"][-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
