"""Black-box tasks: each a template subclass driven only by the config."""
from __future__ import annotations


def task_class(name: str):
    if name == "sequence_classification":
        from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner

        return SequenceClassificationFinetuner
    if name == "token_classification":
        from rapidformer.tasks.token_classification import TokenClassificationFinetuner

        return TokenClassificationFinetuner
    if name == "question_answering":
        from rapidformer.tasks.question_answering import QuestionAnsweringFinetuner

        return QuestionAnsweringFinetuner
    if name == "masked_lm":
        from rapidformer.tasks.masked_lm import MaskedLMFinetuner

        return MaskedLMFinetuner
    if name == "seq2seq_lm":
        from rapidformer.tasks.seq2seq_lm import Seq2SeqFinetuner

        return Seq2SeqFinetuner
    if name == "bert_pretraining":
        from rapidformer.tasks.pretraining import BertPretrainer

        return BertPretrainer
    if name == "causal_lm":
        from rapidformer.tasks.pretraining import CausalLMPretrainer

        return CausalLMPretrainer
    raise KeyError(name)  # unreachable: task.name is a Literal checked by the schema
