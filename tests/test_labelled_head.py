"""task.lm_head=labelled: the chunked next-token loss equals the model's own (value and gradients,
fp32 and bf16 autocast, the head frozen or training, tied or not, under peft), its forward
falls back to the model's own where it does not serve, and an sft run trains to the same losses
with it and without it."""
from __future__ import annotations

import pytest
import torch

from rapidformer.data.lengths import IGNORE
from rapidformer.models import chunked_loss
from rapidformer.transforms.labelled_head import LabelledHead, why_not, wrap_forward
from tests.test_decoders import QUIET, pretrain, tiny_llama


def batch(vocab=96, rows=3, length=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, : length // 3] = IGNORE  # a prompt
    labels[1, -4:] = IGNORE  # and padding
    labels[2] = IGNORE  # a row without a label
    labels[2, 5] = ids[2, 5]
    positions = torch.arange(length).expand(rows, -1)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 96 * 7, chunked_loss.CHUNK_ELEMENTS])
@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("head", ["trains", "frozen", "tied"])
def test_the_chunked_loss_is_the_models_own_value_and_gradients(monkeypatch, chunk, compact,
                                                                 head):
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", chunk)  # 1 row a chunk, 7, all
    model = tiny_llama(tie_word_embeddings=head == "tied")
    model.lm_head.weight.requires_grad_(head != "frozen")
    b = batch()
    own = model(**b, use_cache=False).loss
    own.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=b["input_ids"], position_ids=b["position_ids"]).last_hidden_state
    loss = chunked_loss.next_token_loss(hidden, model.lm_head.weight, b["labels"], compact)
    loss.backward()
    got = grads(model)
    assert float(loss) == pytest.approx(float(own), rel=1e-5)
    assert got.keys() == expected.keys()
    assert ("lm_head.weight" in got) == (head == "trains")  # tied: named as the embedding
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


def test_under_bf16_autocast_the_loss_is_the_models_own_within_bf16():
    model = tiny_llama()
    b = batch(length=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = model(**b, use_cache=False).loss
        own.backward()
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        wrap_forward(model)
        loss = model(**b, use_cache=False).loss
        loss.backward()
    assert float(loss) == pytest.approx(float(own), rel=2e-3)
    for name, g in grads(model).items():
        assert torch.cosine_similarity(g.flatten(), expected[name].flatten(), dim=0) > 0.999


def test_the_wrapped_forward_under_peft_trains_the_adapters_as_the_models_own():
    from peft import LoraConfig, get_peft_model

    def adapted(wrap):
        model = tiny_llama()
        if wrap:
            wrap_forward(model)
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[
            "q_proj", "v_proj", "down_proj"], init_lora_weights=False))

    b = batch()
    results = []
    for wrap in (False, True):
        model = adapted(wrap)
        out = model(**b, use_cache=False)
        out.loss.backward()
        results.append((float(out.loss), grads(model), out.logits))
    (own, own_grads, own_logits), (loss, got, logits) = results
    assert loss == pytest.approx(own, rel=1e-5)
    assert got.keys() == own_grads.keys() and all("lora" in n for n in got)
    for name in got:
        torch.testing.assert_close(got[name], own_grads[name], rtol=1e-4, atol=1e-6)
    assert own_logits is not None and logits is None  # the logits never exist


def test_without_labels_or_with_what_it_does_not_serve_the_forward_is_the_models_own():
    model = tiny_llama()
    b = batch()
    with torch.no_grad():
        expected = model(input_ids=b["input_ids"], use_cache=False).logits
        cached = model(**b, use_cache=True)
        wrap_forward(model)
        assert torch.equal(model(input_ids=b["input_ids"], use_cache=False).logits, expected)
        # a cache asked for, or outputs the chunked path does not make: the model's own forward
        again = model(**b, use_cache=True)
        assert again.logits is not None and float(again.loss) == pytest.approx(float(cached.loss))
        hidden = model(**b, output_hidden_states=True)
        assert hidden.hidden_states is not None
        generated = model.generate(b["input_ids"][:1, :5], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 8)


@pytest.mark.parametrize("change, reason", [
    (lambda m: setattr(m, "lm_head", torch.nn.Linear(64, 96, bias=True)), "has a bias"),
    (lambda m: setattr(m.config, "final_logit_softcapping", 30.0), "final_logit_softcapping"),
    (lambda m: setattr(m.config, "logit_scale", 0.5), "logit_scale"),
    (lambda m: setattr(m, "lm_head", torch.nn.Identity()), "no linear output layer"),
])
def test_heads_it_does_not_compute_keep_the_models_forward(change, reason, caplog):
    from rapidformer.config.compose import compose, resolve
    from rapidformer.transforms.base import ApplyContext

    model = tiny_llama()
    change(model)
    assert reason in why_not(model)
    _, cfg = resolve(compose(["+recipe=llama_sft"]), "unused")
    forward = model.forward
    with caplog.at_level("INFO", logger="rapidformer"):
        LabelledHead(cfg).apply(model, ApplyContext(torch.device("cpu"), None))
    assert model.forward == forward and reason in caplog.text
    assert why_not(tiny_llama()) is None


@pytest.mark.parametrize("overrides, wanted", [
    ([], True),
    (["task.lm_head=all"], False),
    (["kernels=liger"], False),  # liger's fused linear cross-entropy computes the loss
    (["kernels=liger", "kernels.fused_linear_cross_entropy=false"], True),
    (["peft=lora"], True),
])
def test_when_it_is_on(overrides, wanted):
    from rapidformer.config.compose import compose, resolve

    _, cfg = resolve(compose(["+recipe=llama_sft", *overrides]), "unused")
    assert LabelledHead.wanted(cfg) is wanted


def test_lm_head_outside_sft_is_refused():
    from rapidformer.config.compose import compose, resolve
    from rapidformer.transforms import config_problems

    _, cfg = resolve(compose(["+recipe=bert_mrpc", "task.lm_head=all"]), "unused")
    assert any("task.lm_head=all chooses where a causal LM's output layer runs for task=sft"
               in p for p in config_problems(cfg))


def test_an_sft_run_trains_to_the_same_losses_with_the_labelled_head(tmp_path, caplog):
    args = ["+recipe=llama_lora", f"data.path={tmp_path / 'data'}", "data.synthetic_train_size=64",
            "data.synthetic_eval_size=8", "data.packing=true", "trainer.epochs=null",
            "trainer.train_iters=6", "trainer.eval_interval=6", "trainer.log_interval=1",
            "trainer.device=cpu", "task.sample_generations=0", *QUIET]
    runs = {}
    for head in ("labelled", "all"):
        run = tmp_path / head
        caplog.clear()
        with caplog.at_level("INFO", logger="rapidformer"):
            records = pretrain(run, [*args, f"task.lm_head={head}"])
        assert ("output layer runs at the labelled positions only" in caplog.text) == \
            (head == "labelled")
        runs[head] = ([r["loss"] for r in records if "loss" in r],
                      [r["validation/loss"] for r in records if "validation/loss" in r])
    (losses, evals), (own_losses, own_evals) = runs["labelled"], runs["all"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert losses == pytest.approx(own_losses, rel=1e-4)
    assert evals == pytest.approx(own_evals, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_in_bf16_the_loss_and_adapter_gradients_are_the_models_own():
    from peft import LoraConfig, get_peft_model

    results = []
    for wrap in (False, True):
        model = tiny_llama(vocab_size=32000, hidden_size=256, intermediate_size=512).cuda()
        model.to(torch.bfloat16)
        if wrap:
            wrap_forward(model)
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "down_proj"],
                                                 init_lora_weights=False))
        b = {k: v.cuda() for k, v in batch(vocab=32000, rows=4, length=64).items()}
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**b, use_cache=False).loss
        loss.backward()
        results.append((float(loss), grads(model), torch.cuda.max_memory_allocated()))
    (own, own_grads, own_peak), (got, got_grads, peak) = results
    assert got == pytest.approx(own, rel=1e-2)
    for name, g in got_grads.items():
        assert torch.cosine_similarity(g.float().flatten(), own_grads[name].float().flatten(),
                                       dim=0) > 0.99
    assert peak < own_peak  # the [tokens, 32000] logits and their fp32 copies never exist


def test_under_zero3_the_models_own_forward_computes_the_loss(caplog):
    from rapidformer.config.compose import compose, resolve
    from rapidformer.transforms.base import ApplyContext

    _, cfg = resolve(compose(["+recipe=llama_sft", "memory=zero3"]), "unused", check=False)
    model = tiny_llama()
    forward = model.forward
    with caplog.at_level("INFO", logger="rapidformer"):
        LabelledHead(cfg).apply(model, ApplyContext(torch.device("cpu"), None))
    assert model.forward == forward
    assert "memory=zero3 partitions the output layer" in caplog.text
