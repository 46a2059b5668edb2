"""How a black-box task's batches are shaped: padded to data.pad_to's lengths, with the
positions BERT's MLM head runs on (task.mlm_head=masked), and, for training, in the layout the
model transforms ask for (the packed attention path: rapidformer/transforms/packed.py)."""
from __future__ import annotations

import logging

from rapidformer.data.lengths import PadTo, bucket_lengths
from rapidformer.models.unpadded import WithMaskedPositions, supported, use_unpadded_forward
from rapidformer.transforms import rounds_lengths
from rapidformer.transforms.base import shapes_for_graphs

log = logging.getLogger("rapidformer")

# masked-LM positions are padded to a multiple of this (few shapes for a compiled head)
MLM_MULTIPLE = 64


class Batching:
    def __init__(self, cfg, tokenizer, transforms, masked_lm: bool = False):
        self.cfg, self.transforms = cfg, transforms
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        # a compiled model (and float8's matmuls) meets lengths rounded to few multiples
        self.compiled = rounds_lengths(cfg)
        self.masked_lm = masked_lm
        # a transform's forward may run BERT's MLM head on the masked positions only (the
        # unpadded path), evaluation included: its batches then carry them
        self.transform_forward = transforms.masked_lm_positions()
        self.positions = masked_lm and (cfg.task.mlm_head == "masked" or self.transform_forward)
        self._with_positions: list = []
        # CUDA graphs record a graph per shape: the masked count then follows the batch's size
        self.graphs = shapes_for_graphs(cfg)

    def collates(self, collate):
        """(the training collate, the evaluation collate) around a task's padding collate.
        Evaluation stays padded: metrics read rows."""
        d = self.cfg.data
        rule = bucket_lengths(d.pad_to, d.max_seq_length, self.compiled)
        # on the right, as the task's collate pads (RightPadded)
        padded = PadTo(collate, rule, self.pad_id) if rule is not None else collate
        evaluation = self._positions_of(padded)
        return self._training(collate, evaluation), evaluation

    def pretraining_collate(self, collate):
        """BERT pretraining's one collate (its evaluation computes the loss only)."""
        return self._training(collate, self._positions_of(collate))

    def _training(self, collate, padded):
        """The transforms' training collate around the task's `collate`, or `padded`."""
        mlm = MLM_MULTIPLE if self.masked_lm else None
        own = self.transforms.training_collate(collate, self.pad_id, self.compiled, mlm)
        return padded if own is collate else own

    def _positions_of(self, collate):
        if not self.positions:
            return collate
        with_positions = WithMaskedPositions(collate, MLM_MULTIPLE, relative=self.graphs)
        self._with_positions.append(with_positions)
        return with_positions

    def drive(self, model):
        """The task's model, with the forward task.mlm_head=masked needs (the packed layout's
        forward is its transform's). A model the masked-positions head does not know runs its
        own full head."""
        if not self.positions or self.transform_forward:
            return model  # the transform gives it its forward
        if supported(model) is None:
            log.info("task.mlm_head=masked: %s runs its own head on every position (the "
                     "masked-positions head knows Hugging Face BERT models)", type(model).__name__)
            for collate in self._with_positions:
                collate.enabled = False
            return model
        return use_unpadded_forward(model, self.cfg.data.max_seq_length)


class RightPadded:
    """A task's padding collate, padding on the right whatever the tokenizer's padding_side
    (a decoder's is often "left", for batched generation): a model with learned positions
    (GPT-2) numbers a row's positions from its first slot, so left padding would train and
    score every row at shifted positions. The tokenizer keeps its own side, as it is saved."""

    def __init__(self, collate, tokenizer):
        self.collate, self.tokenizer = collate, tokenizer

    def __call__(self, features):
        side = getattr(self.tokenizer, "padding_side", "right")
        if side == "right":
            return self.collate(features)
        self.tokenizer.padding_side = "right"
        try:
            return self.collate(features)
        finally:
            self.tokenizer.padding_side = side
