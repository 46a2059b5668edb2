"""megatron-core models built from the model group: a GPT (`model=megatron_gpt`), a Llama-family
decoder (`model=megatron_llama`) and a BERT (`model=megatron_bert`) with megatron-core's
tensor-parallel layers and this rank's share of the pipeline stages."""
from __future__ import annotations

import copy
import logging
import zlib

import torch
import torch.nn.functional as F

from rapidformer.config.schema import ModelConfig, RunConfig
from rapidformer.models.dtypes import DTYPES
from rapidformer.models.megatron_vocab import padded_vocab_size

log = logging.getLogger("rapidformer")


def transformer_config(cfg: RunConfig):
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallelism
    recompute = {}
    if cfg.trainer.checkpoint_activations and cfg.trainer.recompute_granularity == "full":
        # Megatron's --checkpoint-activations: every layer recomputed in the backward pass
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 1}
    elif cfg.trainer.checkpoint_activations:  # attention's core (scores, softmax) only
        recompute = {"recompute_granularity": "selective"}
    return TransformerConfig(
        **architecture_settings(cfg), num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.intermediate_size,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.initializer_range,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        # what stages send each other: the weights' dtype (Float16Module casts to bf16/fp16);
        # a mismatch would make the receiving stage wait for bytes that never come
        pipeline_dtype=DTYPES[cfg.precision.dtype], use_cpu_initialization=True, **recompute)


def architecture_settings(cfg: RunConfig) -> dict:
    """What the block computes: GPT-2's (LayerNorm, biases, a GELU MLP) for megatron_gpt and
    megatron_bert; for megatron_llama the Llama family's (RMSNorm, SwiGLU, no biases but
    Qwen2's on q/k/v, grouped-query attention), its norm epsilon and biases the checkpoint's
    for model.init_from_hf."""
    m = cfg.model
    if m.arch != "megatron_llama":
        return {"activation_func": gelu_tanh if mlp_activation(cfg) == "gelu_new" else F.gelu}
    from rapidformer.models.megatron_llama import llama_settings

    settings = llama_settings(cfg)
    return {"activation_func": F.silu, "gated_linear_unit": True, "normalization": "RMSNorm",
            "add_bias_linear": False, "add_qkv_bias": settings.qkv_bias,
            "layernorm_epsilon": settings.norm_eps,
            "num_query_groups": m.num_key_value_heads or m.num_attention_heads}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's own GELU (Hugging Face's gelu_new): the tanh approximation, as torch computes it
    (megatron-core's openai_gelu is the same formula under torch.compile, which compiles on the
    first call and does not trace the CPU runs' CUDA-to-CPU mapping)."""
    return F.gelu(x, approximate="tanh")


def mlp_activation(cfg: RunConfig) -> str:
    """The MLP's GELU under GPT-2's name: exact ("gelu") for random weights; for
    model.init_from_hf the checkpoint's, so the model computes what the checkpoint was trained
    with ("gelu_new", the tanh approximation, for GPT-2's own checkpoints)."""
    from rapidformer.models.megatron_import import hf_activation

    return hf_activation(cfg)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for megatron-core's local layers under sequence parallelism. Each
    tensor-parallel rank normalizes its slice of the sequence, so the weights' gradients are
    partial sums: the `sequence_parallel` mark makes megatron-core's finalize_model_grads
    all-reduce them over the tensor-parallel group (what apex's and Transformer Engine's norms
    do; megatron-core's torch wrapper refuses sequence parallelism instead)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """SequenceParallelLayerNorm's RMSNorm (megatron_llama): the same gradient all-reduce."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(config, local_spec):
    """Transformer Engine's layers when installed; else megatron-core's local layers, whose
    norms become SequenceParallelLayerNorm (or SequenceParallelRMSNorm) under sequence
    parallelism."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    if not config.sequence_parallel:
        return local_spec
    norm = (SequenceParallelRMSNorm if config.normalization == "RMSNorm"
            else SequenceParallelLayerNorm)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        setattr(local_spec.submodules, name, norm)
    return TransformerBlockSubmodules(layer_specs=[local_spec] * get_num_layers_to_build(config),
                                      layer_norm=norm)


def core_attention(m: ModelConfig):
    """The local layers' core attention for model.attn_implementation: sdpa (the default) is
    rapidformer's SDPAttention (torch's scaled_dot_product_attention: cuDNN's or
    FlashAttention's fused kernels on a GPU, no [b, heads, s, s] score matrix); eager is
    megatron-core's own DotProductAttention (explicit scores, softmax and dropout)."""
    if m.attn_implementation == "eager":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    from rapidformer.models.megatron_attention import SDPAttention

    return SDPAttention


def with_core_attention(spec, attention):
    """A copy of a local layer spec whose self-attention uses `attention` (the spec's other
    modules unchanged; megatron-core's module-level specs are not touched)."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = attention
    return spec


def build_megatron_gpt(cfg: RunConfig, vocab_size: int):
    """A GPT of megatron-core's local layers with the core attention of
    model.attn_implementation (Transformer Engine's layers when it is installed), tied input
    and output embeddings as GPT-2, weights the same whatever the layout: random, or
    model.init_from_hf's GPT-2 checkpoint."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    m: ModelConfig = cfg.model
    config = transformer_config(cfg)
    vocab = padded_vocab_size(vocab_size, cfg.parallelism.tensor_model_parallel_size)
    if m.init_from_hf:  # a checkpoint of another shape is refused before any model is built
        from rapidformer.models.megatron_import import check_gpt2_checkpoint

        check_gpt2_checkpoint(cfg, config.layernorm_epsilon, vocab_size, vocab)
    spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
            if gpt_layer_specs.HAVE_TE
            else layer_spec(config, with_core_attention(
                gpt_layer_specs.get_gpt_layer_local_spec(), core_attention(m))))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=m.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True)
    model = _initialized(model, "GPT", m, vocab, vocab_size, gpt_layer_specs.HAVE_TE)
    if m.init_from_hf:
        from rapidformer.models.megatron_import import load_gpt2_weights

        loaded = load_gpt2_weights(model, cfg, vocab)
        log.info("model.init_from_hf: weights of %s, %d values on this rank (pipeline stage %d, "
                 "tensor shard %d), MLP activation %s", m.init_from_hf, loaded,
                 ps.get_pipeline_model_parallel_rank() + 1,
                 ps.get_tensor_model_parallel_rank() + 1, mlp_activation(cfg))
    return model


def build_megatron_llama(cfg: RunConfig, vocab_size: int):
    """A Llama-family decoder of megatron-core's local layers (no Transformer Engine):
    RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, an output layer of
    its own; the core attention of model.attn_implementation. Weights the same whatever the
    layout: random, or model.init_from_hf's Llama, Mistral or Qwen2 checkpoint (whose norm
    epsilon, tied embeddings, q/k/v biases and Llama 3 rotary scaling it then takes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    from rapidformer.models import megatron_llama

    m: ModelConfig = cfg.model
    settings = megatron_llama.llama_settings(cfg)
    # a checkpoint's embedding may be larger than its tokenizer (Qwen2's 151,936 rows for
    # 151,665 ids): the rows beyond the tokenizer are kept
    vocab = padded_vocab_size(max(vocab_size, settings.vocab_size or 0),
                              cfg.parallelism.tensor_model_parallel_size)
    if m.init_from_hf:  # a checkpoint megatron_llama does not compute is refused first
        megatron_llama.check_checkpoint(cfg, vocab_size)
    config = transformer_config(cfg)
    spec = layer_spec(config, with_core_attention(
        gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"), core_attention(m)))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=m.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=settings.tied,
                     position_embedding_type="rope", rotary_percent=1.0,
                     rotary_base=settings.rope_theta)
    megatron_llama.scale_rotary(model, settings)
    model = _initialized(model, f"Llama-family ({settings.family})", m, vocab, vocab_size,
                         False)
    if m.init_from_hf:
        loaded = megatron_llama.load_weights(model, cfg, vocab)
        log.info("model.init_from_hf: weights of %s (%s), %d values on this rank (pipeline "
                 "stage %d, tensor shard %d)", m.init_from_hf, settings.family, loaded,
                 ps.get_pipeline_model_parallel_rank() + 1,
                 ps.get_tensor_model_parallel_rank() + 1)
    return model


def build_megatron_decoder(cfg: RunConfig, vocab_size: int):
    """task=causal_lm's megatron-core model: model=megatron_gpt or model=megatron_llama."""
    if cfg.model.arch == "megatron_llama":
        return build_megatron_llama(cfg, vocab_size)
    return build_megatron_gpt(cfg, vocab_size)


def build_megatron_bert(cfg: RunConfig, vocab_size: int):
    """megatron-core's BERT (masked LM head and, unless task.binary_head=false, the
    next-sentence binary head over the pooled first token, token-type embeddings, output layer
    tied to the word embedding as in Megatron-LM's BERT) with the core attention of model.attn_implementation, weights the same
    whatever the layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.bert import bert_layer_specs
    from megatron.core.models.bert.bert_model import BertModel

    m: ModelConfig = cfg.model
    config = transformer_config(cfg)
    have_te = getattr(bert_layer_specs, "HAVE_TE", False)
    model_class = BertModel
    if have_te:
        spec = bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    else:
        spec = with_core_attention(bert_layer_specs.bert_layer_local_spec, core_attention(m))
        if m.attn_implementation != "eager":
            # its padding mask as [b, 1, 1, s] (a key mask), not megatron's local [b, 1, s, s]
            from rapidformer.models.megatron_attention import SDPABertModel as model_class
    vocab = padded_vocab_size(vocab_size, cfg.parallelism.tensor_model_parallel_size)
    model = model_class(config=config, num_tokentypes=2, transformer_layer_spec=spec,
                      vocab_size=vocab, max_sequence_length=m.max_position_embeddings,
                      pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage(),
                      share_embeddings_and_output_weights=True,
                      add_binary_head=cfg.task.binary_head)
    return _initialized(model, "BERT", m, vocab, vocab_size, have_te)


def _initialized(model, kind: str, m: ModelConfig, vocab: int, vocab_size: int, have_te: bool):
    """The built model with its layout-independent weights, and one log line describing it."""
    from megatron.core import parallel_state as ps

    layout_independent_init(model, m.initializer_range, m.num_layers)
    groups = model.config.num_query_groups
    log.info("megatron-core %s: %d layers, hidden %d, %d heads%s, vocabulary %d (padded from "
             "%d), %s layers%s; this rank: pipeline stage %d of %d, tensor shard %d of %d",
             kind, m.num_layers, m.hidden_size, m.num_attention_heads,
             f" ({groups} key/value)" if groups and groups != m.num_attention_heads else "",
             vocab, vocab_size,
             "Transformer Engine" if have_te else
             "local" + (" (megatron-core's DotProductAttention)" if m.attn_implementation == "eager"
                        else " (SDPA attention)"),
             ", sequence parallel" if model.config.sequence_parallel else "",
             ps.get_pipeline_model_parallel_rank() + 1, ps.get_pipeline_model_parallel_world_size(),
             ps.get_tensor_model_parallel_rank() + 1, ps.get_tensor_model_parallel_world_size())
    return model


def layout_independent_init(model: torch.nn.Module, std: float, num_layers: int) -> None:
    """Every weight drawn whole from a generator seeded by its global name, then cut to this
    rank's shard: the model is the same at TP=1 and TP=2, PP=1 and PP=2, so a layout can be
    checked against another (and a run reproduced on another one). Matrices ~ N(0, std),
    norm weights 1, biases 0; a tied output layer gets the word embedding's values."""
    from megatron.core import parallel_state as ps

    from rapidformer.models import megatron_shards as shards

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = shards.stage_offset(num_layers)
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    glu = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    for local_name, param in model.named_parameters():
        name = shards.global_name(local_name, offset, tied)
        shape = shards.full_shape(name, param, tp)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if "norm" in name and name.endswith("weight"):
            full = torch.ones(shape)
        elif name.endswith("weight"):
            full = torch.randn(shape, generator=generator) * std
        else:
            full = torch.zeros(shape)
        with torch.no_grad():
            param.copy_(shards.cut(full, name, shards.partition_dim(param), tp, tp_rank, glu))


def prepare_for_compile() -> None:
    """What torch.compile needs to capture a megatron-core TransformerLayer as one graph:
    its row-parallel linear asks for the tensor-parallel group by passing None, and megatron-core
    answers with a DeprecationWarning on rank 0, a Python builtin call that torch.compile
    cannot trace (a graph break in the attention projection and in the MLP's second linear
    of every layer, and the rest of the layer skipped). The same group, without the warning."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers

    original = getattr(layers.get_tensor_model_parallel_group_if_none, "__wrapped__",
                       layers.get_tensor_model_parallel_group_if_none)

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and torch.distributed.is_initialized() and ps.is_initialized():
            return (ps.get_expert_tensor_parallel_group(check_initialized=check_initialized)
                    if is_expert else
                    ps.get_tensor_model_parallel_group(check_initialized=check_initialized))
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    group_if_none.__wrapped__ = original
    layers.get_tensor_model_parallel_group_if_none = group_if_none
