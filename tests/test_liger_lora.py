"""kernels=liger with peft=lora/qlora: liger-kernel patches the Hugging Face model first (its
norms, SwiGLU MLP and the causal LM's forward, whose training loss runs the output layer and the
cross-entropy chunk by chunk without logits), then peft's adapters wrap the patched model's
projections. On a CPU the patching is checked where liger-kernel imports (it needs Triton); on a
GPU the adapters train with the kernels to the losses they reach without them."""
from __future__ import annotations

import math

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


# --- kernels=auto (the default): liger where it measured faster, the model's own layers elsewhere
def _auto_cfg(*overrides: str):
    from rapidformer.config.compose import resolve

    return resolve(compose(["+recipe=llama_lora", *overrides]), "out", check=False)[1]


@pytest.mark.parametrize("overrides, device, has_liger, model, decision", [
    ([], "cuda", True, "llama", None),
    (["peft=none"], "cuda", True, "llama", None),  # full fine-tuning: task=sft still
    ([], "cpu", True, "llama", "the run is on 'cpu'"),
    ([], "cuda", False, "llama", "liger-kernel is not installed (pip install"),
    ([], "cuda", True, "gpt2", "no kernels for model type 'gpt2'"),
    (["task=causal_lm"], "cuda", True, "llama", "task=causal_lm: liger-kernel is measured "
                                                "faster for task=sft only"),
])
def test_auto_picks_liger_only_where_it_measured_faster(monkeypatch, overrides, device,
                                                        has_liger, model, decision):
    import types
    import sys

    from rapidformer.transforms import liger

    monkeypatch.setattr(liger, "installed", lambda name: has_liger)
    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "mistral": None, "qwen2": None}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    cfg = _auto_cfg(*overrides)
    assert cfg.kernels.name == "auto"
    stand_in = types.SimpleNamespace(config=types.SimpleNamespace(model_type=model))
    why = liger.auto_choice(cfg, stand_in, torch.device(device))
    assert why == decision if decision is None else decision in why


def _pretrained(tmp_path, model_type: str) -> str:
    import transformers

    folder = tmp_path / model_type
    transformers.AutoConfig.for_model(model_type).save_pretrained(folder)
    return str(folder)


def _unreadable(tmp_path, name: str, config: dict) -> None:
    import json

    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))


# (overrides, the refusal's words or None): the family is known before the model is built
FAMILIES = [
    (["+recipe=llama_lora"], None),
    (["+recipe=llama_lora", "model=gpt2_tiny"], "model=gpt2_tiny (model.arch=gpt2): "
                                                "liger-kernel has no kernels for model type 'gpt2'"),
    (["+recipe=quickstart"], "model type 'bert'"),
    (["+recipe=bert_pretrain", "model=bert_tiny"], "model type 'bert'"),
    (["+recipe=t5_summarize", "model=t5_tiny"], "model type 't5'"),
    (["+recipe=quickstart", "model=hf", "model.name_or_path=PRETRAINED/bert"],
     "model.name_or_path=PRETRAINED/bert (its config.json): liger-kernel has no kernels for "
     "model type 'bert'"),
    (["+recipe=llama_lora", "model=hf", "model.name_or_path=PRETRAINED/llama"], None),
    # not on this machine, or a config.json transformers cannot read, or one with its own code
    # (never run to read it): the type is known when the model loads, and refused there
    (["+recipe=quickstart", "model=hf", "model.name_or_path=no-such-org/no-such-model"], None),
    (["+recipe=llama_lora", "model=hf", "model.name_or_path=PRETRAINED/yarn"], None),
    (["+recipe=llama_lora", "model=hf", "model.name_or_path=PRETRAINED/custom"], None),
    (["+recipe=llama_lora", "model=hf", "model.name_or_path=PRETRAINED/listed"], None),
    (["model=megatron_gpt_tiny", "task=causal_lm"], None),
]


def _fake_liger(monkeypatch, covered=("llama", "mistral", "qwen2"), broken=False):
    import sys
    import types

    from rapidformer.transforms import liger

    monkeypatch.setattr(liger, "installed", lambda name: True)
    if broken:  # installed, but its import fails (triton, an unsupported transformers)
        monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
        return
    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {name: None for name in covered}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)


@pytest.mark.parametrize("overrides, refused", FAMILIES)
def test_liger_refuses_a_family_it_has_no_kernels_for_before_building_it(
        monkeypatch, tmp_path, overrides, refused):
    from rapidformer.config.compose import resolve
    from rapidformer.transforms import config_problems, environment_problems, liger

    for model_type in ("bert", "llama"):
        _pretrained(tmp_path, model_type)
    _unreadable(tmp_path, "yarn", {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})
    _unreadable(tmp_path, "custom", {"model_type": "not-in-transformers",
                                     "auto_map": {"AutoConfig": "own.OwnConfig"}})
    _unreadable(tmp_path, "listed", {"model_type": ["llama"]})
    overrides = [o.replace("PRETRAINED", str(tmp_path)) for o in overrides]
    refused = refused and refused.replace("PRETRAINED", str(tmp_path))
    cuda = torch.device("cuda")

    def family(kernels: str) -> list[str]:
        cfg = resolve(compose([*overrides, f"kernels={kernels}"]), "out", check=False)[1]
        # the config-only pass never reads the machine for it
        assert not [p for p in config_problems(cfg) if "has no kernels" in p]
        return [p.text for p in environment_problems(cfg, cuda) if "has no kernels" in p.text]

    _fake_liger(monkeypatch)
    for kernels in ("liger", "auto", "none"):
        found = family(kernels)
        if refused is None or kernels != "liger":
            assert not found, found
        else:
            assert len(found) == 1 and refused in found[0] and "Use kernels=none" in found[0]
            assert "it covers llama, mistral, qwen2" in found[0]
    # liger-kernel installed but broken, or missing: the family is not judged (applying it,
    # or the missing package, is the problem)
    _fake_liger(monkeypatch, broken=True)
    assert not family("liger")
    monkeypatch.setattr(liger, "installed", lambda name: False)
    assert not family("liger")


def test_auto_is_never_refused_and_on_a_cpu_keeps_the_models_layers(caplog):
    from rapidformer.transforms.liger import applied_fused_loss

    cfg = settle(compose(["+recipe=llama_lora", "trainer.device=cpu"]), "out",
                 environment=True, claims=False)[1]
    assert cfg.kernels.name == "auto"
    model = tiny_llama()
    forward = model.forward
    with caplog.at_level("INFO", logger="rapidformer"):
        model = Transforms(cfg).apply(model, ApplyContext(run_dir=None,
                                                          device=torch.device("cpu")),
                                      before_move=True)
    assert "kernels=auto: the model's own layers (the run is on 'cpu'" in caplog.text
    assert not applied_fused_loss(model.get_base_model())
    # the labelled head took the loss (the model's forward is wrapped, under peft's)
    assert model.get_base_model().forward.__func__ is not forward.__func__
    assert "the output layer runs at the labelled positions only" in caplog.text


@pytest.mark.parametrize("overrides", [["model=megatron_gpt_tiny", "task=causal_lm"],
                                       ["graph=ort"]])
def test_auto_with_what_liger_cannot_patch_is_not_refused(overrides):
    from rapidformer.transforms import config_problems

    cfg = _auto_cfg(*overrides)
    assert not [p for p in config_problems(cfg) if "kernels" in p]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_applies_liger_to_sft_and_its_loss_takes_over(caplog):
    pytest.importorskip("liger_kernel")
    from rapidformer.transforms.liger import applied_fused_loss

    cfg = _cfg()
    assert cfg.kernels.name == "auto"
    with caplog.at_level("INFO", logger="rapidformer"):
        model = Transforms(cfg).apply(tiny_llama(), ApplyContext(
            run_dir=None, device=torch.device("cuda")), before_move=True)
    assert "kernels=auto: liger-kernel" in caplog.text
    assert applied_fused_loss(model.get_base_model())
    assert "fused linear cross-entropy computes it" in caplog.text


def test_an_adapted_output_layer_turns_the_fused_loss_off(caplog):
    """peft.target_modules naming lm_head: liger's fused loss reads the head's weight itself,
    and the head's adapters would never train; its other kernels stay."""
    pytest.importorskip("liger_kernel")
    from rapidformer.transforms.liger import applied_fused_loss

    cfg = _cfg("kernels=liger", "peft.target_modules=[q_proj,v_proj,lm_head]")
    with caplog.at_level("INFO", logger="rapidformer"):
        model = Transforms(cfg).apply(tiny_llama(), ApplyContext(
            run_dir=None, device=torch.device("cpu")), before_move=True)
    assert not applied_fused_loss(model.get_base_model())
    assert "fused_linear_cross_entropy=False, as peft adapts the output layer (lm_head)" in \
        caplog.text
    assert {n for n, p in model.named_parameters() if "lm_head.lora_" in n and p.requires_grad}
    cfg = _cfg("kernels=liger", "peft.target_modules=[q_proj,v_proj]")
    model = Transforms(cfg).apply(tiny_llama(), ApplyContext(
        run_dir=None, device=torch.device("cpu")), before_move=True)
    assert applied_fused_loss(model.get_base_model())


@pytest.mark.parametrize("overrides, head", [
    (["peft.target_modules=[q_proj,lm_head]"], "lm_head"),
    (["peft.target_modules=[model.layers.0.self_attn.q_proj,lm_head]"], "lm_head"),
    ([], None),  # the family's projections: not the head
    (["peft.target_modules=[q_proj]", "peft.modules_to_save=[lm_head]"], None),  # trained in full
    (["peft=none"], None),
])
def test_which_runs_adapt_the_output_layer(overrides, head):
    from rapidformer.transforms.liger import adapted_output_layer

    if "peft=none" not in overrides:
        overrides = ["peft.modules_to_save=null", *overrides]
    cfg = settle(compose(["+recipe=llama_lora", "trainer.device=cpu", *overrides]), "out")[1]
    assert adapted_output_layer(cfg, tiny_llama()) == head


# found in review (fixed): task=causal_lm on a Hugging Face model with kernels=liger and peft adapting lm_head:
# LigerKernels turns the fused loss off on the model (adapted_output_layer), but
# CausalLMPretrainer.run_forward_step still asks the config (fuses_the_loss(cfg.kernels)) and
# passes shift_labels alone; the model's own forward then computes no loss (loss=None) and the
# step fails ("run_forward_step() returned a NoneType, not the loss tensor")
def test_pretraining_with_liger_and_an_adapted_output_layer_computes_a_loss(
        tmp_path, pretraining_data, monkeypatch):
    import rapidformer.transforms.liger as liger
    from tests.test_decoders import llama_args, pretrain

    def stand_in(model, k):  # liger-kernel needs Triton: mark what it would apply, as it does
        setattr(model, liger.FUSED_LOSS_MARK, bool(k.fused_linear_cross_entropy))

    monkeypatch.setattr(liger, "apply_kernels", stand_in)
    records = pretrain(tmp_path / "run", [*llama_args(pretraining_data), "trainer.train_iters=2",
                                          "trainer.log_interval=1", "peft=lora",
                                          "peft.target_modules=[q_proj,lm_head]",
                                          "kernels=liger"])
    assert [r["loss"] for r in records if "loss" in r]


def _graph(scope: str):
    from rapidformer.config.schema import GraphConfig

    return GraphConfig(name="compile", scope=scope)


def _fused(head_trains: bool, tied: bool = False):
    import rapidformer.transforms.liger as liger

    model = tiny_llama(tie_word_embeddings=tied)
    setattr(model, liger.FUSED_LOSS_MARK, True)  # what liger-kernel's patch leaves, as applied
    model.get_output_embeddings().weight.requires_grad_(head_trains)
    return model


# found on the GPU (fixed): `+recipe=llama_pretrain kernels=liger` (graph=compile, the whole
# model) failed at its first step: dynamo cannot trace liger's fp32 accumulation of the trained
# output layer's gradient ("RuntimeError when making fake tensor call", torch 2.11)
@pytest.mark.parametrize("make, sharded, scope", [
    (lambda: _fused(head_trains=True), False, "blocks"),  # pretraining, full fine-tuning
    (lambda: _fused(head_trains=True, tied=True), False, "blocks"),  # Llama 3.2's tied head
    (lambda: torch.compile(_fused(head_trains=True)), False, "blocks"),  # seen through wrappers
    (lambda: _fused(head_trains=False), False, "model"),  # LoRA: the head is frozen (measured)
    (lambda: tiny_llama(), False, "model"),  # no fused loss
    (lambda: tiny_llama(), True, "blocks"),  # FSDP2, DeepSpeed
])
def test_auto_compiles_the_blocks_where_the_fused_loss_trains_the_head(make, sharded, scope):
    from rapidformer.accelerators.graph import compile_scope

    assert compile_scope(_graph("auto"), sharded, make()) == scope
    assert compile_scope(_graph("blocks"), sharded, make()) == "blocks"


def test_the_fused_loss_compiles_block_by_block_and_leaves_the_head_eager(caplog):
    from rapidformer.accelerators.graph import apply_graph, compile_blocks

    model = _fused(head_trains=True)
    with caplog.at_level("INFO", logger="rapidformer"):
        model = apply_graph(compile_blocks(model, _graph("auto"), False), _graph("auto"), False)
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert all(block._compiled_call_impl is not None for block in model.model.layers)
    assert "each transformer block, not the whole model: liger-kernel's fused loss trains the " \
           "output layer" in caplog.text


def test_the_whole_model_scope_with_the_fused_loss_training_the_head_is_refused():
    from rapidformer.accelerators.graph import compile_blocks
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="graph.scope=model: liger-kernel's fused loss trains "
                                          "the output layer.*use graph.scope=auto or blocks"):
        compile_blocks(_fused(head_trains=True), _graph("model"), False)
    assert compile_blocks(_fused(head_trains=False), _graph("model"), False) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pretraining_with_liger_under_compile_trains(tmp_path, pretraining_data):
    pytest.importorskip("liger_kernel")
    from tests.test_decoders import llama_args, pretrain

    records = pretrain(tmp_path / "run", [*llama_args(pretraining_data), "trainer.train_iters=20",
                                          "trainer.log_interval=5", "trainer.device=cuda",
                                          "graph=compile", "precision=bf16", "kernels=liger"])
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_a_fused_loss_model_without_blocks_is_told_what_to_do_instead():
    import rapidformer.transforms.liger as liger
    from rapidformer.accelerators.graph import compile_blocks
    from rapidformer.errors import ConfigError

    class Head(torch.nn.Module):  # a model of its own: a head, no repeated blocks
        def __init__(self):
            super().__init__()
            self.out = torch.nn.Linear(4, 8)

        def get_output_embeddings(self):
            return self.out

    model = Head()
    setattr(model, liger.FUSED_LOSS_MARK, True)
    with pytest.raises(ConfigError, match="fused loss trains the output layer.*cannot trace, and Head has no "
                                          "repeated transformer blocks.*use graph=eager"):
        compile_blocks(model, _graph("auto"), False)
