"""Hugging Face SDPA attention that stays on the fast kernels under torch.compile.

Transformers builds no attention mask for a batch without padding, so SDPA runs with
`is_causal=True` (decoders) or no mask at all (encoders) and picks its fused kernels. It decides
that only outside a traced graph: under torch.compile it always materializes the full
`[batch, 1, seq, seq]` mask (before torch 2.14, dynamo also reports every compile as an export,
and an exported graph must not bake `is_causal` in). With the mask, SDPA computes the masked
half of a causal attention too and reads the mask: on one H200, GPT 1.3B's attention took
131 ms of a 364 ms compiled step against 34 ms eager (docs/benchmarks.md).

`rapidformer_sdpa` is transformers' own SDPA attention under another name, with a mask rule that
skips the mask in exactly the case transformers skips it in eager mode when no padding mask is
passed: no padding mask, no KV cache offset, query and key lengths equal, no sliding window, and
no packed-sequence or custom mask pattern (transformers clears `allow_is_causal_skip` for
those). Every other case goes to transformers' `sdpa_mask` unchanged. Transformers also treats
every traced batch as possibly packed documents, because telling needs the position ids'
values; when the caller passed no position ids the model numbers them 0..s-1 itself, nothing
is packed, and rapidformer says so (`find_packed_sequence_indices` returns None for that forward
only; hooks on the switched model set and clear the flag). The engine switches a
model's `sdpa` to it for training (`use_training_sdpa`); the name is not written to a saved
config (transformers drops `_attn_implementation` when it serializes one).
"""
from __future__ import annotations

import inspect
import logging
import sys

import torch

log = logging.getLogger(__name__)

TRAINING_SDPA = "rapidformer_sdpa"


def training_sdpa_mask(**kwargs):
    """None (SDPA needs no mask) when there is nothing but causality or full attention to
    express; otherwise transformers' `sdpa_mask` with the same arguments (transformers passes
    them by name)."""
    from transformers.masking_utils import sdpa_mask

    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    local_size = kwargs.get("local_size")
    plain = (kwargs.get("attention_mask") is None and isinstance(q_offset, int) and q_offset == 0
             and isinstance(kv_offset, int) and kv_offset == 0
             and kwargs["q_length"] == kwargs["kv_length"]
             and (local_size is None or kwargs["kv_length"] < local_size))
    if plain and (kwargs.get("allow_is_causal_skip", True)
                  or kwargs.get("allow_is_bidirectional_skip", False)):
        return None
    return sdpa_mask(**kwargs)


# True only during the forward of a switched model whose caller passed no position ids: the
# model then numbers the positions 0..s-1 itself, so no batch row holds packed documents
_positions_are_the_models_own = False


def _note_caller_positions(module, args, kwargs):
    global _positions_are_the_models_own
    _positions_are_the_models_own = len(args) <= 1 and kwargs.get("position_ids") is None


def _forget_caller_positions(module, args, kwargs, output):
    global _positions_are_the_models_own
    _positions_are_the_models_own = False


def _packed_sequences_unless_own_positions(find):
    """transformers' packed-document detection, skipped for the model's own positions. It
    reads the position ids' values, which a traced graph cannot, so under torch.compile
    transformers assumes packing and builds the full mask for every batch."""
    def find_packed_sequence_indices(position_ids):
        if _positions_are_the_models_own:
            return None
        return find(position_ids)
    find_packed_sequence_indices.rapidformer_wrapped = find
    return find_packed_sequence_indices


HALF = (torch.bfloat16, torch.float16)


def varlen_attention(module, query, key, value, cu_seq_lens, max_length: int, scaling, dropout,
                     rows_length: int | None = None):
    """Attention within each sequence of a packed row; query/key/value [1, heads, T, dim],
    returns [1, T, heads, dim] as transformers' attention functions do. `max_length` bounds
    every segment, the tail that pads the row included: the flash kernel computes only the
    first `max_length` positions of each (models/unpadded.py). bf16/fp16 on a GPU:
    the variable-length flash kernel, which has no dropout (`flash_drops_dropout` tells the
    run before it starts: a log call here would break the compiled graph in every layer);
    otherwise the sequences are put back into rows of `rows_length` (the longest sequence;
    default `max_length`) for SDPA, where a longer tail wraps (the attention costs what padded
    attention costs, the rest of the model still runs on the real tokens only)."""
    if query.is_cuda and query.dtype in HALF:
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length,
                          scale=scaling)
        return out.unsqueeze(0), None
    return _attention_in_rows(module, query, key, value, cu_seq_lens, rows_length or max_length,
                              scaling, dropout)


def flash_drops_dropout(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed batches on this device and compute dtype take the flash kernel, which
    applies no attention dropout."""
    return device.type == "cuda" and dtype in HALF


def _attention_in_rows(module, query, key, value, cu_seq_lens, max_length, scaling, dropout):
    heads, total, dim = query.shape[1:]
    rows = cu_seq_lens.numel() - 1
    index = torch.arange(total, device=query.device)
    row = torch.searchsorted(cu_seq_lens[1:], index, right=True).clamp(max=rows - 1)
    # the tail segment (padding to a multiple) may be longer than a row: it wraps, and its
    # outputs are never read
    position = (index - cu_seq_lens[row]) % max_length
    valid = torch.zeros(rows, max_length, dtype=torch.bool, device=query.device)
    valid[row, position] = True
    valid[:, 0] = True  # no row without a key: an empty row's softmax would be NaN

    def to_rows(t):
        out = t.new_zeros(rows, max_length, heads, dim)
        out[row, position] = t[0].transpose(0, 1)
        return out.transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        to_rows(query), to_rows(key), to_rows(value), attn_mask=valid[:, None, None, :],
        dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2)[row, position].unsqueeze(0), None


def training_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """transformers' SDPA attention, or the per-sequence attention of a packed batch."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    # a packed encoder batch: transformers from 5.25 also builds the block-diagonal mask of the
    # packed sequences from position_ids; the same attention, which the varlen path computes
    # without an [L, L] mask (a causal module's packed rows keep transformers' causal mask)
    packed_encoder = attention_mask is None or getattr(module, "is_causal", True) is False
    if cu_seq_lens is not None and packed_encoder:
        return varlen_attention(module, query, key, value, cu_seq_lens, kwargs["max_length_q"],
                                scaling, dropout, kwargs.get("rows_length"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


def register() -> None:
    """Make `rapidformer_sdpa` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface, masking_utils

    AttentionInterface.register(TRAINING_SDPA, training_attention)
    masking_utils.AttentionMaskInterface.register(TRAINING_SDPA, training_sdpa_mask)
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is not None and not hasattr(find, "rapidformer_wrapped"):
        masking_utils.find_packed_sequence_indices = _packed_sequences_unless_own_positions(find)


def _switchable(model) -> bool:
    """True if the model's attention reads its implementation from transformers' interface by
    name and its code never tests for the name "sdpa" (a few families do, and would take a
    slower branch under another name)."""
    cls = type(model)
    if not getattr(cls, "_can_set_attn_implementation", lambda: False)():
        return False
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return False
    return '== "sdpa"' not in source and "== 'sdpa'" not in source


def use_training_sdpa(model) -> bool:
    """Switch a Hugging Face model that uses `sdpa` (itself and its sub-models) to
    `rapidformer_sdpa`; True if it did. Other models and implementations are left alone."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not models or not all(_switchable(m) for m in models):
        return False
    configs = {id(m.config): m.config for m in models}
    if any(c._attn_implementation != "sdpa" for c in configs.values()):
        return False
    register()
    for config in configs.values():
        config._attn_implementation_internal = TRAINING_SDPA
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and getattr(sub, "_attn_implementation", None) == "sdpa":
                sub._attn_implementation_internal = TRAINING_SDPA
    model.register_forward_pre_hook(_note_caller_positions, with_kwargs=True)
    model.register_forward_hook(_forget_caller_positions, with_kwargs=True, always_call=True)
    log.info("attention: transformers' SDPA, without a causal mask for batches without padding "
             "under torch.compile too (%s)", TRAINING_SDPA)
    return True
