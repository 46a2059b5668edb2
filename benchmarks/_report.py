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


def keep_log(name: str, result, lines: int = 60) -> None:
    """A run's last log lines appended to $BENCH_LOG, when set (to read why a row was slow)."""
    path = os.environ.get("BENCH_LOG")
    if path:
        tail = (result.stderr + result.stdout).splitlines()[-lines:]
        with open(path, "a") as f:
            f.write(f"===== {name} (exit {result.returncode})\n" + "\n".join(tail) + "\n")
