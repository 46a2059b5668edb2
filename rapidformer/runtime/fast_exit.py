"""A process that imported torch, transformers and megatron-core spends 0.6-1.5 s exiting, in
the garbage collections of the interpreter's shutdown (it walks every object those libraries
made). Freezing the heap as the last exit handler skips that walk; every other exit handler
(loggers, W&B, torch.distributed) still runs first, and files are closed as before.
"""
from __future__ import annotations

import atexit
import gc

_installed = False


def _freeze_heap() -> None:
    gc.disable()
    gc.freeze()


def install() -> None:
    """Call early in a process's entry point: exit handlers run last-registered first, so this
    one runs after those the libraries register later."""
    global _installed
    if not _installed:
        atexit.register(_freeze_heap)
        _installed = True
