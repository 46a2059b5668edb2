"""peft=lora: which layers get adapters and how many parameters train, the merged model's logits
equal to the adapter model's, the refusals, and the llama_lora recipe end to end (its answers
become right, its checkpoints hold the adapters only, its exports: merged and peft's adapter
directory). DDP, FSDP2 and ZeRO-2/3 with adapters, and their exact resume, are cases of the
strategy contract (test_strategies.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.errors import ConfigError, InputError
from tests.test_decoders import pretrain, tiny_llama
from tests.test_sft import answer, prompt_ids, sft_args

pytest.importorskip("peft")


def _cfg(*overrides: str):
    return settle(compose(["peft=lora", "trainer.device=cpu", *overrides]), "out")[1]


def _attach(model, *overrides: str):
    from rapidformer.transforms.lora import attach

    return attach(model, _cfg(*overrides))


def _lora_parameters(model, targets: tuple[str, ...], r: int) -> int:
    """r x (fan-in + fan-out) for every adapted layer."""
    from transformers.pytorch_utils import Conv1D

    total = 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            if isinstance(m, Conv1D):
                total += r * sum(m.weight.shape)
            else:
                total += r * (m.in_features + m.out_features)
    return total


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                      n_positions=32, resid_pdrop=0, embd_pdrop=0,
                                      attn_pdrop=0))


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("build, targets", [
    (tiny_llama, LLAMA_TARGETS), (_tiny_gpt2, ("c_attn", "c_proj", "c_fc"))])
def test_lora_adapts_the_family_projections_and_counts_its_parameters(build, targets):
    base = build()
    expected = _lora_parameters(base, targets, 4)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    model, adapters = _attach(base, "peft.r=4", "peft.alpha=8")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert adapters.trainable == expected == sum(p.numel() for p in model.parameters()
                                                 if p.requires_grad)
    assert adapters.total == expected + sum(t.numel() for t in frozen.values())
    assert adapters.record()["target_modules"] == sorted(targets)
    for name, p in model.get_base_model().named_parameters():  # the base is untouched
        if name.replace(".base_layer", "") in frozen:
            assert torch.equal(p, frozen[name.replace(".base_layer", "")]), name


def test_a_classifier_head_trains_in_full_beside_the_adapters():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    base = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, num_labels=3))
    model, adapters = _attach(base, "peft.r=2")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters.full == ["classifier"]
    assert any("classifier" in n for n in trainable)
    assert {n.split(".")[-2] for n in trainable if "lora_" in n} == {"default"}
    heads = sum(p.numel() for n, p in model.named_parameters()
                if p.requires_grad and "classifier" in n and "original_module" not in n)
    assert heads == 32 * 3 + 3


@pytest.mark.parametrize("build", [tiny_llama, _tiny_gpt2])
def test_the_merged_model_gives_the_adapter_models_logits(build):
    model, adapters = _attach(build(), "peft.dropout=0")
    with torch.no_grad():  # lora_B starts at zero: give the adapters something to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        plain = model.get_base_model()
        merged = adapters.merged(model, None)
        assert type(merged) is type(plain)  # a plain Hugging Face model, no peft layers
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits,
                                  build()(input_ids=ids).logits, atol=1e-3)


def test_an_output_layer_trained_in_full_is_exported_untied_from_the_embeddings():
    """GPT-2 ties its output layer to the token embeddings; trained in full beside the adapters
    it is a copy of its own, which the merged model keeps (its config no longer ties them)."""
    model, adapters = _attach(_tiny_gpt2(), "peft.dropout=0", "peft.modules_to_save=[lm_head]")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        merged = adapters.merged(model, None)
        assert merged.config.tie_word_embeddings is False
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    frozen, frozen_adapters = _attach(_tiny_gpt2(), "peft.dropout=0")  # a frozen head: tied
    merged = frozen_adapters.merged(frozen, None)
    assert merged.config.tie_word_embeddings is True
    assert merged.lm_head.weight.data_ptr() == merged.transformer.wte.weight.data_ptr()


def test_target_names_that_match_no_layer_are_refused_with_the_layer_names():
    with pytest.raises(ConfigError, match=r"peft.target_modules: qkv matches no module of "
                                          r"LlamaForCausalLM; its linear layers are named "
                                          r"down_proj, gate_proj, k_proj, lm_head"):
        _attach(tiny_llama(), "peft.target_modules=[q_proj,qkv]")


@pytest.mark.parametrize("overrides, message", [
    (["model=megatron_gpt_tiny", "+recipe=gpt_pretrain", "data.path=x", "model.tokenizer=x",
      "model.merge_file=x"],
     "peft=lora with model=megatron_gpt_tiny: peft's adapters wrap Hugging Face"),
    (["peft=qlora"], "peft=qlora with trainer.device=cpu: QLoRA is for CUDA GPUs.*Use peft=lora "
                     "on a CPU"),
    (["peft=qlora", "model=gpt2_tiny", "trainer.device=cuda"],
     "peft=qlora with model=gpt2_tiny: bitsandbytes quantizes torch.nn.Linear layers"),
    (["peft.target_modules=[]"], r"peft.target_modules=\[\] names no layer to adapt"),
    (["peft=none", "peft.r=4"], "peft.r=4 has no effect with peft=none"),
    (["peft.quant_type=fp4"], "peft.quant_type=fp4 has no effect with peft=lora; it is used by "
                              "peft=qlora"),
    (["trainer.unpad=true"], "peft=lora with trainer.unpad=true: not combined here"),
])
def test_combinations_peft_does_not_take_are_refused_before_a_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        settle(compose(["peft=lora", "trainer.device=cpu", *overrides]), "out")


def test_qlora_is_refused_on_a_cpu_device_before_any_work():
    from rapidformer.config.schema import PeftConfig, RunConfig
    from rapidformer.errors import refusal
    from rapidformer.transforms.lora import LoRA

    cpu = torch.device("cpu")  # what the refusal pass asks about a run on this machine
    with pytest.raises(ConfigError, match="peft=qlora keeps the base weights in 4 bits"):
        raise refusal(LoRA.environment_problems(RunConfig(peft=PeftConfig(name="qlora")), cpu))
    assert LoRA.environment_problems(RunConfig(peft=PeftConfig(name="lora")), cpu) == []


def test_qlora_quantizes_the_blocks_trains_the_adapters_and_merges_into_the_dequantized_base():
    """The glue on bitsandbytes' CPU fallback (the validator keeps qlora runs to CUDA GPUs)."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    base = tiny_llama()
    expected = _lora_parameters(base, LLAMA_TARGETS, 8)
    model, adapters = _attach(base, "peft=qlora", "peft.dropout=0", "precision=fp32",
                              "trainer.device=cuda")
    model = model.to("cpu")  # the 4-bit layers quantize as they move (the engine's move)
    layers = model.get_base_model().model.layers
    assert type(layers[0].self_attn.q_proj.base_layer) is bnb.nn.Linear4bit
    assert layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.uint8  # 2 weights a byte
    assert type(model.get_base_model().lm_head) is torch.nn.Linear  # outside the blocks
    assert adapters.trainable == expected and adapters.record()["quant_type"] == "nf4"
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model(input_ids=ids, labels=ids).loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == \
        {n for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    with torch.no_grad():
        merged = adapters.merged(model, None)  # 4-bit base dequantized, adapters merged in
        assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        # bitsandbytes' CPU 4-bit matmul computes in bf16: its outputs differ by ~2e-3
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=1e-2)


def lora_args(data_dir) -> list[str]:
    return [a.replace("llama_sft", "llama_lora") for a in sft_args(data_dir)] + \
        ["trainer.eval_interval=20", "trainer.train_iters=80"]


def test_llama_lora_learns_its_answers_and_saves_and_exports_the_adapters(tmp_path, capsys):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rapidformer.checkpoint import store as checkpoint
    from rapidformer.checkpoint.state import read_state
    from rapidformer.cli.verbs import run_verb

    run = tmp_path / "run"
    records = pretrain(run, lora_args(tmp_path / "data"))
    matches = [r["validation/answer_match"] for r in records if "validation/answer_match" in r]
    assert matches[-1] >= 0.9 > matches[0], matches

    ckpt = run / "checkpoints" / "step_00000080"
    record = read_state(ckpt).transforms["lora"]
    assert record["method"] == "lora" and record["r"] == 16 and record["base_copy"] == "peft_base"
    stored = torch.load(ckpt / "model.pt", weights_only=True)
    assert all("lora_" in k or "modules_to_save" in k for k in stored), list(stored)[:5]
    assert sum(t.numel() for t in stored.values()) == record["trainable_parameters"]
    base_bytes = (run / "peft_base" / "model.safetensors").stat().st_size
    assert (ckpt / "model.pt").stat().st_size < base_bytes
    assert not any("lora" in k for k in load_file(run / "peft_base" / "model.safetensors"))

    # the run's export: a plain Llama (no peft to load it) with the adapters merged in
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    merged = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert answer(merged, tokenizer, "where does anna live ?") == "paris"
    ids = prompt_ids(tokenizer, "who does ben work for ?")

    # rapidformer export: the merged model from the checkpoint, and peft's adapter directory
    import yaml

    resolved, _ = settle(compose([*lora_args(tmp_path / "data"), f"trainer.output_dir={run}"]),
                          str(run))
    (run / "config.yaml").write_text(yaml.safe_dump(resolved))  # what the CLI writes first
    assert run_verb("export", [str(run), "--to", str(tmp_path / "merged")]) == 0
    offline = load_file(tmp_path / "merged" / "model.safetensors")
    for name, tensor in load_file(run / "hf_model" / "model.safetensors").items():
        torch.testing.assert_close(offline[name], tensor, rtol=0, atol=0, msg=name)
    assert run_verb("export", [str(run), "--to", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert "peft.PeftModel.from_pretrained" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == str((run / "peft_base").absolute())
    base = AutoModelForCausalLM.from_pretrained(run / "peft_base")
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    from peft import AutoPeftModelForCausalLM  # reads the base from the config alone

    for model in (adapted, AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()):
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, merged(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-5)

    # resuming these adapters: refused with other settings, without peft, or on another base
    data = tmp_path / "data"
    for overrides, message in [
            (["peft=none"],
             "holds peft=lora adapters only, and this run trains the whole model"),
            (["peft.r=8"], r"holds adapters of other settings, changed: r=8 \(was 16\)"),
            (["model.initializer_range=0.05"], "trained on another base model")]:
        with pytest.raises(InputError, match=message):
            pretrain(tmp_path / "again", [*lora_args(data), f"trainer.resume={ckpt}",
                                          *overrides])
    assert checkpoint.is_complete(ckpt)  # the refused resumes left it as it was
    # in its own run directory too: the base copy its checkpoints export from stays
    with pytest.raises(InputError, match="trained on another base model"):
        pretrain(run, [*lora_args(data), f"trainer.resume={ckpt}", "model.initializer_range=0.05"])
    mark = run / "peft_base" / "rapidformer_fingerprint.txt"
    assert mark.read_text() == record["base_fingerprint"]


def test_a_missing_peft_is_refused_before_any_work_with_its_install_line(monkeypatch):
    import sys

    from rapidformer.errors import NotAvailableError
    from rapidformer.preflight import check_environment

    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without it imports
    with pytest.raises(NotAvailableError, match=r"pip install 'rapidformer\[peft\]'"):
        check_environment(_cfg())  # the run's refusal pass, this machine's part
    check_environment(settle(compose(["trainer.device=cpu"]), "out")[1])


@pytest.mark.parametrize("source, name, expected", [
    ("pretrained", "hub-org/some-model", "hub-org/some-model"),  # not a local folder: as it is
    ("pretrained", "base_folder", "ABS/base_folder"),  # a local folder: absolute
    ("config", None, "ABS/run/peft_base"),  # config-built: the copy the run keeps
])
def test_the_adapter_directory_names_a_base_that_loads_from_anywhere(tmp_path, monkeypatch,
                                                                     source, name, expected):
    from types import SimpleNamespace

    from rapidformer.cli.verbs.export import adapter_base

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base_folder").mkdir()
    cfg = SimpleNamespace(model=SimpleNamespace(source=source, name_or_path=name))
    assert adapter_base(cfg, Path("run")) == expected.replace("ABS", str(tmp_path))
