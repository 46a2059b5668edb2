"""Hugging Face models: pretrained (hub name or local directory) or built from the config."""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

from rapidformer.config.schema import ENCODER_DECODER_ARCHS, ModelConfig
from rapidformer.data.tokenizers import unreachable_model_message
from rapidformer.errors import InputError
from rapidformer.models.pretrained_shape import check_shape

log = logging.getLogger("rapidformer")


def _labels(num_labels: int, label_names: list[str]) -> dict:
    if not label_names:
        return {"num_labels": num_labels}
    return {"num_labels": num_labels, "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)}}


# fine-tuning task -> the transformers auto class of its model
AUTO_CLASSES = {"sequence_classification": "AutoModelForSequenceClassification",
                "token_classification": "AutoModelForTokenClassification",
                "question_answering": "AutoModelForQuestionAnswering",
                "masked_lm": "AutoModelForMaskedLM",
                "seq2seq_lm": "AutoModelForSeq2SeqLM",
                "sft": "AutoModelForCausalLM"}

# the weights a run trains are fp32 masters whatever the checkpoint's dtype (transformers 5 loads
# a bf16 checkpoint in bf16, and AdamW on bf16 weights drops every update below their
# resolution); precision=bf16 autocasts, and peft's frozen base goes back to bf16 where no value
# changes (peft.base_dtype)
TRAINING_DTYPE = torch.float32


def _new_head(m: ModelConfig, task: str, num_labels: int | None) -> dict:
    """A classifier checkpoint whose head has another number of classes than the data (an NLI
    model's 3 for a binary task): its head is made anew, and the run says so; the rest of its
    weights load as trained."""
    suffix = {"sequence_classification": "ForSequenceClassification",
              "token_classification": "ForTokenClassification"}.get(task)
    if suffix is None or num_labels is None:
        return {}
    from rapidformer.models.head_labels import head_size

    size = head_size(m, suffix)
    if size is None or size == num_labels:
        return {}
    log.warning("%s has a head of %d classes and this run's data %d: the head starts anew from "
                "random weights (the rest of the model loads as trained)", m.name_or_path, size,
                num_labels)
    return {"ignore_mismatched_sizes": True}


def build_sequence_classifier(m: ModelConfig, num_labels: int, tokenizer, label_names=()):
    return build_task_model(m, "sequence_classification", tokenizer,
                            **_labels(num_labels, list(label_names)))


def build_task_model(m: ModelConfig, task: str, tokenizer, **extra):
    """A fine-tuning task's Hugging Face model: pretrained (hub name or local directory), or
    built from the model group's shape with the tokenizer's vocabulary (random weights)."""
    import transformers

    auto = getattr(transformers, AUTO_CLASSES[task])
    if m.source == "pretrained":
        extra = {**extra, **_new_head(m, task, extra.get("num_labels"))}
        load = functools.partial(auto.from_pretrained, m.name_or_path, dtype=TRAINING_DTYPE,
                                 attn_implementation=m.attn_implementation)
        try:
            try:
                model = load(**extra)
            except RuntimeError as exc:  # a head of another size, its config not read before
                if "ignore_mismatched_sizes" not in str(exc) or "num_labels" not in extra:
                    raise
                log.warning("%s has a head of another size than this run's %d classes: the "
                            "head starts anew from random weights", m.name_or_path,
                            extra["num_labels"])
                model = load(**extra, ignore_mismatched_sizes=True)
        except OSError as exc:
            raise InputError(unreachable_model_message(m.name_or_path)) from exc
        check_shape(m, model.config)
        return model
    try:
        config = transformers.AutoConfig.for_model(m.arch, **_shape(m, tokenizer), **extra)
    except ValueError as exc:
        raise InputError(f"model.arch={m.arch} is not a Hugging Face model type this version of "
                         f"transformers knows ({exc}); use e.g. model.arch=bert") from exc
    return initialized(auto.from_config(config, attn_implementation=m.attn_implementation), m)


def initialized(model, m: ModelConfig):
    """A config-built model with its random weights at model.init_dtype's values (held in the
    training dtype, as a bf16 checkpoint is once loaded)."""
    if m.init_dtype == "bf16":
        with torch.no_grad():
            for t in model.parameters():
                if t.is_floating_point():
                    t.copy_(t.to(torch.bfloat16))
    return model


def embedding_rows(m: ModelConfig, tokens: int) -> int:
    """model.embedding_rows, or one row per token of a tokenizer of `tokens` entries."""
    if m.embedding_rows is None:
        return tokens
    if m.embedding_rows < tokens:
        raise InputError(f"model.embedding_rows={m.embedding_rows} is fewer than the tokenizer's "
                         f"{tokens} tokens; set it to at least {tokens}, or to null (one row per "
                         f"token)")
    return m.embedding_rows


def _shape(m: ModelConfig, tokenizer) -> dict:
    """The model group's shape in the config keys of the architecture's family."""
    if m.arch in ENCODER_DECODER_ARCHS:  # T5: its own key names; the decoder starts from padding
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None \
            else tokenizer.sep_token_id
        return {"vocab_size": embedding_rows(m, len(tokenizer)), "d_model": m.hidden_size,
                "d_kv": m.hidden_size // m.num_attention_heads, "d_ff": m.intermediate_size,
                "num_layers": m.num_layers, "num_heads": m.num_attention_heads,
                "dropout_rate": m.hidden_dropout, "initializer_factor": m.initializer_range / 0.02,
                "pad_token_id": tokenizer.pad_token_id, "eos_token_id": eos,
                "decoder_start_token_id": tokenizer.pad_token_id}
    # decoders: the tokenizer's end of sequence ends what they generate
    ends = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}
    if m.arch in LLAMA_ARCHS:
        return {"vocab_size": embedding_rows(m, len(tokenizer)), **_llama_shape(m), **ends}
    if m.arch == "gpt2":
        return {"vocab_size": embedding_rows(m, len(tokenizer)), "n_embd": m.hidden_size,
                "n_layer": m.num_layers,
                "n_head": m.num_attention_heads, "n_inner": m.intermediate_size,
                "n_positions": m.max_position_embeddings, "resid_pdrop": m.hidden_dropout,
                "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
                "initializer_range": m.initializer_range, **ends}
    return {"vocab_size": embedding_rows(m, len(tokenizer)), "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "intermediate_size": m.intermediate_size,
            "max_position_embeddings": m.max_position_embeddings,
            "hidden_dropout_prob": m.hidden_dropout,
            "attention_probs_dropout_prob": m.attention_dropout,
            "initializer_range": m.initializer_range, "pad_token_id": tokenizer.pad_token_id}


# config-built decoders of the Llama family (RMSNorm, SwiGLU, rotary positions, grouped-query
# attention); Mistral, Qwen and other pretrained ones come through model=hf
LLAMA_ARCHS = ("llama",)


def _llama_shape(m: ModelConfig) -> dict:
    return {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_attention_heads,
            "intermediate_size": m.intermediate_size,
            "max_position_embeddings": m.max_position_embeddings, "rope_theta": m.rope_theta,
            "attention_dropout": m.attention_dropout, "initializer_range": m.initializer_range}


def pretraining_auto_class(task: str, binary_head: bool = True) -> str:
    """The transformers Auto class of a pretraining task's model: BERT with its masked-LM and
    next-sentence heads, BERT's masked-LM head alone (task.binary_head=false), or a causal LM."""
    if task == "bert_pretraining":
        return "AutoModelForPreTraining" if binary_head else "AutoModelForMaskedLM"
    return "AutoModelForCausalLM"


def build_pretraining_model(m: ModelConfig, task: str, tokenizer, binary_head: bool = True):
    """BERT with MLM + NSP heads (bert_pretraining; the MLM head alone without `binary_head`)
    or a causal LM (causal_lm): pretrained, or built from the config with the pretraining
    tokenizer's vocabulary (a MegatronTokenizer)."""
    import transformers
    from transformers import BertConfig, GPT2Config, LlamaConfig

    from rapidformer.data.pretraining_tokenizer import vocabulary_problem

    auto = getattr(transformers, pretraining_auto_class(task, binary_head))
    if m.source == "pretrained":
        try:
            model = auto.from_pretrained(m.name_or_path, attn_implementation=m.attn_implementation,
                                         dtype=TRAINING_DTYPE)
        except OSError as exc:
            raise InputError(unreachable_model_message(m.name_or_path)) from exc
        check_shape(m, model.config)
        if problem := vocabulary_problem(m, model.config.vocab_size, tokenizer):
            raise InputError(problem)
        return model
    if task == "bert_pretraining":
        if m.arch != "bert":
            raise InputError(f"task=bert_pretraining builds a BERT; model.arch={m.arch} is not "
                             f"one (use model=bert_tiny or model=bert_base)")
        config = BertConfig(
            vocab_size=embedding_rows(m, tokenizer.vocab_size), hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings,
            hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
            initializer_range=m.initializer_range, pad_token_id=tokenizer.hf_pad)
    elif m.arch == "gpt2":
        config = GPT2Config(
            vocab_size=embedding_rows(m, tokenizer.vocab_size), n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_attention_heads, n_inner=m.intermediate_size,
            n_positions=m.max_position_embeddings, resid_pdrop=m.hidden_dropout,
            embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            initializer_range=m.initializer_range, bos_token_id=tokenizer.eod,
            eos_token_id=tokenizer.eod)
    elif m.arch in LLAMA_ARCHS:
        # input and output embeddings apart, as in Llama 2 and Llama 3 from 8B on
        config = LlamaConfig(vocab_size=embedding_rows(m, tokenizer.vocab_size),
                             **_llama_shape(m),
                             bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod,
                             tie_word_embeddings=False)
    else:
        raise InputError(f"task=causal_lm builds a GPT-2- or Llama-shaped model from the config; "
                         f"model.arch={m.arch} is neither (use model=gpt2_tiny, gpt2_small, "
                         f"llama_tiny or llama_1b, or a pretrained causal LM with model=hf)")
    config._attn_implementation = m.attn_implementation
    return initialized(auto.from_config(config, attn_implementation=m.attn_implementation), m)


def training_without_kv_cache(model) -> bool:
    """Turn a Hugging Face model's KV cache off for training; True if it was on.

    A cache is never read in a training step, yet with `use_cache=True` a decoder builds one in
    every forward (memory for all layers' keys and values), and under regional compile its
    per-layer bookkeeping makes each block recompile until torch.compile gives up and runs the
    rest eagerly. The exported config keeps the user's setting (see `kv_cache_as_configured`).
    """
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    return True


@contextlib.contextmanager
def kv_cache_as_configured(model, was_on: bool):
    """The user's `use_cache` while a model is saved for inference."""
    if was_on:
        model.config.use_cache = True
    try:
        yield
    finally:
        if was_on:
            model.config.use_cache = False
