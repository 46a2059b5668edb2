"""The end of every benchmark script: its JSON written, where said, and a non-zero exit when a
row failed (so a broken configuration is not mistaken for a result)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def write_report(path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def finish(path, result: dict) -> None:
    write_report(path, result)
    print(f"wrote {path}")
    if any("error" in row for row in result["rows"]):
        sys.exit(1)
