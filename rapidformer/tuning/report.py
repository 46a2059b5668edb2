"""The search's table and record: what each candidate measured, or why it was not tried."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def say(text: str) -> None:
    """Progress on stderr (the search runs before the run's log exists)."""
    print(f"rapidformer: tuning: {text}", file=sys.stderr, flush=True)


def warn(text: str) -> None:
    print(f"rapidformer: warning: {text}", file=sys.stderr, flush=True)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    """Markdown: candidate, tokens/s, warm-up s, start-up and evaluation s, peak memory, loss
    check, time to result, and why it was skipped or left out."""
    lines = ["| candidate | real tokens/s | warm-up s | start + eval s | peak mem GB | "
             "loss check | time to result s | chosen / why not |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        why = "chosen" if r.get("chosen") else r.get("why", "")
        lines.append(f"| {r['label']} | {_num(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_num(r.get('warmup_s'), '.2f')} | {_num(r.get('fixed_s'), '.1f')} | "
                     f"{_num(r.get('peak_mem_gb'), '.2f')} | "
                     f"{r.get('loss_check', '-')} | {_num(r.get('time_to_result_s'), ',.1f')} | "
                     f"{why.replace('|', '/')} |")
    return "\n".join(lines)


def no_passing(verdicts, not_measured: list[dict]) -> str:
    """What became of each candidate, where none passed: why it failed or was not measured."""
    said = [f"{v.label}: {v.why or v.loss_check}" for v in verdicts]
    said += [f"{r['label']}: {r['why']}" for r in not_measured]
    return "; ".join(said) or "no candidate"


def write(run_dir: str | Path, record: dict) -> Path:
    """tuning.json in the run directory, written whole (a temporary file renamed)."""
    path = Path(run_dir) / "tuning.json"
    tmp = path.with_name(f".tuning.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, path)
    return path
