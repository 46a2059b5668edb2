"""The short kill campaign: a 2-process run killed with SIGKILL at least twice (at a random
moment, and in the middle of a checkpoint write) and resumed each time ends with the weights of
an uninterrupted run. The 20-kill version is `python tools/kill_campaign.py`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# timing-sensitive (deadlines, kills at moments): run alone, after the parallel tests
pytestmark = pytest.mark.serial



def test_killed_and_resumed_run_ends_with_the_uninterrupted_weights(tmp_path):
    out = tmp_path / "record.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "kill_campaign.py"),
                             "--kills", "2", "--write-every", "2", "--iters", "120",
                             "--max-delay", "12", "--seed", "5", "--work", str(tmp_path / "work"),
                             "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    summary = record["summary"]
    # a kill aimed at a write that ended first is followed by another aimed at a write
    assert summary["kills"] >= 2 and summary["resumes"] == summary["kills"]
    assert summary["completed"] and summary["kills_during_checkpoint_write"] >= 1
    assert summary["final_step"] == 120
    assert summary["max_abs_weight_diff"] == 0.0
    # a kill loses at most the steps since the last checkpoint (one every 2 steps), plus the
    # step being written when the kill hit the write
    assert all(k["steps_lost"] <= 2 for k in record["kills"]), record["kills"]
