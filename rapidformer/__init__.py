"""rapidformer: a config-driven training accelerator for PyTorch transformers.

The seed's imports work: `from rapidformer import RapidformerEngine, Finetuner, PreTrainer,
get_args, get_logger, get_timers, build_train_valid_test_datasets_for_huggingface, mpu`. Names load on first use, so `python -m rapidformer --help`
does not import transformers.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# third-party lines that say nothing to the user, silenced in every process that imports
# rapidformer; RAPIDFORMER_DEBUG=1 shows them. Each filter, and why: observability/quiet.py
from rapidformer.observability import quiet as _quiet  # noqa: E402

_quiet.install()

_EXPORTS = {
    "RapidformerEngine": "rapidformer.engine",
    "Finetuner": "rapidformer.templates.finetuner",
    "PreTrainer": "rapidformer.templates.pretrainer",
    "build_train_valid_test_datasets_for_huggingface": "rapidformer.compat.datasets",
    "build_train_valid_test_datasets": "rapidformer.compat.datasets",
    "get_tokenizer": "rapidformer.compat.tokenizer",
    "get_ltor_masks_and_position_ids": "rapidformer.data.masks",
    "get_args": "rapidformer.compat.args",
    "get_logger": "rapidformer.observability.metrics",
    "get_timers": "rapidformer.observability.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name == "mpu":
        return importlib.import_module("rapidformer.compat.mpu")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidformer' has no attribute '{name}'")
