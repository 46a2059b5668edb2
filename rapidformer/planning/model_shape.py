"""The shape of the model a config trains, without its weights: parameters in total and per
transformer block, and the sizes activations scale with. Hugging Face models are built on the
meta device (no memory, no download of weights; a pretrained model's config.json must be local
or cached); megatron-core models are counted from their layer formula (building them needs a
process group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidformer.errors import InputError

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    block_parameters: int  # one transformer block (what FSDP/ZeRO-3 gather at a time)
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    language_model_head: bool  # logits over the vocabulary at every position (pretraining)
    # the MLP's activation is one fused op (gelu, relu, silu: saves its input), or GPT-2's
    # gelu_new, a tanh formula of elementwise ops that each save a full-width tensor
    activation: str = "gelu"


# activations written as several elementwise ops (transformers' NewGELU and FastGELU)
ELEMENTWISE_ACTIVATIONS = ("gelu_new", "gelu_fast")


class _VocabOnly:
    """What the model builders read from a tokenizer, for a model that is only counted."""

    def __init__(self, size: int):
        self.vocab_size = size
        self.pad_token_id = self.hf_pad = 0
        self.eod = self.eos_token_id = self.sep_token_id = size - 1
        self.bos_token_id = None

    def __len__(self) -> int:
        return self.vocab_size


def megatron_parameters(layers: int, hidden: int, ffn: int, vocab: int, positions: int,
                        gpt: bool) -> tuple[int, int]:
    """(total, per block) of megatron-core's GPT/BERT as built here: biases, two LayerNorms
    per block, tied input/output embeddings."""
    block = 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    total = layers * block + vocab * hidden + positions * hidden + 2 * hidden
    if not gpt:  # BERT: token types, pooler, LM-head transform and bias, NSP head
        total += 2 * hidden + hidden * hidden + hidden + hidden * hidden + 3 * hidden + vocab \
            + 2 * hidden + 2
    return total, block


def llama_parameters(layers: int, hidden: int, ffn: int, vocab: int, heads: int,
                     kv_heads: int) -> tuple[int, int]:
    """(total, per block) of megatron_llama with random weights: no biases, two RMSNorms per
    block, q/k/v with kv_heads key/value heads, SwiGLU's three matrices, an untied output
    layer."""
    kv = hidden // heads * kv_heads
    block = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return layers * block + 2 * vocab * hidden + hidden, block


def vocab_size(cfg: RunConfig) -> int:
    """Pretraining: the size of the tokenizer the data was made with, when its files are here.
    A config-built fine-tuning model: the WordPiece vocabulary training builds from the
    training texts, when they are on this machine (generated or local data), or the given
    tokenizer's; otherwise model.vocab_size, the most it can be."""
    from pathlib import Path

    m = cfg.model
    if m.source == "config" and m.embedding_rows is not None:
        return m.embedding_rows
    if cfg.task.is_pretraining and m.tokenizer_type and m.tokenizer \
            and Path(m.tokenizer).exists():
        from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer

        return load_pretraining_tokenizer(m, cfg.data.path).vocab_size
    if not cfg.task.is_pretraining and m.source == "config":
        if m.tokenizer and Path(m.tokenizer).exists():
            from rapidformer.data.tokenizers import load_tokenizer

            return len(load_tokenizer(m.tokenizer, m.lowercase))
        if not m.tokenizer and cfg.data.source in ("synthetic", "local"):
            return trained_vocab_size(cfg)
    return m.vocab_size


def assumed_vocabulary(cfg: RunConfig) -> str | None:
    """What the plan says when the vocabulary it counts is not the tokenizer's: a tokenizer file
    named but not on this machine (a plan for another machine) leaves model.vocab_size."""
    from pathlib import Path

    m = cfg.model
    if m.source != "config" or m.embedding_rows is not None or not m.tokenizer \
            or Path(m.tokenizer).exists():
        return None
    return (f"vocabulary: model.tokenizer={m.tokenizer} is not on this machine; the plan counts "
            f"model.vocab_size={m.vocab_size:,} entries (set it to the tokenizer's size for an "
            f"exact plan; the run itself refuses a missing tokenizer)")


def trained_vocab_size(cfg: RunConfig) -> int:
    """The entries of the WordPiece vocabulary that training trains on the training split: at
    most model.vocab_size, fewer when the texts hold fewer words (the quickstart's synthetic
    pairs: 146 of 2000), and the embeddings follow it. Generated data is generated into a
    temporary directory, as training would into the run directory."""
    import json
    import tempfile
    from dataclasses import asdict
    from pathlib import Path

    from rapidformer.data.synthetic import write_dataset
    from rapidformer.data.synthetic_tasks import TASK_KINDS, writer_for
    from rapidformer.data.text_classification import load_splits
    from rapidformer.data.tokenizers import training_texts, wordpiece_vocabulary

    task, m, d = cfg.task.name, cfg.model, cfg.data
    # generated data is a function of its settings: the same settings, the same vocabulary
    # (memory=auto plans at every start, and a test or a sweep plans many configs)
    key = (task, m.vocab_size, m.lowercase, json.dumps(asdict(d), sort_keys=True, default=str)) \
        if d.source == "synthetic" and not d.path else None
    if key in _GENERATED_VOCAB:
        return _GENERATED_VOCAB[key]
    write = writer_for(task, d.synthetic_lengths) if task in TASK_KINDS else write_dataset
    with tempfile.TemporaryDirectory(prefix="rapidformer-plan-") as tmp:
        train = load_splits(d, Path(tmp), write_synthetic=write)["train"]
        size = len(wordpiece_vocabulary(training_texts(task, d, train), m.vocab_size,
                                        m.lowercase))
    if key is not None:
        _GENERATED_VOCAB[key] = size
    return size


_GENERATED_VOCAB: dict[tuple, int] = {}


def model_shape(cfg: RunConfig) -> ModelShape:
    m, task = cfg.model, cfg.task.name
    lm_head = task in ("bert_pretraining", "causal_lm", "masked_lm", "seq2seq_lm")
    if m.is_megatron:
        from rapidformer.models.megatron import padded_vocab_size

        vocab = padded_vocab_size(vocab_size(cfg), cfg.parallelism.tensor_model_parallel_size)
        if m.arch == "megatron_llama":
            total, block = llama_parameters(m.num_layers, m.hidden_size, m.intermediate_size,
                                            vocab, m.num_attention_heads,
                                            m.num_key_value_heads or m.num_attention_heads)
        else:
            total, block = megatron_parameters(m.num_layers, m.hidden_size, m.intermediate_size,
                                               vocab, m.max_position_embeddings,
                                               m.arch == "megatron_gpt")
        return ModelShape(total, block, m.num_layers, m.hidden_size, m.num_attention_heads,
                          m.intermediate_size, vocab, lm_head,
                          activation="silu" if m.arch == "megatron_llama" else "gelu")
    model = _meta_model(cfg)
    config = model.config
    blocks = _blocks(model)
    block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()), block_parameters=block,
        layers=config.num_hidden_layers, hidden=config.hidden_size,
        heads=config.num_attention_heads,
        ffn=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        or 4 * config.hidden_size,
        vocab=config.vocab_size, language_model_head=lm_head,
        activation=getattr(config, "activation_function", None)
        or getattr(config, "hidden_act", None) or "gelu")


def _meta_model(cfg: RunConfig):
    import torch

    from rapidformer.models import hf

    m = cfg.model
    if m.source == "pretrained":  # its config.json says its shape, vocabulary included
        return _pretrained_on_meta(cfg)
    tokenizer = _VocabOnly(vocab_size(cfg))
    with torch.device("meta"):
        if cfg.task.is_pretraining:
            return hf.build_pretraining_model(m, cfg.task.name, tokenizer,
                                              cfg.task.binary_head)
        labels = {"num_labels": cfg.task.num_labels or 2} if cfg.task.name in (
            "sequence_classification", "token_classification") else {}
        return hf.build_task_model(m, cfg.task.name, tokenizer, **labels)


def _pretrained_on_meta(cfg: RunConfig):
    """The task's model class of a pretrained model, from its config.json alone (a local
    directory, or the hub's cache: no weights are read), on the meta device."""
    import torch
    import transformers

    from rapidformer.data.tokenizers import unreachable_model_message
    from rapidformer.models.hf import AUTO_CLASSES, pretraining_auto_class

    try:
        config = transformers.AutoConfig.from_pretrained(cfg.model.name_or_path)
    except (OSError, ValueError) as exc:
        raise InputError(unreachable_model_message(cfg.model.name_or_path)) from exc
    task = cfg.task.name
    name = pretraining_auto_class(task, cfg.task.binary_head) if cfg.task.is_pretraining \
        else AUTO_CLASSES[task]
    if task in ("sequence_classification", "token_classification") and cfg.task.num_labels:
        config.num_labels = cfg.task.num_labels  # the head the run gives it
    with torch.device("meta"):
        return getattr(transformers, name).from_config(config)


def _blocks(model) -> list:
    """The repeated transformer blocks (the largest ModuleList of same-typed modules)."""
    import torch

    best: list = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best) \
                and len({type(b) for b in module}) == 1:
            best = list(module)
    return best
