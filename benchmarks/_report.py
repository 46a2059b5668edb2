"""The end of every benchmark script: its JSON written, where said, and a non-zero exit when a
row failed (so a broken configuration is not mistaken for a result)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def portable_command(command: str, replacements: dict[str, str] | None = None) -> str:
    """A recorded command as a reader would type it: the checkout's own path dropped, and
    run-specific folders (temporary data, a device's output folder) named by placeholders."""
    for path, name in {**(replacements or {}), str(REPO) + "/": ""}.items():
        command = command.replace(str(path), name)
    out = os.environ.get("OUT")
    return command.replace(out.rstrip("/") + "/", "") if out else command


def write_report(path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def finish(path, result: dict) -> None:
    write_report(path, result)
    print(f"wrote {path}")
    if any("error" in row for row in result["rows"]):
        sys.exit(1)


def finish_speed_rows(args, rows: list[dict], baseline: str) -> None:
    """Each row's tokens/s as a ratio to the baseline row's (`vs_BASELINE`), then the report
    with the device, torch and the run's shape (args: model, seq, batch, iters, out)."""
    import datetime

    import torch

    base = next((r["tokens_per_s"] for r in rows if r["row"] == baseline and "error" not in r),
                None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r[f"vs_{baseline.replace('-', '_')}"] = round(r["tokens_per_s"] / base, 3)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    finish(args.out, {"date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "model": args.model, "seq": args.seq,
                      "micro_batch": args.batch, "iterations": args.iters,
                      "command": portable_command(" ".join(sys.argv)), "rows": rows})


def run_cli(row: str, command: list[str], work: Path, timeout: float | None = None):
    """One row's rapidformer command run: (the row's record so far, the finished process, its
    metrics.jsonl log windows: those with tokens_per_s). The record carries the error instead
    when the command failed or ran past `timeout` seconds (the windows are then None)."""
    import subprocess
    import time

    started = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        result = subprocess.CompletedProcess(command, -9, _text(exc.stdout), _text(exc.stderr))
        keep_log(row, result)
        return {"row": row, "error": f"ran past its {timeout:.0f} s limit"}, result, None
    keep_log(row, result)
    base = {"row": row, "process_wall_s": round(time.perf_counter() - started, 1),
            "command": portable_command(" ".join(command[1:]), {str(work): "WORK"})}
    if result.returncode != 0:
        return {**base, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:400],
                "exit_code": result.returncode}, result, None
    out = Path(next(a for a in command if a.startswith("trainer.output_dir=")).split("=", 1)[1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return base, result, [r for r in records if "tokens_per_s" in r]


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def keep_log(name: str, result, lines: int = 60) -> None:
    """A run's last log lines appended to $BENCH_LOG, when set (to read why a row was slow)."""
    path = os.environ.get("BENCH_LOG")
    if path:
        tail = (result.stderr + result.stdout).splitlines()[-lines:]
        with open(path, "a") as f:
            f.write(f"===== {name} (exit {result.returncode})\n" + "\n".join(tail) + "\n")
