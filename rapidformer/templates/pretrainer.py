"""PreTrainer: the seed's pretraining template. Not available in this version yet."""
from __future__ import annotations

from rapidformer.errors import NotAvailableError

MESSAGE = ("PreTrainer (iteration-based pretraining on Megatron mmap data) is not available in "
           "this version yet; fine-tune with Finetuner for now")


class PreTrainer:
    """The seed's three-method pretraining template; constructing it says it is not built yet."""

    def __init__(self, engine=None):
        raise NotAvailableError(MESSAGE)


def build_train_valid_test_datasets_for_huggingface(*args, **kwargs):
    raise NotAvailableError("build_train_valid_test_datasets_for_huggingface needs the "
                            "pretraining data support, which is not available in this version yet")
