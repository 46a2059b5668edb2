"""Black-box tasks: each a template subclass driven only by the config."""
from __future__ import annotations


def task_class(name: str):
    if name == "sequence_classification":
        from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner

        return SequenceClassificationFinetuner
    raise KeyError(name)  # unreachable: task.name is a Literal checked by the schema
