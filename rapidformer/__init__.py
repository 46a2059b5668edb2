"""rapidformer: a config-driven training accelerator for PyTorch transformers.

The seed's imports work: `from rapidformer import RapidformerEngine, Finetuner, PreTrainer,
get_args, get_logger, get_timers, build_train_valid_test_datasets_for_huggingface, mpu`. Names load on first use, so `python -m rapidformer --help`
does not import transformers.
"""
from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

# transformers imports torchao when it is installed (the fp8 extra), whatever the run's
# precision; torchao then reports each of its CUDA extensions that cannot load here (a CPU,
# another GPU architecture) and torch reports torchao's pytree registrations as deprecated.
# Neither says anything about the run: only errors from them are shown.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
# megatron-core's import and dataset builder log every step at INFO (which FSDP flavour it
# found, each index it builds): its warnings and errors only, wherever it is first imported
logging.getLogger("megatron").setLevel(logging.WARNING)

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
