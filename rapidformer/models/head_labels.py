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
    """The pretrained model's label2id when its names mean something and its ids are
    0..n-1; None for a model built from the config, placeholder names, or a config out of
    reach (the run fails where it loads the model, with its own message)."""
    config = pretrained_config(m)
    label2id = getattr(config, "label2id", None) or {}
    if not label2id or all(PLACEHOLDER.fullmatch(str(name)) for name in label2id):
        return None
    mapping = {str(name): int(i) for name, i in label2id.items()}
    if sorted(mapping.values()) != list(range(len(mapping))):
        return None
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
