"""The packed attention path: training batches without padding, attention within each example.

Two layouts, one idea (every computed token position is a real token, and no example sees
another):

- `trainer.unpad=true` (Hugging Face BERT encoders): a batch's sequences one after another in a
  single row of real tokens, attention per sequence through torch's variable-length kernel
  (models/unpadded.py holds the layout and the heads' forward);
- `data.packing=true` (task=sft, Hugging Face decoders): several examples a row, positions
  restarting at each, which transformers' attention reads as separate sequences
  (data/chat.py's `pack` and `PackedCollate`).

The transform gives the model its forward (unpad), turns a task's training rows and padding
collate into packed ones, and refuses what the layouts do not serve. Evaluation stays padded:
metrics read rows.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from torch import nn

from rapidformer.data.lengths import bucket_lengths, token_multiple
from rapidformer.models.attention import flash_drops_dropout
from rapidformer.models.dtypes import DTYPES
from rapidformer.transforms.base import ApplyContext, ModelTransform, shapes_for_graphs

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

# the tasks whose Hugging Face BERT heads take the unpadded layout (models/unpadded.py)
UNPADDED_TASKS = ("sequence_classification", "token_classification", "masked_lm",
                  "bert_pretraining")


class PackedSequences(ModelTransform):
    """trainer.unpad=true or data.packing=true."""

    name = "packed"

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.trainer.unpad or cfg.data.packing

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [s for s, on in (("trainer.unpad=true", cfg.trainer.unpad),
                                ("data.packing=true", cfg.data.packing)) if on]

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        t, m, d, task = cfg.trainer, cfg.model, cfg.data, cfg.task.name
        p: list[str] = []
        if d.packing and task != "sft":
            p.append(f"data.packing=true packs examples for task=sft; task={task} does not "
                     f"pack (BERT encoders train without padding with trainer.unpad=true)")
        if not t.unpad:
            return p
        if isinstance(d.pad_to, list):
            p.append(f"data.pad_to={d.pad_to} lists row lengths, but trainer.unpad=true packs "
                     f"each batch into one row of real tokens, rounded up to a multiple: give "
                     f"data.pad_to an integer (e.g. 256) or auto")
        if task not in UNPADDED_TASKS:
            p.append(f"trainer.unpad=true with task={task}: not yet; unpadded training "
                     f"drives {', '.join(UNPADDED_TASKS)} (Hugging Face BERT models); set "
                     f"trainer.unpad=false" + ("; decoders pack examples with data.packing=true"
                                               if task == "sft" else ""))
        elif m.is_megatron or (m.source == "config" and m.arch != "bert"):
            p.append(f"trainer.unpad=true with model={m.name}: unpadded training drives Hugging "
                     f"Face BERT models (model=bert_tiny, bert_base, or model=hf with a BERT "
                     f"checkpoint); set trainer.unpad=false")
        if cfg.graph.name == "ort":
            p.append("trainer.unpad=true with graph=ort: the exported ONNX graph has no "
                     "variable-length attention; use graph=eager or graph=compile")
        return p

    # --- the data ------------------------------------------------------------------------------
    @classmethod
    def masked_lm_positions(cls, cfg: RunConfig) -> bool:
        return cfg.trainer.unpad  # the unpadded forward's head (models/unpadded.py)

    def training_rows(self, rows):
        """data.packing: several encoded examples a row, up to data.max_seq_length tokens."""
        if not self.cfg.data.packing:
            return rows
        from rapidformer.data.chat import pack

        packed = pack(rows, self.cfg.data.max_seq_length)
        log.info("data.packing: %d training examples in %d rows of at most %d tokens",
                 len(rows), len(packed), self.cfg.data.max_seq_length)
        return packed

    def training_collate(self, collate: Callable, pad_id: int, compiled: bool,
                         mlm_multiple: int | None) -> Callable:
        """The training batches' collate: the task's padding `collate` unpadded (with the
        masked-LM positions on a multiple of `mlm_multiple`), or packed rows padded to
        data.pad_to's lengths. `compiled`: lengths are rounded for a compiled model."""
        d = self.cfg.data
        if d.packing:
            from rapidformer.data.chat import PackedCollate

            return PackedCollate(pad_id, bucket_lengths(d.pad_to, d.max_seq_length, compiled))
        from rapidformer.models.unpadded import Unpad, longest_segment

        multiple, most = self._rounding(compiled)
        return Unpad(collate, pad_id, multiple, mlm_multiple=mlm_multiple,
                     longest=longest_segment(d.max_seq_length, multiple, most), most_tokens=most,
                     max_length=d.max_seq_length)

    def _rounding(self, compiled: bool) -> tuple[int, int | None]:
        """(the multiple a packed row is rounded up to, the most tokens a batch holds where the
        step grows with the row: CUDA graphs with data.pad_to=auto; else None)."""
        d = self.cfg.data
        most = (self.cfg.trainer.micro_batch_size * d.max_seq_length
                if shapes_for_graphs(self.cfg) else None)
        return token_multiple(d.pad_to, compiled), most

    # --- the model -----------------------------------------------------------------------------
    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        """trainer.unpad: the BERT task model's forward that takes the packed layout (packed
        decoder rows need none: transformers reads the restarting positions itself)."""
        if not self.cfg.trainer.unpad:
            return model
        from rapidformer.models.unpadded import longest_segment, use_unpadded_forward

        d = self.cfg.data
        multiple, most = self._rounding(context.rounds_lengths)
        # the tail that rounds a row up is a segment too, longer than a sequence when the
        # multiple is (256 under graph=compile, 128-token MRPC): the kernel must cover it
        use_unpadded_forward(model, d.max_seq_length,
                             longest_segment(d.max_seq_length, multiple, most))
        log.info("trainer.unpad: training batches are packed without padding (rounded up "
                 "to %s tokens); evaluation batches stay padded", multiple if most is None else
                 f"a multiple of {multiple}, or an eighth of the row's power of two under CUDA "
                 f"graphs")
        dropout = getattr(getattr(model, "config", None), "attention_probs_dropout_prob", 0.0)
        if dropout and flash_drops_dropout(context.device, DTYPES[self.cfg.precision.dtype]):
            log.warning("trainer.unpad: attention dropout (%.2g) is not applied on the GPU: "
                        "torch's variable-length flash kernel has none (hidden dropout is)",
                        dropout)
        return model

