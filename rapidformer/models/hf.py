"""Hugging Face models: pretrained (hub name or local directory) or built from the config."""
from __future__ import annotations

from rapidformer.config.schema import ModelConfig
from rapidformer.data.tokenizers import unreachable_model_message
from rapidformer.errors import InputError


def _labels(num_labels: int, label_names: list[str]) -> dict:
    if not label_names:
        return {"num_labels": num_labels}
    return {"num_labels": num_labels, "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)}}


def build_sequence_classifier(m: ModelConfig, num_labels: int, tokenizer, label_names=()):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = _labels(num_labels, list(label_names))
    if m.source == "pretrained":
        try:
            return AutoModelForSequenceClassification.from_pretrained(
                m.name_or_path, attn_implementation=m.attn_implementation, **labels)
        except OSError as exc:
            raise InputError(unreachable_model_message(m.name_or_path)) from exc
    try:
        config = AutoConfig.for_model(
            m.arch, vocab_size=len(tokenizer), hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings,
            hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
            initializer_range=m.initializer_range,
            pad_token_id=tokenizer.pad_token_id, **labels)
    except ValueError as exc:
        raise InputError(f"model.arch={m.arch} is not a Hugging Face model type this version of "
                         f"transformers knows ({exc}); use e.g. model.arch=bert") from exc
    return AutoModelForSequenceClassification.from_config(
        config, attn_implementation=m.attn_implementation)
