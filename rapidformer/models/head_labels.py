"""The label names a pretrained classifier's head was trained with.

A checkpoint fine-tuned before (a hub sentiment, NLI or NER model, or an earlier run's
hf_model/) keeps in its config which row of its head is which class (`label2id`). A run that
fine-tunes it on data labelled with those names numbers them as the head does: numbered in its
own order (names sorted), the head's rows would keep their trained meaning under other names,
and a model that was right would score as wrong. Names that are transformers' placeholders
(LABEL_0, LABEL_1, ...) carry no meaning, and the data's own order applies. The tasks read the
names here and give them to the data's loaders (data/text_classification.py,
data/token_labels.py), which number the data's names by them.
"""
from __future__ import annotations

import re

from rapidformer.config.schema import ModelConfig

PLACEHOLDER = re.compile(r"LABEL_\d+")


def head_labels(m: ModelConfig) -> dict[str, int] | None:
    """name -> row of the pretrained model's head, from its config's id2label (what transformers
    keeps: it saves label2id as null when a config was given id2label alone), else its
    label2id; None for a model built from the config, placeholder names (LABEL_0, ...), ids
    that are not 0..n-1, or a config out of reach (the run fails where it loads the model)."""
    config = pretrained_config(m)
    id2label = getattr(config, "id2label", None) or {}
    mapping = {str(name): int(i) for i, name in id2label.items()} if id2label else \
        {str(name): int(i) for name, i in (getattr(config, "label2id", None) or {}).items()}
    if not mapping or all(PLACEHOLDER.fullmatch(name) for name in mapping):
        return None
    if sorted(mapping.values()) != list(range(len(mapping))):
        return None  # repeated names or gaps: no one numbering
    return mapping


def pretrained_config(m: ModelConfig):
    """A pretrained model's transformers config: from this machine where it is there, else from
    the hub (the few kilobytes the model's own load fetches first); None out of reach."""
    from rapidformer.models.pretrained_shape import local_config

    if m.source != "pretrained" or not m.name_or_path:
        return None
    config = local_config(m)
    if config is not None:
        return config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=False)
    except (OSError, ValueError):
        return None


def head_size(m: ModelConfig, task_class: str) -> int | None:
    """The number of classes of the pretrained checkpoint's own head for `task_class` (e.g.
    "ForSequenceClassification"), None where it has none (a base model) or is out of reach."""
    config = pretrained_config(m)
    if config is None or not any(a.endswith(task_class) for a in config.architectures or ()):
        return None
    return config.num_labels
