"""Encoders on their real tokens only (`trainer.unpad=true`), and BERT's masked-LM head on the
masked positions only.

A padded batch spends the padding's share of every matmul on nothing: on the quickstart-like
paraphrase data (mean about 50 tokens, long tail to 128) a batch padded to its longest row is
about 55 % padding, and BERT pretraining on short documents 82 %. The unpadded layout puts a
batch's sequences one after another in a single row of T real tokens (`[1, T]`), with
positions restarting at each sequence and `cu_seq_lens_q` (the cumulative sequence ends) telling
the attention where each sequence starts; attention runs per sequence through torch's
variable-length flash kernel (`models/attention.py`). Nothing else in an encoder mixes tokens,
so every other layer computes exactly what it computes on the padded batch, minus the padding.

The layout, made on the CPU by the collate step (`Unpad`), is fixed in shape apart from T: the
batch's B sequences and one tail segment that pads T up to a multiple of `token_multiple` (so
that a compiled model meets few shapes; under CUDA graphs a step that grows with T,
`data/lengths.packed_length`), `cu_seq_lens_q` has B + 2 entries, and the tail's tokens have
label -100.

The attention is told the longest segment a row can hold (`longest_segment`): a sequence (at
most data.max_seq_length tokens) or the tail (under the step the row is rounded to: 255 with
graph=compile's 256; up to an eighth of the batch's most tokens under CUDA graphs). The
variable-length flash kernel computes only that many positions of each segment; the rest of a
longer one is left as whatever memory held (`empty_like`), forward and backward alike, and
reaches the weights' gradients (a NaN times a zero gradient is NaN). Telling it
data.max_seq_length alone made MRPC fine-tuning at 128 tokens with graph=compile NaN from its
second step on a GPU (issue 37); the collate refuses a batch with a longer segment. The rows
path (no flash kernel: a CPU, fp32) lays the sequences out in rows of data.max_seq_length, where
a longer tail wraps (its outputs are never read).

The task heads see the packed layout through `use_unpadded_forward`, which gives the model a
forward that takes either layout: the [CLS] of each sequence is read at its start
(classification, next-sentence prediction), token heads run on every real token, and the
masked-LM head runs only where a token carries a loss (`masked_positions`, also on padded
batches: a 768 x 30,522 matmul is about a fifth of BERT-base's FLOPs per token, and 85 % of its
rows are thrown away by the loss). Losses are the Hugging Face models' own, over the same
examples (tests/test_unpadded.py compares them on CPU).

Attention dropout: torch's variable-length flash kernel has none, so on a GPU the unpadded
path trains without it (hidden dropout stays); a line at the start says so, and
docs/benchmarks.md measures the effect on the loss. The CPU path (a block-diagonal mask through
SDPA) keeps it.
"""
from __future__ import annotations

import logging

import torch

from rapidformer.data.counts import with_counts
from rapidformer.data.lengths import IGNORE, fill_value, packed_length, packed_step, round_up
from rapidformer.errors import ConfigError, InputError

log = logging.getLogger("rapidformer")


# under CUDA graphs the masked positions are padded to a multiple of this share of the batch's
# token positions: their count then follows the row's length instead of giving every length a
# few shapes of its own (BERT's masked share is 15 %; the head's padded rows cost about 1 % of a
# BERT-base step)
MASKED_SHARE_STEP = 32


def masked_positions(labels: torch.Tensor, multiple: int, relative: bool = False) -> torch.Tensor:
    """The flat indices of the tokens with a loss, -1 after them up to a multiple of `multiple`
    (a compiled head meets few shapes); `relative`: of the batch's positions / 32 when that
    is more (CUDA graphs)."""
    if relative:
        multiple = max(multiple, round_up(labels.numel() // MASKED_SHARE_STEP, multiple))
    index = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    padded = torch.full((round_up(max(index.numel(), 1), multiple),), -1, dtype=torch.long)
    padded[:index.numel()] = index
    return padded


def unpad_batch(batch: dict, pad_id: int, token_multiple: int, most_tokens: int | None = None
                ) -> dict:
    """A padded batch (`attention_mask` marks the real tokens, on either side) in the packed
    layout: every [B, S] tensor becomes [1, T] (T: the real tokens, rounded up to
    `token_multiple`, or with `most_tokens` the step that grows with T, with a tail segment),
    [B] tensors stay, `position_ids` restart at each sequence, and `cu_seq_lens_q` holds the
    B + 2 sequence boundaries."""
    mask = batch["attention_mask"].bool()
    rows, width = mask.shape
    lengths = mask.sum(1)
    real = int(lengths.sum())
    total = packed_length(real, token_multiple, most_tokens)
    out = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if torch.is_tensor(value) and value.shape[:2] == (rows, width) and value.dim() == 2:
            flat = value[mask]
            tail = torch.full((total - real,), fill_value(key, pad_id), dtype=value.dtype)
            out[key] = torch.cat([flat, tail]).unsqueeze(0)
        else:
            out[key] = value
    if "position_ids" not in batch:
        positions = (mask.cumsum(1) - 1)[mask]
        out["position_ids"] = torch.cat([positions, positions.new_zeros(total - real)]
                                        ).unsqueeze(0)
    ends = torch.zeros(rows + 2, dtype=torch.long)
    ends[1:rows + 1] = lengths.cumsum(0)
    ends[rows + 1] = total
    out["cu_seq_lens_q"] = ends
    return out


def longest_segment(max_length: int, token_multiple: int, most_tokens: int | None = None) -> int:
    """The longest segment of a packed row: a sequence (at most `max_length` tokens) or the
    tail that pads the row up to a multiple of `token_multiple` (at most that many tokens, when
    the batch has no real token), or with `most_tokens` (the step grows with the row, up to a
    batch of that many) up to the largest step. The attention kernel must be told at least
    this."""
    return max(max_length, packed_step(most_tokens or 1, token_multiple, most_tokens))


class Unpad:
    """Collate step: the wrapped collate function's padded batch, unpadded; with
    `mlm_multiple`, also the masked-LM positions. A batch with a sequence longer than
    `max_length` or a segment longer than `longest` (what the model's attention is told,
    `longest_segment`) is refused. `most_tokens`: the shapes CUDA graphs need (the row's
    step grows with it, the masked count follows it)."""

    def __init__(self, collate, pad_id: int, token_multiple: int = 64,
                 mlm_multiple: int | None = None, longest: int | None = None,
                 most_tokens: int | None = None, max_length: int | None = None):
        self.collate, self.pad_id = collate, pad_id
        self.token_multiple, self.mlm_multiple = token_multiple, mlm_multiple
        self.longest, self.most_tokens, self.max_length = longest, most_tokens, max_length

    def __call__(self, features):
        batch = unpad_batch(dict(self.collate(features)), self.pad_id, self.token_multiple,
                            self.most_tokens)
        if self.mlm_multiple:
            batch["masked_positions"] = masked_positions(batch["labels"], self.mlm_multiple,
                                                         self.most_tokens is not None)
        ends = batch["cu_seq_lens_q"]  # B sequences, then the tail that pads the row
        lengths = ends[1:] - ends[:-1]
        for bound, segments in ((self.longest, lengths), (self.max_length, lengths[:-1])):
            segment = int(segments.max()) if segments.numel() else 0
            if bound is not None and segment > bound:
                raise InputError(
                    f"trainer.unpad: a packed batch holds a segment of {segment} tokens, "
                    f"longer than the {bound} the attention computes per sequence "
                    f"(data.max_seq_length, or the multiple the row is rounded up to): the "
                    f"data reached the collate untruncated; set data.max_seq_length to the "
                    f"longest example")
        return with_counts(batch, samples=ends.numel() - 2, tokens=int(ends[-2]),
                           slots=batch["input_ids"].numel())


class WithMaskedPositions:
    """Collate step for padded masked-LM batches: the positions the head runs on."""

    def __init__(self, collate, multiple: int = 64, relative: bool = False):
        self.collate, self.multiple, self.relative = collate, multiple, relative
        self.enabled = True  # off for a model that runs its own head

    def __call__(self, features):
        batch = dict(self.collate(features))
        if self.enabled and "labels" in batch:
            batch["masked_positions"] = masked_positions(batch["labels"], self.multiple,
                                                         self.relative)
        return batch


# --- the model side -----------------------------------------------------------------------------
HEADS = {"BertForSequenceClassification": "sequence_classification",
         "BertForTokenClassification": "token_classification",
         "BertForMaskedLM": "masked_lm",
         "BertForPreTraining": "bert_pretraining"}


def supported(model) -> str | None:
    """The head kind of a model this module drives, or None."""
    return HEADS.get(type(model).__name__)


def use_unpadded_forward(model, max_length: int, longest: int | None = None):
    """Give a Hugging Face BERT task model a forward that also takes the packed layout and
    `masked_positions`; batches without them go to the model's own forward. `max_length`: the
    longest sequence; `longest`: the longest segment of the packed rows it will see, the tail
    included (`longest_segment`; default `max_length`). Set before any wrapper (DDP,
    torch.compile, FSDP2), which then call it."""
    kind = supported(model)
    if kind is None:
        raise ConfigError([f"trainer.unpad and the masked-positions head drive Hugging Face "
                           f"BERT models ({', '.join(HEADS)}); {type(model).__name__} is not "
                           f"one: set trainer.unpad=false (and task.mlm_head=all)"])
    own = model.forward
    lengths = (max_length, longest or max_length)

    def forward(*args, cu_seq_lens_q=None, masked_positions=None, **batch):
        if cu_seq_lens_q is None and masked_positions is None:
            return own(*args, **batch)
        return _FORWARDS[kind](model, batch, cu_seq_lens_q, masked_positions, lengths)

    model.forward = forward
    return model


def _encode(model, batch: dict, cu, lengths: tuple[int, int]) -> torch.Tensor:
    """The encoder's last hidden states, flat: [B*S, H] padded, [T, H] packed. `lengths`: the
    longest sequence (the rows path's row) and the longest segment (the flash kernel's)."""
    inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "position_ids",
                                    "attention_mask") if batch.get(k) is not None}
    if cu is not None:
        cu = cu.to(torch.int32)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=lengths[1],
                      max_length_k=lengths[1], rows_length=lengths[0])
    hidden = model.base_model(**inputs).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def _first_tokens(flat: torch.Tensor, batch: dict, cu) -> torch.Tensor:
    """Each sequence's first token ([CLS]): [B, H]."""
    if cu is None:
        return flat.view(batch["input_ids"].shape[0], -1, flat.shape[-1])[:, 0]
    return flat[cu[:-2]]


def _pooled(model, flat, batch, cu) -> torch.Tensor:
    return model.base_model.pooler(_first_tokens(flat, batch, cu).unsqueeze(1))


def _masked_lm(model, flat, batch, positions):
    """(loss, logits) of the MLM head on the labelled positions only."""
    labels = batch["labels"].reshape(-1)
    if positions is None:
        positions = (labels != IGNORE).nonzero().squeeze(1)
    valid = positions >= 0
    index = positions.clamp(min=0)
    chosen = torch.where(valid, labels[index], torch.full_like(index, IGNORE))
    logits = model.cls.predictions(flat[index])
    loss = torch.nn.functional.cross_entropy(logits.float(), chosen, ignore_index=IGNORE)
    return loss, logits


def _sequence_classification(model, batch, cu, positions, lengths):
    from transformers.modeling_outputs import SequenceClassifierOutput

    flat = _encode(model, batch, cu, lengths)
    logits = model.classifier(model.dropout(_pooled(model, flat, batch, cu)))
    labels = batch.get("labels")
    loss = None if labels is None else _classification_loss(model.config, logits, labels)
    return SequenceClassifierOutput(loss=loss, logits=logits)


def _classification_loss(config, logits, labels):
    """Hugging Face's BertForSequenceClassification loss, by its problem type."""
    functional = torch.nn.functional
    problem = config.problem_type or ("regression" if config.num_labels == 1 else
                                      "single_label_classification"
                                      if labels.dtype in (torch.long, torch.int) else
                                      "multi_label_classification")
    if problem == "regression":
        return functional.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
    if problem == "single_label_classification":
        return functional.cross_entropy(logits.float().view(-1, config.num_labels),
                                        labels.view(-1))
    return functional.binary_cross_entropy_with_logits(logits.float(), labels.float())


def _token_classification(model, batch, cu, positions, lengths):
    from transformers.modeling_outputs import TokenClassifierOutput

    flat = _encode(model, batch, cu, lengths)
    logits = model.classifier(model.dropout(flat))
    labels = batch.get("labels")
    loss = None if labels is None else torch.nn.functional.cross_entropy(
        logits.float(), labels.reshape(-1), ignore_index=IGNORE)
    return TokenClassifierOutput(loss=loss, logits=logits.view(*batch["input_ids"].shape, -1))


def _masked_lm_forward(model, batch, cu, positions, lengths):
    from transformers.modeling_outputs import MaskedLMOutput

    flat = _encode(model, batch, cu, lengths)
    loss, logits = _masked_lm(model, flat, batch, positions)
    return MaskedLMOutput(loss=loss, logits=logits)


def _pretraining_forward(model, batch, cu, positions, lengths):
    from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

    flat = _encode(model, batch, cu, lengths)
    mlm_loss, logits = _masked_lm(model, flat, batch, positions)
    relationship = model.cls.seq_relationship(_pooled(model, flat, batch, cu))
    loss = mlm_loss
    if batch.get("next_sentence_label") is not None:
        loss = loss + torch.nn.functional.cross_entropy(
            relationship.float().view(-1, 2), batch["next_sentence_label"].view(-1))
    return BertForPreTrainingOutput(loss=loss, prediction_logits=logits,
                                    seq_relationship_logits=relationship)


_FORWARDS = {"sequence_classification": _sequence_classification,
             "token_classification": _token_classification,
             "masked_lm": _masked_lm_forward,
             "bert_pretraining": _pretraining_forward}
