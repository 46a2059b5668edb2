"""The child process of accelerate=auto's search: the real `rapidformer` CLI, run as
`python -m rapidformer.tuning.child OVERRIDES...` by tuning/measure.py.

Test hook (documented in docs/tuning.md, used by tests/test_tuning.py): when the environment
variable RAPIDFORMER_TUNING_FAULTS maps this child's candidate (RAPIDFORMER_TUNING_CANDIDATE,
set by the parent to the candidate's label) to a fault, as JSON {"label": "crash" | "hang" |
"diverge"}, the child raises before training ("crash"), sleeps until it is killed ("hang") or
trains at trainer.lr=1000 ("diverge"), standing for a candidate that fails, hangs or blows up
(fp16 overflow, a bad kernel) only at run time. Unset, it is the CLI and nothing else.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time


def injected_fault() -> str | None:
    faults = os.environ.get("RAPIDFORMER_TUNING_FAULTS")
    if not faults:
        return None
    return json.loads(faults).get(os.environ.get("RAPIDFORMER_TUNING_CANDIDATE", ""))


PARENT = "RAPIDFORMER_TUNING_PARENT"  # the search's pid, set by tuning/measure.py


def main() -> None:
    from rapidformer.runtime.parent_death import die_with

    # in a session of its own (killed as a group by the search): a search killed with SIGKILL
    # would leave it measuring on, with its temporary folder
    die_with(int(os.environ.get(PARENT) or os.getppid()))
    fault = injected_fault()
    if fault == "crash":
        raise RuntimeError("injected crash (RAPIDFORMER_TUNING_FAULTS)")
    if fault == "hang":
        while True:
            time.sleep(60)
    if fault not in (None, "diverge"):
        raise ValueError(f"RAPIDFORMER_TUNING_FAULTS: no fault {fault!r} (crash, hang or "
                         f"diverge)")
    # the CLI as `rapidformer run OVERRIDES...` runs it (by module name: the
    # tuning package is below the CLI, which imports it)
    sys.argv = ["rapidformer", "run", *sys.argv[1:],
                *(["trainer.lr=1000"] if fault == "diverge" else [])]
    runpy.run_module("rapidformer.cli.console", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
