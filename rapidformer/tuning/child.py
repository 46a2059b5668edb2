"""The child process of accelerate=auto's search: the real `rapidformer` CLI, run as
`python -m rapidformer.tuning.child OVERRIDES...` by tuning/measure.py.

Test hook (documented in docs/tuning.md, used by tests/test_tuning.py): when the environment
variable RAPIDFORMER_TUNING_FAULTS maps this child's candidate (RAPIDFORMER_TUNING_CANDIDATE,
set by the parent to the candidate's label) to a fault, as JSON {"label": "crash" | "hang"},
the child raises before training ("crash") or sleeps until it is killed ("hang"), standing
for a candidate that fails or hangs only at run time. Unset, it is the CLI and nothing else.
"""
from __future__ import annotations

import json
import os
import time


def injected_fault() -> str | None:
    faults = os.environ.get("RAPIDFORMER_TUNING_FAULTS")
    if not faults:
        return None
    return json.loads(faults).get(os.environ.get("RAPIDFORMER_TUNING_CANDIDATE", ""))


def main() -> None:
    fault = injected_fault()
    if fault == "crash":
        raise RuntimeError("injected crash (RAPIDFORMER_TUNING_FAULTS)")
    if fault == "hang":
        while True:
            time.sleep(60)
    if fault is not None:
        raise ValueError(f"RAPIDFORMER_TUNING_FAULTS: no fault {fault!r} (crash or hang)")
    from rapidformer.cli.console import main as cli

    cli(["run", *__import__("sys").argv[1:]])


if __name__ == "__main__":
    main()
