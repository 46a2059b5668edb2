"""Unpadded (packed) encoder batches and the masked-positions MLM head give the padded path's
losses and predictions on the same examples (rapidformer/models/unpadded.py)."""
from __future__ import annotations

import pytest
import torch

from rapidformer.errors import ConfigError
from rapidformer.models.attention import use_training_sdpa
from rapidformer.models.unpadded import (Unpad, WithMaskedPositions, masked_positions,
                                         unpad_batch, use_unpadded_forward)

transformers = pytest.importorskip("transformers")

PAD = 0
LENGTHS = [5, 12, 3, 9]


def tiny_config(**extra):
    return transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=64, pad_token_id=PAD,
                                   attn_implementation="sdpa", **extra)


def padded_batch(lengths=LENGTHS, width=16, seed=0):
    """A right-padded batch: ids, mask, segments (a pair per row), token labels."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.full((rows, width), PAD)
    mask = torch.zeros(rows, width, dtype=torch.long)
    types = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(5, 97, (n,), generator=g)
        mask[r, :n] = 1
        types[r, n // 2:n] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def model_of(cls, **extra):
    torch.manual_seed(0)
    model = cls(tiny_config(**extra)).eval()
    assert use_training_sdpa(model)
    return use_unpadded_forward(model, max_length=64)


def test_the_packed_layout_holds_the_real_tokens_in_order():
    batch = padded_batch()
    packed = unpad_batch(batch, PAD, token_multiple=8)
    real = sum(LENGTHS)
    assert packed["input_ids"].shape == (1, 32)  # 29 real tokens, up to a multiple of 8
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 17, 20, 29, 32]
    assert torch.equal(packed["input_ids"][0, :real], batch["input_ids"][batch["attention_mask"].bool()])
    assert packed["position_ids"][0, :7].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert "attention_mask" not in packed


def test_sequence_classification_loss_and_logits_equal_the_padded_model():
    model = model_of(transformers.BertForSequenceClassification, num_labels=3)
    batch = {**padded_batch(), "labels": torch.tensor([0, 2, 1, 2])}
    with torch.no_grad():
        padded = model(**batch)
        packed = model(**unpad_batch(batch, PAD, 8))
    assert packed.logits.shape == (4, 3)
    torch.testing.assert_close(packed.logits, padded.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed.loss, padded.loss, atol=1e-5, rtol=1e-4)


def test_a_tail_longer_than_a_row_and_an_exact_fit_change_nothing():
    model = model_of(transformers.BertForSequenceClassification, num_labels=2)
    batch = {**padded_batch(), "labels": torch.tensor([0, 1, 1, 0])}
    with torch.no_grad():
        padded = model(**batch).logits
        for multiple in (1, 29, 100):  # 29 real tokens: no tail, no tail, a 71-token tail
            packed = unpad_batch(batch, PAD, multiple)
            torch.testing.assert_close(model(**packed).logits, padded, atol=1e-5, rtol=1e-4)


def test_gradients_equal_the_padded_model():
    model = model_of(transformers.BertForSequenceClassification, num_labels=2)
    batch = {**padded_batch(), "labels": torch.tensor([0, 1, 1, 0])}
    grads = []
    for b in (batch, unpad_batch(batch, PAD, 8)):
        model.zero_grad()
        model(**b).loss.backward()
        grads.append(model.bert.encoder.layer[0].attention.self.query.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_token_classification_loss_equals_the_padded_model():
    model = model_of(transformers.BertForTokenClassification, num_labels=5)
    batch = padded_batch()
    labels = torch.randint(0, 5, batch["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    batch["labels"] = labels.masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        padded = model(**batch)
        packed = model(**unpad_batch(batch, PAD, 8))
    torch.testing.assert_close(packed.loss, padded.loss, atol=1e-5, rtol=1e-4)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(packed.logits[0, :int(real.sum())], padded.logits[real],
                               atol=1e-5, rtol=1e-4)


def mlm_labels(batch, every=3):
    labels = torch.full_like(batch["input_ids"], -100)
    chosen = (torch.arange(labels.numel()).view(labels.shape) % every == 1) & \
        batch["attention_mask"].bool()
    labels[chosen] = batch["input_ids"][chosen]
    return labels


def test_the_masked_positions_head_gives_the_full_heads_loss_padded_and_packed():
    model = model_of(transformers.BertForMaskedLM)
    batch = padded_batch()
    batch["labels"] = mlm_labels(batch)
    with torch.no_grad():
        full = model(**batch).loss
        positions = WithMaskedPositions(lambda f: f, multiple=16)(dict(batch))
        head_only = model(**positions)
        packed = Unpad(lambda f: f, PAD, token_multiple=8, mlm_multiple=16)(dict(batch))
        packed_loss = model(**packed).loss
    count = int((batch["labels"] != -100).sum())
    assert positions["masked_positions"].numel() == 16 and head_only.logits.shape[0] == 16
    assert int((positions["masked_positions"] >= 0).sum()) == count
    torch.testing.assert_close(head_only.loss, full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed_loss, full, atol=1e-5, rtol=1e-4)


def test_pretraining_loss_equals_the_padded_model():
    model = model_of(transformers.BertForPreTraining)
    batch = padded_batch()
    batch["labels"] = mlm_labels(batch, every=4)
    batch["next_sentence_label"] = torch.tensor([1, 0, 0, 1])
    with torch.no_grad():
        full = model(**batch)
        packed = model(**Unpad(lambda f: f, PAD, 8, mlm_multiple=8)(dict(batch)))
    torch.testing.assert_close(packed.loss, full.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed.seq_relationship_logits, full.seq_relationship_logits,
                               atol=1e-5, rtol=1e-4)


def test_masked_positions_mark_the_fill_and_no_label_means_one_slot():
    labels = torch.tensor([[-100, 7, -100], [3, -100, -100]])
    assert masked_positions(labels, 4).tolist() == [1, 3, -1, -1]
    assert masked_positions(torch.full((2, 3), -100), 4).tolist() == [-1, -1, -1, -1]


def test_a_model_it_does_not_drive_is_refused_by_name():
    model = transformers.BertForQuestionAnswering(tiny_config())
    with pytest.raises(ConfigError, match="BertForQuestionAnswering is not one"):
        use_unpadded_forward(model, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length flash kernel "
                    "runs on GPUs")
def test_the_flash_kernel_gives_the_padded_models_loss_on_a_gpu():
    model = model_of(transformers.BertForSequenceClassification, num_labels=3).cuda()
    batch = {**padded_batch(lengths=[5, 60, 33, 17, 1, 64], width=64),
             "labels": torch.tensor([0, 2, 1, 2, 0, 1])}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        padded = model(**{k: v.cuda() for k, v in batch.items()})
        packed = model(**{k: v.cuda() for k, v in unpad_batch(batch, PAD, 64).items()})
    torch.testing.assert_close(packed.logits.float(), padded.logits.float(), atol=2e-2, rtol=2e-2)
