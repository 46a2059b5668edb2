"""kernels=liger with peft=lora/qlora: liger-kernel patches the Hugging Face model first (its
norms, SwiGLU MLP and the causal LM's forward, whose training loss runs the output layer and the
cross-entropy chunk by chunk without logits), then peft's adapters wrap the patched model's
projections. On a CPU the patching is checked where liger-kernel imports (it needs Triton); on a
GPU the adapters train with the kernels to the losses they reach without them."""
from __future__ import annotations

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.transforms import TRANSFORMS, Transforms
from rapidformer.transforms.base import ApplyContext
from tests.test_decoders import tiny_llama

pytest.importorskip("peft")


def _cfg(*overrides: str):
    return settle(compose(["+recipe=llama_lora", "peft.modules_to_save=null", "precision=bf16",
                           "trainer.device=cuda", *overrides]), "out")[1]


def test_liger_is_applied_before_peft_wraps_the_model():
    names = [t.name for t in TRANSFORMS]
    assert names.index("liger") < names.index("lora")
    assert all(t.before_move for t in TRANSFORMS[:names.index("lora") + 1])


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_lora_with_liger_is_not_refused(peft):
    cfg = _cfg("kernels=liger", f"peft={peft}")
    assert (cfg.kernels.name, cfg.peft.name) == ("liger", peft)


def test_the_adapters_wrap_the_liger_patched_projections():
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.model.llama import lce_forward

    cfg = _cfg("kernels=liger")
    model = Transforms(cfg).apply(tiny_llama(), ApplyContext(run_dir=None, device=torch.device("cpu")), before_move=True)
    base = model.get_base_model()
    assert base.forward.__func__ is lce_forward  # the fused loss, reached through peft's forward
    mlp = base.model.layers[0].mlp
    assert "liger" in type(mlp).forward.__module__ or "liger" in mlp.forward.__func__.__module__
    assert type(mlp.gate_proj).__module__.startswith("peft")  # adapters on the patched MLP
    assert {n for n, p in model.named_parameters() if p.requires_grad} and all(
        "lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_with_liger_trains_to_the_losses_it_reaches_without(tmp_path):
    pytest.importorskip("liger_kernel")
    from tests.test_decoders import pretrain

    losses = {}
    for kernels in ("none", "liger"):
        run = tmp_path / kernels
        records = pretrain(run, ["+recipe=llama_lora", f"data.path={tmp_path / 'data'}",
                                 "data.synthetic_train_size=256", "data.synthetic_eval_size=8",
                                 "trainer.epochs=null", "trainer.train_iters=20",
                                 "trainer.log_interval=5", "trainer.eval_interval=20",
                                 "precision=bf16", "trainer.device=cuda", f"kernels={kernels}",
                                 "task.sample_generations=0"])
        losses[kernels] = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert losses["liger"][-1] < losses["liger"][0]
    for a, b in zip(losses["none"], losses["liger"]):
        assert a == pytest.approx(b, rel=0.03)
