"""task.lm_head=labelled at its edges (models/chunked_loss.py, transforms/labelled_head.py):
fp16 autocast with loss scaling gives the model's own gradients (the chunked loss must not
underflow its unscaled fp16 gradients), no gradient is computed where none is wanted
(evaluation under torch.no_grad), and a deep copy of a wrapped model runs its own forward."""
from __future__ import annotations

import copy

import torch

from rapidformer.data.lengths import IGNORE
from rapidformer.models import chunked_loss
from rapidformer.transforms.labelled_head import wrap_forward
from tests.test_decoders import tiny_llama


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(vocab, rows, length):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, : length // 4] = IGNORE
    return {"input_ids": ids, "labels": labels}


def test_fp16_autocast_with_loss_scaling_gives_the_models_own_gradients():
    # at a real vocabulary and a few hundred labelled tokens, softmax / count is below fp16's
    # smallest numbers: computed unscaled in the forward, it underflows (GradScaler scales later)
    vocab, scale = 32000, 2.0 ** 16
    b = _batch(vocab, 2, 512)
    reference = tiny_llama(vocab_size=vocab, max_position_embeddings=512)
    reference(**b, use_cache=False).loss.backward()
    expected = _grads(reference)
    errors = {}
    for wrap in (False, True):
        model = tiny_llama(vocab_size=vocab, max_position_embeddings=512)
        if wrap:
            wrap_forward(model)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**b, use_cache=False).loss
        (loss * scale).backward()
        got = {n: g / scale for n, g in _grads(model).items()}
        errors[wrap] = max(float((got[n].float() - expected[n]).norm() / expected[n].norm())
                           for n in expected)
    assert errors[True] < 3 * errors[False] + 1e-3, errors


def test_no_gradient_is_computed_under_no_grad(monkeypatch):
    seen = []
    forward = chunked_loss._LinearCrossEntropy.forward

    def spy(ctx, *args):
        out = forward(ctx, *args)
        seen.append(list(ctx.needs_input_grad[:2]))
        return out

    monkeypatch.setattr(chunked_loss._LinearCrossEntropy, "forward", staticmethod(spy))
    model = tiny_llama(tie_word_embeddings=True)  # a head that trains (full fine-tuning)
    wrap_forward(model)
    model.eval()
    with torch.no_grad():
        model(**_batch(96, 2, 20), use_cache=False)
    # no gradient asked of the hidden states or of the head: no [V, H] fp32 gradient buffer
    assert seen == [[False, False]]


def test_a_deep_copy_of_a_wrapped_model_runs_its_own_weights():
    model = tiny_llama()
    wrap_forward(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        ids = torch.randint(0, 96, (1, 8))
        logits = twin(input_ids=ids, use_cache=False).logits  # the fallback: no labels
    assert bool((logits == 0).all())


def test_an_output_layer_with_lora_adapters_trains_them():
    """peft.target_modules naming lm_head: the wrapped forward would read the base weight only
    (the adapters never trained); the model's own forward runs the adapted head instead."""
    import peft

    b = _batch(96, 2, 24)
    losses, grads = {}, {}
    for wrap in (False, True):
        torch.manual_seed(0)
        model = tiny_llama()
        if wrap:
            wrap_forward(model)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                               "lm_head"]))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
        loss = model(**b, use_cache=False).loss
        loss.backward()
        losses[wrap] = float(loss)
        grads[wrap] = _grads(model)
    head_grads = [n for n in grads[True] if "lm_head.lora_" in n]
    assert len(head_grads) == 2 and all(float(grads[True][n].abs().sum()) > 0 for n in head_grads)
    assert abs(losses[True] - losses[False]) < 1e-5


def test_the_transform_leaves_an_adapted_output_layer_to_the_models_forward(caplog):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.transforms.base import ApplyContext
    from rapidformer.transforms.labelled_head import LabelledHead

    _, cfg = settle(compose(["+recipe=llama_lora", "trainer.device=cpu",
                             "peft.modules_to_save=null",
                             "peft.target_modules=[q_proj,lm_head]"]), "out")
    with caplog.at_level("INFO", logger="rapidformer"):
        model = LabelledHead(cfg).apply(tiny_llama(), ApplyContext(
            run_dir=None, device=torch.device("cpu")))
    assert not hasattr(model, "_rapidformer_own_forward")
    assert "peft adapts the output layer (lm_head)" in caplog.text
