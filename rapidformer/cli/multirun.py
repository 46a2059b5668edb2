"""A summary of a multirun sweep (`python -m rapidformer -m ...`): one row per job.

Hydra runs the jobs one after another, each in its own sub-directory (and, with several
processes, its own process group on a fresh port). At the end this callback prints a table —
job, overrides, status, final loss, eval metric, samples/s — on stderr, where a single run
prints its summary, and writes it to the sweep directory as summary.md (with PNG curves of
every job under plots/, linked) and summary.json.
A failed job is a row with its status and the first line of its error; the sweep goes on to the
next job. When every job has run, a sweep with a failed (or stopped) job exits with code 1
(`EXIT_SWEEP_FAILED`), after the table and one line naming those jobs; a sweep whose jobs all
succeeded exits 0.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rapidformer.observability.format import format_value
from rapidformer.observability.records import read_metrics

STATUS_FILE = "status.json"
EXIT_SWEEP_FAILED = 1


def write_status(run_dir: str | Path, status: str, error: str | None = None) -> None:
    """status.json, replaced whole (a full disk leaves the old one, never an empty file)."""
    target = Path(run_dir, STATUS_FILE)
    tmp = target.with_name(f".tmp-{STATUS_FILE}")
    try:
        tmp.write_text(json.dumps({"status": status, "error": error}))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def job_row(job_dir: Path) -> dict:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) \
        if (job_dir / ".hydra" / "overrides.yaml").is_file() else []
    status = json.loads((job_dir / STATUS_FILE).read_text()) \
        if (job_dir / STATUS_FILE).is_file() else {"status": "failed", "error": "no status"}
    records = read_metrics(job_dir)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("validation/") for k in r)]
    metric = next((k for k in ("validation/accuracy", "validation/f1", "validation/loss")
                   if evals and k in evals[-1]), None)
    return {"job": job_dir.name,
            # as the user typed them: `++` is what rapidformer adds for schema keys
            "overrides": " ".join(o.removeprefix("++") for o in overrides
                                  if not o.startswith("+recipe=quickstart")),
            "status": status["status"], "error": first_line(status.get("error")),
            "final_loss": train[-1]["loss"] if train else None,
            "metric": metric, "value": evals[-1][metric] if metric else None,
            "samples_per_s": (sum(r["samples_per_s"] for r in train) / len(train)) if train else None}


def first_line(error: str | None) -> str | None:
    lines = str(error).strip().splitlines() if error else []
    return lines[0] if lines else error


def summary_table(rows: list[dict]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| job | overrides | status | final loss | eval metric | samples/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        value = "-" if r["value"] is None else format_value(r["value"])  # counts as integers
        metric = f"{r['metric']}={value}" if r["metric"] else "-"
        status = r["status"]
        if status != "ok":  # a table cell: no pipes
            status = f"{status.upper()}: {r['error'] or '-'}".replace("|", "\\|")
        lines.append(f"| {r['job']} | {r['overrides']} | {status} | {fmt(r['final_loss'], '.4f')} "
                     f"| {metric} | {fmt(r['samples_per_s'], '.1f')} |")
    return "\n".join(lines)


def sweep_plots(sweep_dir: Path, jobs: list[Path]) -> list[Path]:
    """Loss, lr, throughput and eval curves of every job that logged metrics, in one PNG each."""
    from rapidformer.cli.verbs.plot import plot_runs

    with_metrics = [job for job in jobs if (job / "metrics.jsonl").is_file()]
    return plot_runs(with_metrics, sweep_dir / "plots") if with_metrics else []


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name)) if sweep_dir.is_dir() else []
        rows = [job_row(job) for job in jobs]
        table = summary_table(rows)
        pictures = sweep_plots(sweep_dir, jobs)
        (sweep_dir / "summary.md").write_text(
            table + "\n" + "".join(f"\n![{p.stem}](plots/{p.name})\n" for p in pictures))
        (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=1))
        # a job that stopped as asked (trainer.exit_interval, early stopping) did what it was told
        failed = [r for r in rows if r["status"] not in ("ok", "stopped", "stopped_early")]
        # on stderr as a single run's summary is (the log lines are on stdout in both)
        print(f"\nsweep summary ({len(rows)} jobs, {len(failed)} failed) - {sweep_dir}/summary.md"
              f"\n{table}", file=sys.stderr, flush=True)
        if failed:
            # not "rapidformer: error": each failed job has printed its own
            named = ", ".join(f"{r['job']}: {r['status']}" for r in failed)
            print(f"rapidformer: sweep: {len(failed)} of {len(rows)} jobs did not succeed "
                  f"(job{'s' if len(failed) > 1 else ''} {named}); the first line of each error "
                  f"is in {sweep_dir}/summary.md, the rest in the job's directory (exit code "
                  f"{EXIT_SWEEP_FAILED})", file=sys.stderr)
            # after every job ran: Hydra's callbacks let SystemExit through, and the process
            # exits with it (any callback listed before this one in hydra.callbacks is skipped)
            raise SystemExit(EXIT_SWEEP_FAILED)
