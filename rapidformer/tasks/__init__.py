"""Black-box tasks: each a template subclass driven only by the config."""
from __future__ import annotations

import importlib

# task.name -> (module under rapidformer.tasks, class); imported only when chosen
TASK_CLASSES = {
    "sequence_classification": ("sequence_classification", "SequenceClassificationFinetuner"),
    "token_classification": ("token_classification", "TokenClassificationFinetuner"),
    "question_answering": ("question_answering", "QuestionAnsweringFinetuner"),
    "masked_lm": ("masked_lm", "MaskedLMFinetuner"),
    "seq2seq_lm": ("seq2seq_lm", "Seq2SeqFinetuner"),
    "bert_pretraining": ("pretraining", "BertPretrainer"),
    "causal_lm": ("pretraining", "CausalLMPretrainer"),
    "sft": ("sft", "SFTFinetuner"),
}


def task_class(name: str):
    module, cls = TASK_CLASSES[name]  # task.name is a Literal checked by the schema
    return getattr(importlib.import_module(f"rapidformer.tasks.{module}"), cls)
