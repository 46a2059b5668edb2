"""Megatron's left-to-right masks for a batch of GPT token ids (the seed imports
`get_ltor_masks_and_position_ids` from `megatron.utils`; it is `from rapidformer import
get_ltor_masks_and_position_ids` here, with the same arguments and results)."""
from __future__ import annotations

import torch


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool):
    """(attention_mask [b or 1, 1, s, s] bool, True where a position may NOT attend;
    loss_mask [b, s] float, 0 after an end of document when eod_mask_loss; position_ids [b, s],
    restarting after each end of document when reset_position_ids)."""
    batch, seq = data.shape
    mask_batch = batch if reset_attention_mask else 1
    allowed = torch.tril(torch.ones((mask_batch, seq, seq), device=data.device)).view(
        mask_batch, 1, seq, seq)
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq, dtype=torch.long, device=data.device).unsqueeze(0) \
        .expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(batch):
            start = 0
            for i in (data[b] == eod_token).nonzero().flatten().tolist():
                if reset_attention_mask:  # no attention across the document boundary
                    allowed[b, 0, i + 1:, :i + 1] = 0
                if reset_position_ids:
                    position_ids[b, i + 1:] -= i + 1 - start
                    start = i + 1
    return allowed < 0.5, loss_mask, position_ids
