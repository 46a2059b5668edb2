"""A megatron-core GPT as a Hugging Face GPT-2: the shards of every tensor- and pipeline-parallel
rank gathered on rank 0, renamed, and the fused QKV projection split into GPT-2's layout.

The shapes allow it because `model=megatron_gpt` builds what GPT-2 is: pre-LayerNorm blocks with
biases, GELU (exact for random weights; a model started from a GPT-2 checkpoint keeps that
checkpoint's, usually the tanh approximation), learned absolute positions, tied input and output
embeddings. The vocabulary keeps its padding (rows that no token uses).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from rapidformer.config.schema import RunConfig


def gather_full_state(model: torch.nn.Module, num_layers: int) -> dict | None:
    """{global name: full tensor} on rank 0 (collective over every rank; None elsewhere)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * (num_layers // pp)
    shards = None
    if ps.get_data_parallel_rank() == 0:  # replicas hold the same weights
        shards = {"tp_rank": ps.get_tensor_model_parallel_rank(), "params": {}}
        for name, param in model.named_parameters():
            name = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else -1
            shards["params"][name] = (param.detach().float().cpu(), dim)
    world = dist.get_world_size()
    gathered = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(shards, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    pieces: dict[str, list] = {}
    for shard in filter(None, gathered):
        for name, (tensor, dim) in shard["params"].items():
            pieces.setdefault(name, []).append((shard["tp_rank"], tensor, dim))
    full = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        dim = parts[0][2]
        full[name] = torch.cat([t for _, t, _ in parts], dim) if dim >= 0 else parts[0][1]
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
