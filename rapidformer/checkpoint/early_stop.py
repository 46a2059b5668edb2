"""Whether a checkpoint's run stopped early under this run's settings (trainer.best_metric,
trainer.early_stopping_patience): the resume plan asks it before any step, the best-evaluation
tracker (templates/best.py) while training. Here, in the checkpoint package, so that the resume
plan needs nothing of the templates."""
from __future__ import annotations

# metrics where lower is better; every other metric (accuracy, f1, exact_match, rougeL) is
# better higher
LOWER_IS_BETTER = ("loss", "perplexity", "ppl")


def inferred_mode(metric: str, mode: str | None) -> str:
    """trainer.best_mode, or the one the metric's name implies."""
    if mode:
        return mode
    return "min" if metric.rsplit("/", 1)[-1].endswith(LOWER_IS_BETTER) else "max"


def early_stop_of(trainer_cfg, saved: dict | None, marker: dict | None,
                  step: int) -> dict | None:
    """The record (BestRecord's fields) of an early stop that this run's settings see in a
    run resumed from a checkpoint at `step`: its train state's record (`saved`) or the best
    marker beside it (`marker`, which knows of evaluations after the checkpoint, e.g. the one
    that stopped the run when trainer.save_last=false), of this run's metric and mode, counting
    at least trainer.early_stopping_patience evaluations without improvement. None without
    early stopping, or when the patience is not over (a larger patience trains on)."""
    patience, metric = trainer_cfg.early_stopping_patience, trainer_cfg.best_metric
    if not (patience and metric):
        return None
    mode = inferred_mode(metric, trainer_cfg.best_mode)
    for record in (marker, saved):
        if record and (record.get("metric"), record.get("mode")) == (metric, mode) and \
                record.get("evaluated_at", -1) >= step and \
                record.get("evaluations_without_improvement", 0) >= patience:
            return record
    return None


def early_stop_reason(metric: str, min_delta: float, evaluations: int) -> str:
    """Why early stopping ended a run, in the words the log, the summary, the status and a
    refused resume share: "no improvement of more than 0.5 in validation/loss for 2
    evaluations"."""
    by = f" of more than {min_delta:g}" if min_delta else ""
    return (f"no improvement{by} in {metric} for {evaluations} evaluation"
            f"{'' if evaluations == 1 else 's'}")
