"""`rapidformer plot RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG curves comparing runs.

Writes loss.png, lr.png, throughput.png (tokens/s) and, when runs evaluated, eval.png (their
validation metric: accuracy, else f1, exact_match or loss; the axis and title name it) into
--out (default: the first run directory's `plots/`), one line per run, labelled with the
overrides a multirun job varied in its sweep and its directory name otherwise. A sweep does
this itself at its end (summary.md links the pictures).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from rapidformer.errors import InputError, RapidformerError
from rapidformer.observability.records import read_metrics

# file name -> (metric keys in order of preference, what the metric is); each run draws the
# first key it logged, and the axis and title name the keys drawn
CURVES = {"loss.png": (("loss",), "training loss"),
          "lr.png": (("lr",), "learning rate"),
          "throughput.png": (("tokens_per_s",), "throughput"),
          "eval.png": (("validation/accuracy", "validation/f1", "validation/exact_match",
                        "validation/loss", "validation/lm_loss"), "validation")}


def axis_label(keys: list[str], meaning: str) -> str:
    """The y-axis: the metric keys drawn (`validation/accuracy`), with what they mean where the
    key alone does not say it (`training loss (loss)`)."""
    named = ", ".join(keys)
    return named if all(k.startswith(meaning + "/") for k in keys) else f"{meaning} ({named})"


def job_overrides(run_dir: Path) -> list[str] | None:
    """A multirun job's overrides as typed (no recipe, no `++` rapidformer adds); None for a
    run that is not a sweep's job."""
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if not (overrides.is_file() and run_dir.name.isdigit()):
        return None
    return [o.removeprefix("++") for o in yaml.safe_load(overrides.read_text()) or []
            if not o.startswith("+recipe=")]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """A multirun job says what it varied: its overrides less those every job of its sweep
    shares (a sweep's fixed settings would make the legend wider than the picture); another
    run its directory's name."""
    shared: dict[Path, set[str]] = {}
    labels = []
    for run_dir in run_dirs:
        overrides = job_overrides(run_dir)
        if overrides is None:
            labels.append(run_dir.name)
            continue
        sweep = run_dir.parent
        if sweep not in shared:
            jobs = [o for job in sweep.iterdir() if job.is_dir()
                    for o in [job_overrides(job)] if o is not None]
            shared[sweep] = set.intersection(*map(set, jobs)) if len(jobs) > 1 else set(overrides)
        varied = [o for o in overrides if o not in shared[sweep]]
        labels.append(f"{run_dir.name}: {' '.join(varied)}" if varied else run_dir.name)
    return labels


def run_metrics(run_dir: Path) -> list[dict]:
    if not (run_dir / "metrics.jsonl").is_file():
        raise InputError(f"{run_dir}: no metrics.jsonl; give run directories (trainer.output_dir "
                         f"of finished or running runs)")
    return read_metrics(run_dir)


def plot_runs(run_dirs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    runs = list(zip(run_labels(run_dirs), [run_metrics(d) for d in run_dirs]))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (keys, meaning) in CURVES.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        drawn: list[str] = []
        for label, records in runs:
            key = next((k for k in keys if any(k in r for r in records)), None)
            if key is None:
                continue
            points = {}
            for r in records:
                if key in r:
                    points[r["step"]] = r[key]  # a resumed run re-logs steps: the later wins
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], marker="." if len(steps) < 30 else None,
                    label=label if key == keys[0] else f"{label} ({key})")
            if key not in drawn:
                drawn.append(key)
        if not drawn:
            plt.close(fig)
            continue
        ylabel = axis_label(drawn, meaning)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} by step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    return written


def plot_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: FIRST_RUN/plots)")
    args = parser.parse_args(argv)
    try:
        written = plot_runs(args.run_dirs, args.out or args.run_dirs[0] / "plots")
    except RapidformerError as exc:
        print(f"rapidformer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for path in written:
        print(path)
    return 0
