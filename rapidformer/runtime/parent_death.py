"""A child process that dies with its parent: a process in a session of its own (a launcher's
worker, a search's measuring child) is out of reach of the signals its parent's group or
terminal gets, so a parent killed outright (SIGKILL, the OOM killer) would leave it running."""
from __future__ import annotations

import os
import signal
import sys


def die_with(parent: int) -> None:
    """Linux: this process gets SIGKILL when `parent`, its parent, dies; it exits at once when
    `parent` died before the request was in place (its parent is then another process)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)
