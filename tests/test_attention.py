"""rapidformer_sdpa: transformers' SDPA attention without a materialized mask under
torch.compile when a batch has no padding; the same losses and gradients as transformers' own."""
import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

from rapidformer.models.attention import TRAINING_SDPA, register, training_sdpa_mask, use_training_sdpa


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                      vocab_size=50, attn_pdrop=0.0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, use_cache=False,
                                      attn_implementation="sdpa"))


def _bert():
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=50,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      attn_implementation="sdpa"))


def _loss_and_grad(model, batch, compiled=False):
    model.zero_grad(set_to_none=True)
    forward = torch.compile(model) if compiled else model
    loss = forward(**batch).loss
    loss.backward()
    return loss.item(), model.transformer.wte.weight.grad.clone() if hasattr(model, "transformer") \
        else model.bert.embeddings.word_embeddings.weight.grad.clone()


def test_no_mask_is_built_for_a_batch_without_padding_even_under_compile():
    register()
    seen = []

    def probe(q_length, **extra):
        mask = training_sdpa_mask(batch_size=2, q_length=q_length, kv_length=q_length, **extra)
        seen.append(mask is None)
        return torch.zeros(1)

    torch.compile(probe, fullgraph=True)(8)
    assert seen == [True]
    # padding, a sliding window or a packed-sequence pattern still get a mask
    padding = torch.tensor([[1] * 8, [1] * 6 + [0] * 2], dtype=torch.bool)
    assert training_sdpa_mask(batch_size=2, q_length=8, kv_length=8,
                              attention_mask=padding).shape == (2, 1, 8, 8)
    assert training_sdpa_mask(batch_size=2, q_length=8, kv_length=8, local_size=4) is not None
    assert training_sdpa_mask(batch_size=2, q_length=8, kv_length=8,
                              allow_is_causal_skip=False) is not None


@pytest.mark.parametrize("build", [_gpt2, _bert])
def test_training_sdpa_matches_transformers_sdpa(build):
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 16))
    reference = build()
    expected = _loss_and_grad(reference, {"input_ids": ids, "labels": ids})
    model = build()
    assert use_training_sdpa(model)
    assert model.config._attn_implementation == TRAINING_SDPA
    for compiled in (False, True):
        loss, grad = _loss_and_grad(model, {"input_ids": ids, "labels": ids}, compiled)
        assert loss == pytest.approx(expected[0], rel=1e-5)
        torch.testing.assert_close(grad, expected[1], rtol=1e-4, atol=1e-6)
    # a padded batch goes through transformers' own mask: the same loss as with sdpa
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    assert _loss_and_grad(model, padded, True)[0] == pytest.approx(
        _loss_and_grad(reference, padded)[0], rel=1e-5)


def test_generation_and_saved_config_are_unchanged(tmp_path):
    model = _gpt2().eval()
    prompt = torch.randint(0, 50, (1, 5))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert use_training_sdpa(model)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(got, expected)
    model.save_pretrained(tmp_path)
    assert TRAINING_SDPA not in (tmp_path / "config.json").read_text()


def test_other_implementations_are_left_alone():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50,
                                       attn_implementation="eager"))
    assert not use_training_sdpa(model)
    assert model.config._attn_implementation == "eager"
    assert not use_training_sdpa(torch.nn.Linear(2, 2))


def test_the_skipped_mask_means_the_causal_kernel():
    """What the skip buys: SDPA's is_causal path computes what the explicit causal mask does."""
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    explicit = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=explicit))


def test_a_compiled_gpt2_builds_no_mask_unless_the_caller_packs_documents(monkeypatch):
    """GPT-2 hands its own positions 0..s-1 to transformers' packing check, which under compile
    cannot read them and assumes packing; the model's own positions are never packed."""
    import rapidformer.models.attention as attention
    from transformers.masking_utils import AttentionMaskInterface

    model = _gpt2()
    assert use_training_sdpa(model)
    built = []

    def spy(*args, **kwargs):
        mask = training_sdpa_mask(*args, **kwargs)
        built.append(mask is not None)
        return mask

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, TRAINING_SDPA, spy)
    ids = torch.randint(0, 50, (2, 16))
    compiled = torch.compile(model)
    compiled(input_ids=ids, labels=ids)
    assert built == [False]
    assert not attention._positions_are_the_models_own  # cleared after the forward
    # two documents per row: the caller's positions restart, and the mask keeps them apart
    positions = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, -1)
    loss = compiled(input_ids=ids, labels=ids, position_ids=positions).loss
    assert built[-1] is True
    expected = _gpt2()(input_ids=ids, labels=ids, position_ids=positions).loss
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
