"""Run the bad-input cases (tests/test_bad_input.py, and the held-out review cases of
tests/test_trust_round3_review.py, which record their refusals the same way) and write the
table of their messages into docs/reliability.md, between its bad-input-table markers.

    python tools/bad_input_table.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
TEST_DIR = re.compile(r"[^\s='(]*/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+")
ERROR_PREFIX = re.compile(r"^rapidformer(-preprocess-data)?: error: ")
SOURCES = ("tests/test_bad_input.py", "tests/test_trust_round3_review.py")
BEGIN, END = "<!-- bad-input-table -->", "<!-- /bad-input-table -->"


def cell(text: str) -> str:
    text = ERROR_PREFIX.sub("", text).strip()
    text = TEST_DIR.sub("DIR", text)  # the test's temporary directories
    return " ".join(text.split()).replace("|", "\\|")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "cases.jsonl"
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 *SOURCES], cwd=REPO,
                                env={**os.environ, "RAPIDFORMER_BAD_INPUT_RECORD": str(record)})
        if result.returncode != 0:
            sys.exit("some bad-input cases failed; the table is not rewritten")
        rows = [json.loads(line) for line in record.read_text().splitlines()]
    lines = [BEGIN, "", "| # | bad input | exit | message |", "|---|---|---|---|"]
    lines += [f"| {i} | {row['case']} | {row['code']} | {cell(row['message'])} |"
              for i, row in enumerate(rows, 1)]
    lines += ["", END]
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + "\n".join(lines) + text[end:])
    print(f"wrote {len(rows)} cases into {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
