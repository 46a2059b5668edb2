"""A run's metrics records (metrics.jsonl, one json object a line): their scalars, reading
them back, and cutting off the torn last line of a killed run. The sink writes them, the
trackers and the CLI's summaries and plots read them."""
from __future__ import annotations

import json
from pathlib import Path

from rapidformer.checkpoint.early_stop import early_stop_reason


def drop_torn_record(path: Path) -> None:
    """A run killed mid-write leaves a last line without its newline; a resumed run appending
    to it would merge two records into one unreadable line. Cut it off."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl records ([] when it has none), without a torn last line of a
    killed run."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


# the record a run writes when it stops as asked before its last step (trainer.exit_interval):
# {"step": 10, "stopped": {"by": "trainer.exit_interval=10", "of": 100}}, or by early stopping,
# after its final scores and export: {"step": 7, "stopped": {"by": "early stopping", "of": 12,
# "early": {"metric": "validation/loss", "min_delta": 0.5, "patience": 1, "evaluations": 1}}}
STOPPED = "stopped"
EARLY = "early"
# the record of a run that trains without evaluation, written once at its first point of
# evaluation: {"step": 0, "no_evaluation": "why"} (the end-of-run summary says why)
NO_EVALUATION = "no_evaluation"


def planned_stop(records: list[dict]) -> dict | None:
    """The run's stop record when its last record is one: it stopped as asked, not finished
    (a resumed run's records go on after it)."""
    return records[-1] if records and STOPPED in records[-1] else None


def stopped_early(stop: dict | None) -> dict | None:
    """The early stop's details of a stop record (`planned_stop`), or None."""
    return (stop or {}).get(STOPPED, {}).get(EARLY)


def stop_words(stop: dict) -> str:
    """How a stop record reads: "stopped early at step 7 of 12 (no improvement ...)", or
    "trainer.exit_interval=10 at step 10 of 100"."""
    early, of = stopped_early(stop), stop[STOPPED]["of"]
    if early:
        return (f"stopped early at step {stop['step']} of {of} ("
                f"{early_stop_reason(early['metric'], early['min_delta'], early['evaluations'])}"
                f", trainer.early_stopping_patience={early['patience']})")
    return f"{stop[STOPPED]['by']} at step {stop['step']} of {of}"


def scalars(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
