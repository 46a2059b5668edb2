"""How a black-box task's batches are shaped: padded to data.pad_to's lengths, packed without
padding (trainer.unpad), and with the positions BERT's MLM head runs on (task.mlm_head=masked);
and the model forward that reads them (models/unpadded.py)."""
from __future__ import annotations

import logging

from rapidformer.data.lengths import PadTo, bucket_lengths, token_multiple
from rapidformer.models.attention import flash_drops_dropout
from rapidformer.models.dtypes import DTYPES
from rapidformer.models.unpadded import Unpad, WithMaskedPositions, supported, use_unpadded_forward
from rapidformer.planning.run_plan import pick_device

log = logging.getLogger("rapidformer")

# masked-LM positions are padded to a multiple of this (few shapes for a compiled head)
MLM_MULTIPLE = 64


class Batching:
    def __init__(self, cfg, tokenizer, masked_lm: bool = False):
        self.cfg = cfg
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.left = getattr(tokenizer, "padding_side", "right") == "left"
        # float8's weight-gradient matmul needs a token count that is a multiple of 16, which
        # the compiled model's lengths are
        self.compiled = cfg.graph.name == "compile" or cfg.precision.fp8_scaling is not None
        self.unpad = cfg.trainer.unpad
        self.positions = masked_lm and (cfg.task.mlm_head == "masked" or self.unpad)
        self._with_positions: list = []

    def collates(self, collate):
        """(the training collate, the evaluation collate) around a task's padding collate.
        Evaluation stays padded: metrics read rows."""
        d = self.cfg.data
        rule = bucket_lengths(d.pad_to, d.max_seq_length, self.compiled)
        padded = PadTo(collate, rule, self.pad_id, self.left) if rule is not None else collate
        evaluation = self._positions_of(padded)
        if not self.unpad:
            return evaluation, evaluation
        train = Unpad(collate, self.pad_id, token_multiple(d.pad_to, self.compiled),
                      mlm_multiple=MLM_MULTIPLE if self.positions else None)
        return train, evaluation

    def pretraining_collate(self, collate):
        """BERT pretraining's one collate (its evaluation computes the loss only)."""
        if self.unpad:
            return Unpad(collate, self.pad_id, token_multiple(self.cfg.data.pad_to, self.compiled),
                         mlm_multiple=MLM_MULTIPLE)
        return self._positions_of(collate)

    def _positions_of(self, collate):
        if not self.positions:
            return collate
        with_positions = WithMaskedPositions(collate, MLM_MULTIPLE)
        self._with_positions.append(with_positions)
        return with_positions

    def drive(self, model):
        """The task's model, with the forward its batches need. A model the masked-positions
        head does not know runs its own full head (only trainer.unpad requires one it knows)."""
        if not (self.unpad or self.positions):
            return model
        if supported(model) is None and not self.unpad:
            log.info("task.mlm_head=masked: %s runs its own head on every position (the "
                     "masked-positions head knows Hugging Face BERT models)", type(model).__name__)
            for collate in self._with_positions:
                collate.enabled = False
            return model
        use_unpadded_forward(model, self.cfg.data.max_seq_length)
        if self.unpad:
            log.info("trainer.unpad: training batches are packed without padding (rounded up "
                     "to %d tokens); evaluation batches stay padded",
                     token_multiple(self.cfg.data.pad_to, self.compiled))
            self._note_dropout(model)
        return model

    def _note_dropout(self, model) -> None:
        dropout = getattr(getattr(model, "config", None), "attention_probs_dropout_prob", 0.0)
        dtype = DTYPES[self.cfg.precision.dtype]
        if dropout and flash_drops_dropout(pick_device(self.cfg.trainer.device), dtype):
            log.warning("trainer.unpad: attention dropout (%.2g) is not applied on the GPU: "
                        "torch's variable-length flash kernel has none (hidden dropout is)",
                        dropout)
