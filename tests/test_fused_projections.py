"""kernels.fused_projections: q|k|v and gate|up as one linear layer each in Hugging Face Llama,
Mistral and Qwen2 decoders. The same logits and gradients as the model's own layers, the
Hugging Face layout in the state dict (checkpoints, resume either way, the export), the same
losses in a training run, float8 converting the fused layers, and the refusals."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.errors import ConfigError, InputError
from rapidformer.preflight import settle
from rapidformer.transforms import TRANSFORMS
from rapidformer.transforms.fused_projections import fuse_projections
from tests.test_decoders import fp8, llama_args, pretrain, tiny_llama

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))


def tiny(family: str):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**SHAPE)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def fused_copy(model):
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == (2, 2)
    return fused


def _parts(fused_state: dict) -> dict:
    """The fused model's gradients in the model's own names (q_proj.weight, ...)."""
    out = {}
    for name, grad in fused_state.items():
        for fused, parts, sizes in (("qkv_proj", ("q_proj", "k_proj", "v_proj"), (64, 32, 32)),
                                    ("gate_up_proj", ("gate_proj", "up_proj"), (128, 128))):
            if f".{fused}." in name:
                for part, piece in zip(parts, grad.split(sizes)):
                    out[name.replace(fused, part)] = piece
                break
        else:
            out[name] = grad
    return out


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral"])
def test_same_logits_gradients_and_state_dict_as_the_models_own_layers(family):
    model = tiny(family)
    fused = fused_copy(model)
    attention = fused.model.layers[0].self_attn
    assert list(attention._modules) == ["qkv_proj", "o_proj"]
    assert list(fused.model.layers[0].mlp._modules)[:1] == ["gate_up_proj"]
    if family == "Qwen2":  # q/k/v biases are fused too
        assert attention.qkv_proj.bias.shape == (128,)
    # the same parameters, so the same count (the FLOPs of MFU)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())

    own, mine = model(IDS, labels=IDS), fused(IDS, labels=IDS)
    torch.testing.assert_close(mine.logits, own.logits, rtol=0, atol=1e-6)
    own.loss.backward()
    mine.loss.backward()
    grads = _parts({n: p.grad for n, p in fused.named_parameters()})
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6, msg=name)

    # the Hugging Face layout: keys in the model's order, shapes, values
    plain, state = model.state_dict(), fused.state_dict()
    assert list(state) == list(plain)
    for key, value in plain.items():
        assert state[key].shape == value.shape and torch.equal(state[key], value), key

    # bf16 closely
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused(IDS).logits, model(IDS).logits, rtol=0, atol=2e-2)


def test_an_unfused_state_dict_loads_and_generation_runs():
    model, other = tiny_llama(), tiny_llama(hidden_size=64)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    fused = fused_copy(model)
    result = fused.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(fused(IDS).logits, other(IDS).logits, rtol=0, atol=1e-6)
    # the KV cache path: the same greedy tokens
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(IDS[:1, :8], **kwargs), other.generate(IDS[:1, :8],
                                                                             **kwargs))


def test_other_layers_are_left_alone_and_a_model_without_any_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.config.schema import KernelsConfig, RunConfig
    from rapidformer.transforms.base import ApplyContext
    from rapidformer.transforms.fused_projections import FusedProjections

    import types

    model = tiny_llama()
    model.model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))  # another module
    # liger-kernel 0.8 patches a family's MLP on the instance, its class unchanged: its SwiGLU
    # kernel reads gate_proj and up_proj by name, so that MLP keeps them
    mlp = model.model.layers[0].mlp
    mlp.forward = types.MethodType(lambda self, x: self.down_proj(
        torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)), mlp)
    assert fuse_projections(model) == (2, 0)
    assert fuse_projections(model) == (0, 0)  # applied once
    assert mlp(torch.ones(1, 64)).shape == (1, 64)
    cfg = RunConfig(kernels=KernelsConfig(fused_projections=True))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=96))
    with pytest.raises(InputError, match="found no Llama, Mistral or Qwen2 attention or MLP"):
        FusedProjections(cfg).apply(gpt2, ApplyContext(torch.device("cpu"), None))


def test_it_applies_before_peft_and_float8_and_float8_converts_the_fused_layers():
    names = [t.name for t in TRANSFORMS]
    assert names.index("liger") < names.index("fused_projections") < names.index("float8")
    from rapidformer.transforms.float8 import convert_to_float8

    model = tiny_llama()
    fuse_projections(model)
    convert_to_float8(model, fp8(fp8_skip_small=False, fp8_emulate=True))
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "Float8Linear"
    assert type(layer.mlp.gate_up_proj).__name__ == "Float8Linear"
    # 4 linear layers a block (qkv, o, gate_up, down) instead of 7
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 8
    assert "model.layers.0.self_attn.k_proj.weight" in model.state_dict()


def _losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_training_run_has_the_same_losses_checkpoints_and_export(tmp_path, pretraining_data):
    from transformers import LlamaForCausalLM

    args = [*llama_args(pretraining_data), "trainer.train_iters=6", "trainer.log_interval=1",
            "trainer.save_interval=3"]
    own = pretrain(tmp_path / "own", args)
    fused = pretrain(tmp_path / "fused", [*args, "kernels.fused_projections=true"])
    own_losses = _losses(own)
    assert list(_losses(fused)) == list(own_losses) == [1, 2, 3, 4, 5, 6]
    assert _losses(fused) == pytest.approx(own_losses, abs=1e-5)

    step = "checkpoints/step_00000003/model.pt"
    plain, saved = (torch.load(tmp_path / run / step) for run in ("own", "fused"))
    assert list(saved) == list(plain)
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-5, msg=key)

    exported = LlamaForCausalLM.from_pretrained(tmp_path / "fused" / "hf_model")
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "own" / "hf_model")
    assert type(exported.model.layers[0].self_attn).__name__ == "LlamaAttention"
    torch.testing.assert_close(exported(IDS).logits, reference(IDS).logits, rtol=0, atol=1e-4)

    # resume with the transform; across the setting it is refused (the optimizer's moments
    # follow the fused parameters), with the way out
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fused", run)
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "metrics.jsonl").unlink()
    losses = _losses(pretrain(run, [*args, "kernels.fused_projections=true",
                                    "trainer.resume=auto"]))
    assert list(losses) == [4, 5, 6], losses
    assert losses == pytest.approx({s: own_losses[s] for s in (4, 5, 6)}, abs=1e-5)
    for source, fuse, message in (("own", "true", "was trained without kernels.fused_projections"),
                                  ("fused", "false", "was trained with kernels.fused_projections")):
        with pytest.raises(InputError, match=message):
            pretrain(tmp_path / source, [*args, f"kernels.fused_projections={fuse}",
                                         "trainer.resume=auto", "trainer.train_iters=8"])


@pytest.mark.parametrize("overrides, message", [
    (["peft=lora"], "kernels.fused_projections=true with peft=lora: the adapters target"),
    (["model=megatron_gpt_tiny"], "kernels.fused_projections=true with "
                                  "model=megatron_gpt_tiny: it fuses Hugging Face"),
    (["graph=ort"], "kernels.fused_projections=true with graph=ort"),
    (["memory=zero2"], "kernels.fused_projections=true with memory=zero2: DeepSpeed ZeRO"),
    (["memory=fsdp"], "kernels.fused_projections=true with memory=fsdp: FSDP2's distributed"),
    (["model=bert_tiny"], "kernels.fused_projections=true with model=bert_tiny (arch=bert): "
                          "it fuses the projections of Hugging Face Llama"),
])
def test_combinations_it_does_not_serve_are_refused(tmp_path, overrides, message):
    args = ["+recipe=llama_pretrain", "model=llama_tiny", "data.path=unused",
            "model.tokenizer=unused", "model.merge_file=unused",
            "kernels.fused_projections=true", *overrides]
    with pytest.raises(ConfigError) as err:
        settle(compose(args), str(tmp_path / "run"))
    assert message in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or
                    torch.cuda.get_device_capability() < (8, 9), reason="needs float8 tensor cores")
def test_float8_on_the_gpu_converts_and_trains_the_fused_layers():
    pytest.importorskip("torchao")  # rapidformer[fp8]; GPU calls carry it only for float8 rows
    from rapidformer.transforms.float8 import convert_to_float8
    from tests.test_decoders import _train_steps

    bf16 = _train_steps(tiny_llama(hidden_size=256, intermediate_size=512).cuda(), 20)
    model = tiny_llama(hidden_size=256, intermediate_size=512)
    fuse_projections(model)
    model = model.cuda()
    convert_to_float8(model, fp8(fp8_skip_small=False))
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "Float8Linear"
    assert type(layer.mlp.gate_up_proj).__name__ == "Float8Linear"
    float8 = _train_steps(model, 20)
    assert float8[-1] < float8[0] - 1.0
    assert float8[-1] == pytest.approx(bf16[-1], abs=0.1), (float8, bf16)
