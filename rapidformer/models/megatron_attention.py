"""Core attention for megatron-core's local layers through torch's scaled_dot_product_attention.

Without Transformer Engine, megatron-core's local layer spec computes attention with
`DotProductAttention`: the scores of every head as a [b * heads, s, s] matrix, an explicit
(unfused) softmax over it, dropout on it, and a second batched matmul, the matrix written, read
and kept for the backward pass. `SDPAttention` takes its place in the spec (the same constructor
and forward contract) and computes the same attention with one `scaled_dot_product_attention`
call: cuDNN's or FlashAttention's fused kernels on a GPU (no s x s matrix is stored), torch's
CPU kernels on a CPU. On GPT 1.3B's shape (one H200, bf16, sequence 2048, micro batch 8) one
layer's attention forward and backward takes 15.5 ms the local way and 1.4 ms through SDPA.

What it keeps from DotProductAttention: the [s, b, heads, head_dim] layout in and
[s, b, heads * head_dim] out, this tensor-parallel rank's heads (heads / TP), grouped-query
attention (num_query_groups), the softmax scale (1/sqrt(head_dim) unless given;
apply_query_key_layer_scaling only rescales a fp16 intermediate there, so it changes nothing
here), attention dropout in training only, drawn inside megatron-core's tensor-parallel RNG
stream as the local module does (under torch.compile with one tensor-parallel rank, from the
default stream: see `_forks_rng`), and megatron's boolean masks (True where a position may NOT
attend). A causal layer with no mask, or with a mask that is the plain causal one, runs SDPA's
causal kernel (`is_causal=True`) and builds no mask; any other mask (a BERT padding mask, a
GPT mask reset at document boundaries) is passed to SDPA as it is.

One difference: a query row masked whole (a padding token under a [b, 1, s, s] padding mask)
attends to every key uniformly in DotProductAttention (its -10000 fill) and gives zeros here.
Nothing reads those rows: with the [b, 1, 1, s] BERT mask built for this module (see
`SDPABertModel` below) no row is masked whole, and every real token's output is the same.

Refused, with the setting named: packed sequences (THD, packed_seq_params), an attention bias,
the padding_causal mask type, sliding-window attention, softmax types other than vanilla,
context parallelism (megatron-core refuses it for its local attention too).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.models.bert.bert_model import BertModel
# the base class: its constructor sets the per-partition head counts and the softmax scale
# exactly as for the local module, and its (empty) sharded state dict is the same
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from rapidformer.errors import InputError, NotAvailableError

# mask types whose rows attend only to earlier positions when no mask is given
_CAUSAL = (AttnMaskType.causal,)
# mask types that take the given mask as it is (as DotProductAttention's torch softmax does)
_AS_GIVEN = (AttnMaskType.padding, AttnMaskType.arbitrary, AttnMaskType.no_mask)


class SDPAttention(DotProductAttention):
    """megatron-core's `DotProductAttention` contract on `F.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type=attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        problems = []
        if config.softmax_type != "vanilla":
            problems.append(f"softmax_type={config.softmax_type!r}")
        if self.scale_mask_softmax.window_size is not None:
            problems.append(f"window_size={config.window_size} (sliding-window attention)")
        if attn_mask_type not in (*_CAUSAL, *_AS_GIVEN):
            problems.append(f"attn_mask_type={attn_mask_type.name}")
        if problems:
            raise NotAvailableError(f"SDPA core attention does not support "
                                    f"{', '.join(problems)}; use model.attn_implementation=eager "
                                    f"(megatron-core's local DotProductAttention)")
        # the local module divides by layer_number here and multiplies back inside its fp32
        # softmax (a fp16 overflow guard): the product is the scale actually applied
        self.sdpa_scale = self.softmax_scale * (self.layer_number if
                                                config.apply_query_key_layer_scaling else 1)
        self.dropout_p = self.attention_dropout.p

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query [sq, b, heads, head_dim], key/value [sk, b, groups, head_dim] (this rank's
        heads and groups); attention_mask bool, broadcastable to [b, heads, sq, sk], True where
        a position may not attend, or None; returns [sq, b, heads * head_dim]."""
        if packed_seq_params is not None:
            raise NotAvailableError("SDPA core attention does not support packed sequences "
                                    "(packed_seq_params, the THD format); they need Transformer "
                                    "Engine's attention")
        if attention_bias is not None:
            raise NotAvailableError("SDPA core attention does not support an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, heads, _ = query.shape
        sk = key.shape[0]
        groups = key.shape[2]
        if heads != groups:  # grouped-query attention: each key/value head serves heads/groups
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        mask, is_causal = self._sdpa_mask(attention_mask, mask_type, sq, sk)
        # [s, b, h, d] -> [b, h, s, d]: views; SDPA reads the strides
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0 and self._forks_rng():
            # the masks of this rank's heads from the tensor-parallel stream (as the local
            # module's dropout), so that ranks drop independently and recompute replays them
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         dropout_p=dropout, is_causal=is_causal,
                                                         scale=self.sdpa_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=is_causal, scale=self.sdpa_scale)
        # [b, h, sq, d] -> [sq, b, h * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _forks_rng(self) -> bool:
        """Whether the dropout masks come from megatron-core's tensor-parallel RNG stream, as
        in the local module (not under sequence parallelism, where it does not either). Under
        torch.compile with one tensor-parallel rank they come from the default stream instead:
        there are no other ranks' heads to differ from, and the stream swap is not traceable
        (a graph break inside megatron-core's attention, where torch.compile cannot resume)."""
        if self.config.sequence_parallel:
            return False
        return not (torch.compiler.is_compiling() and self.tp_group.size() == 1)

    def _sdpa_mask(self, attention_mask, mask_type, sq: int, sk: int):
        """(SDPA's boolean attn_mask, True where a position may attend, or None; is_causal)."""
        if mask_type == AttnMaskType.causal:
            if attention_mask is None or _is_plain_causal(attention_mask, sq, sk):
                if sq == 1:  # one new token (decoding): it may see every key
                    return None, False
                if sq != sk:
                    raise InputError(f"SDPA core attention: a causal mask needs as many "
                                     f"queries as keys (got {sq} and {sk})")
                return None, True
        if attention_mask is None:
            return None, False
        if attention_mask.dtype != torch.bool:
            raise InputError(f"SDPA core attention takes megatron's boolean attention mask "
                             f"(True where a position may not attend), not "
                             f"{attention_mask.dtype}")
        return ~attention_mask, False


# the last mask found to be the plain causal one: every layer of a forward pass gets the same
# mask tensor, so it is compared once per pass, not once per layer
_CHECKED: dict = {"ref": None, "version": None, "causal": False}


def _is_plain_causal(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether a megatron mask is the causal one, the same for every sequence of the batch
    (what get_ltor_masks_and_position_ids gives without reset_attention_mask). Not looked at
    under torch.compile (a data-dependent answer would break the graph): the mask is used."""
    # [1, 1, s, s], or [b, 1, s, s] (one per sequence, as a script may build it)
    if sq != sk or mask.dtype != torch.bool or mask.shape[-2:] != (sq, sk) \
            or any(n != 1 for n in mask.shape[1:-2]):
        return False
    if torch.compiler.is_compiling():
        return False
    ref = _CHECKED["ref"]
    if ref is not None and ref() is mask and _CHECKED["version"] == mask._version:
        return _CHECKED["causal"]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    answer = bool(torch.equal(mask, causal.expand_as(mask)))
    _CHECKED.update(ref=weakref.ref(mask), version=mask._version, causal=answer)
    return answer


class SDPABertModel(BertModel):
    """megatron-core's BertModel with SDPAttention: its padding mask is built as [b, 1, 1, s]
    (True at padded keys; every query row keeps its real keys), what megatron-core gives
    Transformer Engine's attention, instead of the [b, 1, s, s] outer product it builds for
    its local attention (whose padded query rows are masked whole). BertModel picks the shape
    by asking whether the spec's attention is its own class or Transformer Engine's; this is
    neither."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        return "b11s"
