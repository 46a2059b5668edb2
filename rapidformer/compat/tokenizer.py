"""`get_tokenizer()`: the run's pretraining tokenizer, as the seed's Megatron scripts call it.

It has Megatron's attributes (`eod`, `cls`, `sep`, `mask`, `vocab_size`, `inv_vocab`,
`tokenize`, `detokenize`) and the Hugging Face tokenizer as `.hf`; it is built from the active
run's model settings by rapidformer.data.pretraining_tokenizer.
"""
from __future__ import annotations

from rapidformer.compat.args import active
from rapidformer.data.megatron import MegatronTokenizer
from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer


def get_tokenizer() -> MegatronTokenizer:
    cfg = active().cfg
    return load_pretraining_tokenizer(cfg.model, cfg.data.path)
