"""A causal LM's next-token loss with the output layer run at the labelled positions only, a
chunk of positions at a time, its gradients computed as it goes.

At Llama 3's 128,256-entry vocabulary, a step of 4 x 2048 tokens through the model's own forward
holds the logits in bf16 (2.1 GB), their fp32 copy for the loss (4.2 GB) and the log-softmax the
backward needs (4.2 GB), of which the prompt's positions (a quarter of an instruction chat) carry
no label at all. Here the positions whose next token is labelled are gathered first, and each
chunk's logits live only while its loss and its gradients (with respect to the hidden states,
and to the head's weight when it trains) are computed; the backward only scales what the
forward kept. The loss is the model's own: the mean cross-entropy over the labelled positions,
the logits computed in the autocast dtype and the softmax in fp32 (tested against the model's
forward, value and gradients). TRL's SFTTrainer and liger-kernel's fused linear cross-entropy
do the same with Triton kernels; this one is torch's own operations, on any device.
"""
from __future__ import annotations

import torch

from rapidformer.data.lengths import IGNORE

# logits a chunk holds (fp32): 2**27 is 0.5 GB, about a thousand positions at 128k entries
CHUNK_ELEMENTS = 2**27
# the logits' gradients are computed in the forward, before any loss scaling: in fp16 the
# probabilities of a 128k vocabulary (about 1e-5) would fall to fp16's subnormals and their
# sum over the vocabulary would lose its precision, so they are scaled by this power of two
# for the fp16 matmuls (softmax - one-hot is at most 1 in magnitude: no overflow) and unscaled
# in fp32; the division by the labelled count waits for the backward, in fp32 too
FP16_GRAD_SCALE = 2.0**10


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T, targets) / count, rows whose target
    is IGNORE left out; the gradients are computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, count, dtype):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        scale = FP16_GRAD_SCALE if dtype == torch.float16 else 1.0
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # fp32 when the matmuls are fp16 (their scaled results are unscaled in fp32)
        kept = torch.float32 if scale != 1.0 else dtype
        grad_hidden = torch.empty(hidden.shape, dtype=kept, device=hidden.device) \
            if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_weight else None
        rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
        for start in range(0, hidden.shape[0], rows):
            h = hidden[start:start + rows].to(dtype)
            t = targets[start:start + rows]
            valid = t != IGNORE
            safe = t.clamp(min=0)
            logits = (h @ w.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            loss += torch.where(valid, lse - picked, 0.0).sum()
            if not (need_hidden or need_weight):
                continue
            # d (sum of the rows' losses) / d logits = softmax - one_hot(target), labelled rows
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, safe[:, None], -torch.ones_like(picked[:, None]))
            grad.mul_((valid.float() * scale)[:, None])
            grad = grad.to(dtype)
            if need_hidden:
                grad_hidden[start:start + rows] = (grad @ w).to(kept)
            if need_weight:
                grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes, ctx.scale = (hidden.dtype, weight.dtype), scale
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        factor = grad_loss.float() / (count * ctx.scale)
        return (None if grad_hidden is None else (grad_hidden.float() * factor).to(hidden_dtype),
                None if grad_weight is None else (grad_weight * factor).to(weight_dtype),
                None, None, None)


def next_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    compact: bool = True) -> torch.Tensor:
    """The mean next-token cross-entropy of a causal LM: `hidden` [batch, seq, H] the backbone's
    last hidden states, `weight` [V, H] the output layer's (no bias), `labels` [batch, seq] the
    unshifted labels (IGNORE where none). `compact`: gather the labelled positions first (False
    keeps every position, a shape that does not depend on the labels, for compiled graphs)."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    if compact:
        keep = (targets != IGNORE).nonzero().squeeze(1)
        hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    count = (targets != IGNORE).sum().clamp(min=1).float()
    if not torch.is_grad_enabled():  # an evaluation: no gradient buffers (a head that trains
        hidden, weight = hidden.detach(), weight.detach()  # would still ask for its own)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else hidden.dtype
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, count, dtype)
