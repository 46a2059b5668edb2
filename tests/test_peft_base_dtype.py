"""peft.base_dtype: the frozen base of a LoRA model is held in bf16 under precision=bf16 where
no value changes (a bf16 checkpoint's weights), the adapters and the modules trained in full stay
fp32 masters; a pretrained bf16 checkpoint trains from fp32 weights whatever transformers loads
it in; bf16 holding saves the activations that fp32 embeddings and norms made fp32; the
export of a bf16 checkpoint's adapters merges into its exact weights."""
from __future__ import annotations

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.errors import ConfigError
from rapidformer.preflight import settle
from tests.test_decoders import tiny_llama

pytest.importorskip("peft")


def _cfg(*overrides: str):
    return settle(compose(["+recipe=llama_lora", "trainer.device=cpu",
                           "peft.modules_to_save=null", *overrides]), "out")[1]


def _attach(model, *overrides: str):
    from rapidformer.transforms.lora import attach

    return attach(model, _cfg(*overrides))


def _bf16_valued(model):
    """The model with every weight rounded to a bf16 value, held in fp32 (a bf16 checkpoint as
    the builder loads it)."""
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(t.to(torch.bfloat16).float())
    return model


def _dtypes(model) -> tuple[set, set]:
    frozen = {t.dtype for t in model.parameters() if not t.requires_grad}
    trained = {t.dtype for t in model.parameters() if t.requires_grad}
    return frozen, trained


@pytest.mark.parametrize("weights, precision, base_dtype, frozen", [
    ("bf16-valued", "bf16", "auto", torch.bfloat16),
    ("fp32-valued", "bf16", "auto", torch.float32),  # rounding would change the base: kept
    ("fp32-valued", "bf16", "bf16", torch.bfloat16),
    ("bf16-valued", "bf16", "fp32", torch.float32),
    ("bf16-valued", "fp32", "auto", torch.float32),
    ("bf16-valued", "fp16", "auto", torch.float32),  # a half-precision residual can overflow
])
def test_the_frozen_base_dtype_table(weights, precision, base_dtype, frozen):
    model = tiny_llama()
    if weights == "bf16-valued":
        model = _bf16_valued(model)
    model, _ = _attach(model, f"precision={precision}", f"peft.base_dtype={base_dtype}")
    assert _dtypes(model) == ({frozen}, {torch.float32})


class _Vocab:
    """What the builder reads of a tokenizer: its size and special tokens."""
    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize("init_dtype, precision, frozen", [
    ("bf16", "bf16", torch.bfloat16),  # as a published bf16 checkpoint: auto holds it in bf16
    ("fp32", "bf16", torch.float32),
    ("bf16", "fp32", torch.float32),
])
def test_model_init_dtype_makes_the_config_built_base_a_bf16_checkpoints(init_dtype, precision,
                                                                           frozen):
    from rapidformer.models.hf import build_task_model
    from rapidformer.transforms.lora import attach

    cfg = _cfg(f"precision={precision}", f"model.init_dtype={init_dtype}")
    model = build_task_model(cfg.model, "sft", _Vocab(64))
    weights = [t for t in model.parameters() if t.is_floating_point()]
    assert {t.dtype for t in weights} == {torch.float32}  # fp32 masters either way
    rounded = all(torch.equal(t, t.to(torch.bfloat16).float()) for t in weights)
    assert rounded == (init_dtype == "bf16")
    model, _ = attach(model, cfg)
    assert _dtypes(model) == ({frozen}, {torch.float32})


def test_model_init_dtype_is_refused_where_nothing_reads_it():
    with pytest.raises(ConfigError, match="model.init_dtype"):
        _cfg("model=hf", "model.name_or_path=some/model", "model.init_dtype=bf16")
    with pytest.raises(ConfigError, match="model.init_dtype=bf16 with model=megatron_gpt"):
        settle(compose(["model=megatron_gpt", "task=causal_lm", "trainer.device=cpu",
                        "model.init_dtype=bf16"]), "out")


def test_modules_trained_in_full_stay_fp32_masters_beside_a_bf16_base():
    model, _ = _attach(_bf16_valued(tiny_llama()), "precision=bf16",
                       "peft.modules_to_save=[lm_head]")
    trained = {n: t.dtype for n, t in model.named_parameters() if t.requires_grad}
    assert any("lm_head" in n for n in trained) and set(trained.values()) == {torch.float32}
    assert _dtypes(model)[0] == {torch.bfloat16}


def test_a_bf16_base_under_fp32_precision_is_refused():
    with pytest.raises(ConfigError, match="peft.base_dtype=bf16 with precision=fp32"):
        _cfg("precision=fp32", "peft.base_dtype=bf16")


def _saved_bytes(model, ids) -> tuple[int, float]:
    total = 0

    def keep(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return total, loss.item()


def _qlora(base_dtype: str):
    pytest.importorskip("bitsandbytes")
    # Llama's MLP width, 4x the hidden size: the MLP's saved activations are most of a layer's
    model, _ = _attach(tiny_llama(intermediate_size=256), "peft=qlora", "peft.dropout=0",
                       "precision=bf16",
                       f"peft.base_dtype={base_dtype}", "trainer.device=cuda")
    return model.to("cpu")  # the 4-bit layers quantize as they move (bitsandbytes' CPU path)


def test_a_bf16_qlora_base_saves_fewer_activation_bytes_and_computes_the_same_loss():
    """bitsandbytes' 4-bit layers run outside autocast and return their input's dtype: behind
    fp32 embeddings and norms (peft's prepare_model_for_kbit_training casts them to fp32) every
    projection's output, and all that is saved from it for the backward, was fp32."""
    ids = torch.randint(0, 96, (4, 48), generator=torch.Generator().manual_seed(1))
    fp32, loss32 = _saved_bytes(_qlora("fp32"), ids)
    bf16, loss16 = _saved_bytes(_qlora("auto"), ids)
    assert bf16 < 0.8 * fp32, (bf16, fp32)  # the rest: the norms compute in fp32 inside
    assert loss16 == pytest.approx(loss32, rel=2e-2)


def test_a_bf16_lora_base_holds_half_the_bytes():
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.parameters()
                           if not t.requires_grad)
    fp32 = nbytes(_attach(_bf16_valued(tiny_llama()), "precision=bf16", "peft.base_dtype=fp32")[0])
    bf16 = nbytes(_attach(_bf16_valued(tiny_llama()), "precision=bf16")[0])
    assert bf16 * 2 == fp32


def test_a_bf16_checkpoint_trains_from_fp32_weights_and_exports_its_exact_base(tmp_path):
    from transformers import AutoModelForCausalLM

    from rapidformer.models.hf import TRAINING_DTYPE, build_task_model

    checkpoint = tmp_path / "bf16_model"
    tiny_llama().to(torch.bfloat16).save_pretrained(checkpoint)
    cfg = _cfg("precision=bf16", "model=hf", f"model.name_or_path={checkpoint}")
    loaded = build_task_model(cfg.model, "sft", tokenizer=None)
    assert TRAINING_DTYPE == torch.float32 and {t.dtype for t in loaded.parameters()} == {
        torch.float32}  # transformers alone loads it in bf16: AdamW would round every update

    from rapidformer.transforms.lora import attach

    model, adapters = attach(loaded, cfg)
    assert _dtypes(model) == ({torch.bfloat16}, {torch.float32})
    merged = adapters.merged(model, None)  # lora_B starts at zero: the base, as merged
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for name, weight in original.state_dict().items():
        assert torch.equal(merged.state_dict()[name].float(), weight), name


@pytest.mark.parametrize("numel", [1, 7, 4096, 262_668_288, 128_256 * 4096, 2**31 + 11])
def test_fingerprint_positions_stay_inside_large_embeddings(numel):
    """Llama 3's 128,256 x 2048 embedding crashed every LoRA run on it (an index past the end)."""
    from rapidformer.transforms.lora_layers import FINGERPRINT_SAMPLES, sample_positions

    positions = sample_positions(numel)
    assert positions.min() == 0 and positions.max() == numel - 1
    assert len(positions) == min(numel, FINGERPRINT_SAMPLES)


def test_the_memory_plan_counts_a_bf16_valued_config_built_base_as_bf16():
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import model_shape

    def states(*overrides: str) -> float:
        cfg = _cfg("precision=bf16", "model.embedding_rows=4096", *overrides)
        return estimate(model_shape(cfg), cfg, Mode("none"), True).model_states

    rounded, asked, fp32 = (states("model.init_dtype=bf16"), states("peft.base_dtype=bf16"),
                            states())
    assert rounded == asked < fp32
