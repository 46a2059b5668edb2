"""Black-box tasks: each a template subclass driven only by the config."""
from __future__ import annotations


def task_class(name: str):
    if name == "sequence_classification":
        from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner

        return SequenceClassificationFinetuner
    if name == "bert_pretraining":
        from rapidformer.tasks.pretraining import BertPretrainer

        return BertPretrainer
    if name == "causal_lm":
        from rapidformer.tasks.pretraining import CausalLMPretrainer

        return CausalLMPretrainer
    raise KeyError(name)  # unreachable: task.name is a Literal checked by the schema
