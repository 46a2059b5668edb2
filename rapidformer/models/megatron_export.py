"""A megatron-core GPT as a Hugging Face GPT-2: the shards of every tensor- and pipeline-parallel
rank gathered on rank 0, renamed, and the fused QKV projection split into GPT-2's layout.

The shapes allow it because `model=megatron_gpt` builds what GPT-2 is: pre-LayerNorm blocks with
biases, GELU (exact for random weights; a model started from a GPT-2 checkpoint keeps that
checkpoint's, usually the tanh approximation), learned absolute positions, tied input and output
embeddings. The vocabulary keeps its padding (rows that no token uses).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rapidformer.config.schema import RunConfig
from rapidformer.models import megatron_shards as shards


def gather_full_state(model: torch.nn.Module, num_layers: int) -> dict | None:
    """{global name: full tensor} on rank 0 (collective over every rank; None elsewhere)."""
    from megatron.core import parallel_state as ps

    offset = shards.stage_offset(num_layers)
    glu = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    mine = None
    if ps.get_data_parallel_rank() == 0:  # replicas hold the same weights
        mine = {"tp_rank": ps.get_tensor_model_parallel_rank(), "params": {}}
        for name, param in model.named_parameters():
            mine["params"][shards.global_name(name, offset)] = (param.detach().float().cpu(),
                                                               shards.partition_dim(param))
    world = dist.get_world_size()
    gathered = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    pieces: dict[str, list] = {}
    for shard in filter(None, gathered):
        for name, (tensor, dim) in shard["params"].items():
            pieces.setdefault(name, []).append((shard["tp_rank"], tensor, dim))
    full = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        full[name] = shards.join([t for _, t, _ in parts], name, parts[0][2], glu)
    return full


def to_hf_gpt2(full: dict, cfg: RunConfig, vocab_size: int, tokenizer_eod: int | None):
    """A GPT2LMHeadModel holding the gathered megatron-core weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.models.megatron import mlp_activation

    m = cfg.model
    heads, hidden = m.num_attention_heads, m.hidden_size
    head_dim = hidden // heads
    config = GPT2Config(vocab_size=vocab_size, n_positions=m.max_position_embeddings,
                        n_embd=hidden, n_layer=m.num_layers, n_head=heads,
                        n_inner=m.intermediate_size, activation_function=mlp_activation(cfg),
                        resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
                        attn_pdrop=m.attention_dropout, layer_norm_epsilon=1e-5,
                        initializer_range=m.initializer_range, tie_word_embeddings=True,
                        bos_token_id=tokenizer_eod, eos_token_id=tokenizer_eod)
    state = {"transformer.wte.weight": full["embedding.word_embeddings.weight"],
             "transformer.wpe.weight": full["embedding.position_embeddings.weight"],
             "transformer.ln_f.weight": full["decoder.final_layernorm.weight"],
             "transformer.ln_f.bias": full["decoder.final_layernorm.bias"]}
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        # megatron-core keeps q, k and v interleaved per head: [head][q|k|v][head_dim]
        qkv_w = full[src + "self_attention.linear_qkv.weight"].view(heads, 3, head_dim, hidden)
        qkv_b = full[src + "self_attention.linear_qkv.bias"].view(heads, 3, head_dim)
        weight = torch.cat([qkv_w[:, j].reshape(hidden, hidden) for j in range(3)], 0)
        bias = torch.cat([qkv_b[:, j].reshape(hidden) for j in range(3)], 0)
        state.update({
            dst + "ln_1.weight": full[src + "input_layernorm.weight"],
            dst + "ln_1.bias": full[src + "input_layernorm.bias"],
            # GPT-2's Conv1D stores (in, out): the transpose of a Linear's weight
            dst + "attn.c_attn.weight": weight.t(),
            dst + "attn.c_attn.bias": bias,
            dst + "attn.c_proj.weight": full[src + "self_attention.linear_proj.weight"].t(),
            dst + "attn.c_proj.bias": full[src + "self_attention.linear_proj.bias"],
            dst + "ln_2.weight": full[src + "pre_mlp_layernorm.weight"],
            dst + "ln_2.bias": full[src + "pre_mlp_layernorm.bias"],
            dst + "mlp.c_fc.weight": full[src + "mlp.linear_fc1.weight"].t(),
            dst + "mlp.c_fc.bias": full[src + "mlp.linear_fc1.bias"],
            dst + "mlp.c_proj.weight": full[src + "mlp.linear_fc2.weight"].t(),
            dst + "mlp.c_proj.bias": full[src + "mlp.linear_fc2.bias"],
        })
    model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict({k: v.contiguous() for k, v in state.items()},
                                                strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")
               and not k.endswith(".attn.masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"megatron GPT -> GPT-2: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


# the megatron-core decoders a run exports, and the Hugging Face class each becomes
EXPORTED_ARCHS = {"megatron_gpt": "GPT-2", "megatron_llama": "its Llama-family class"}


def to_hf(full: dict, cfg: RunConfig, tokenizer_eod: int | None):
    """The Hugging Face causal LM of the gathered weights: megatron_gpt -> GPT2LMHeadModel
    (its padded vocabulary kept), megatron_llama -> LlamaForCausalLM, or the class of the
    checkpoint it started from (Qwen2ForCausalLM, MistralForCausalLM)."""
    if cfg.model.arch == "megatron_llama":
        from rapidformer.models.megatron_llama import to_hf_llama

        return to_hf_llama(full, cfg, tokenizer_eod)
    vocab = full["embedding.word_embeddings.weight"].shape[0]
    return to_hf_gpt2(full, cfg, vocab, tokenizer_eod)
