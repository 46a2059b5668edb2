"""Modern decoders and their accelerators, in-process on tiny models: the Llama model group
pretrains on mmap data and exports, precision=fp8's float8 conversion (which layers, what the
state dict keeps, the refusals), kernels=liger's refusals, and on a GPU both trained against
bf16. The strategy contract for Llama and float8 (DDP, FSDP2 with float8 all-gather, ZeRO-3)
is in test_strategies.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.config.schema import KernelsConfig, PrecisionConfig
from rapidformer.errors import ConfigError, InputError

QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false"]


def llama_args(data: dict) -> list[str]:
    return ["+recipe=llama_pretrain", "model=llama_tiny", f"data.path={data['gpt']}",
            f"model.tokenizer={data['gpt2_vocab']}", f"model.merge_file={data['merges']}",
            "data.max_seq_length=64", "data.split=90,5,5", "data.num_workers=0",
            "trainer.micro_batch_size=4", "trainer.global_batch_size=16", "trainer.lr=3e-3",
            "trainer.log_interval=5", "trainer.eval_iters=2", "trainer.device=cpu",
            "graph=eager", "precision=fp32", "scheduler.warmup_fraction=0", *QUIET]


def pretrain(run: Path, overrides: list[str]) -> list[dict]:
    from rapidformer.engine import RapidformerEngine
    from rapidformer.tasks import task_class

    _, cfg = settle(compose([*overrides, f"trainer.output_dir={run}"]), str(run))
    task_class(cfg.task.name)(engine=RapidformerEngine(cfg, run)).train()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_llama(**shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
              "max_position_embeddings": 64, "tie_word_embeddings": False, **shape}
    return LlamaForCausalLM(LlamaConfig(**config))


def fp8(**keys) -> PrecisionConfig:
    return PrecisionConfig(name="fp8", dtype="bf16", fp8_scaling="tensorwise", **keys)


def test_llama_pretrains_on_mmap_data_and_exports_a_llama(tmp_path, pretraining_data):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    records = pretrain(run, [*llama_args(pretraining_data), "trainer.train_iters=30"])
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses[30] < losses[5] - 0.5, losses  # it learns the generated language
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert type(exported).__name__ == "LlamaForCausalLM"
    c = exported.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size) == (2, 64, 4, 2, 176)
    assert c.tie_word_embeddings is False


EMULATED_FP8 = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_skip_small=false"]


@pytest.mark.parametrize("given, label", [
    (["precision=fp8"], "fp8 (bf16 autocast)"), (["precision=bf16"], "bf16"),
    (["precision=fp32"], "fp32"), (["precision=fp16"], "fp16"),
    (["precision=fp32", "precision.dtype=bf16"], "bf16"),  # what it computes in
])
def test_the_precision_label_is_what_a_run_computes_in(given, label):
    from omegaconf import OmegaConf

    from rapidformer.config.validate import build_run_config
    from rapidformer.observability.format import precision_label

    raw = OmegaConf.to_container(compose(given), resolve=True)
    assert precision_label(build_run_config(raw, check=False).precision) == label


@pytest.mark.parametrize("template", ["pretraining", "training"])
def test_a_float8_run_says_fp8_where_it_starts(template, tmp_path, pretraining_data, capsys,
                                               monkeypatch):
    """The start line names the setting the user gave, not only its autocast dtype (it said
    precision=bf16 on a precision=fp8 run)."""
    from tests.conftest import run_here

    given = [*llama_args(pretraining_data), "trainer.eval_iters=1"] \
        if template == "pretraining" else \
        ["data.synthetic_train_size=32", "data.synthetic_eval_size=8", "trainer.epochs=null",
         "trainer.device=cpu", *QUIET]
    code, printed = run_here([*given, *EMULATED_FP8, "trainer.train_iters=1",
                              "trainer.export_hf=false", "trainer.save_last=false",
                              f"trainer.output_dir={tmp_path / 'run'}"],
                             capsys, monkeypatch, tmp_path)
    assert code == 0, printed[-2000:]
    assert f"{template} 1 iterations" in printed and \
        "precision=fp8 (bf16 autocast), device=cpu" in printed, printed[-2000:]


@pytest.mark.parametrize("overrides, message", [
    (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 does not divide "
                                      "model.num_attention_heads=4"),
    (["model.hidden_dropout=0.1"], "a Llama-shaped model has no hidden dropout"),
    (["model=gpt2_tiny", "model.num_key_value_heads=2"], "only a Llama-shaped model has "
                                                         "grouped-query attention"),
    (["precision=fp8", "memory=zero2"], "precision=fp8 with memory=zero2"),
    (["precision=fp8", "precision.fp8_all_gather=true"], "precision.fp8_all_gather=true needs "
                                                         "memory=fsdp"),
    (["precision=fp16", "precision.fp8_scaling=rowwise"], "precision.fp8_scaling=rowwise has no "
                                                         "effect with precision.dtype=fp16"),
    (["precision=fp8", "data.max_seq_length=63", "trainer.micro_batch_size=1"],
     "float8 matmuls need a multiple of 16 tokens a micro-batch"),
    (["precision=fp8", "model=gpt2_tiny"], "GPT-2's blocks are transformers' Conv1D layers"),
    (["precision.fp8_emulate=true"], "precision.fp8_emulate=true without precision=fp8"),
    (["precision=fp8", "model=megatron_gpt_tiny"], "megatron-core's float8 needs Transformer "
                                                   "Engine"),
    (["kernels=liger", "model=megatron_gpt_tiny"], "kernels=liger with model=megatron_gpt_tiny"),
])
def test_bad_decoder_settings_are_refused_before_anything_runs(tmp_path, overrides, message):
    args = ["+recipe=llama_pretrain", "model=llama_tiny", "data.path=unused",
            "model.tokenizer=unused", "model.merge_file=unused", *overrides]
    with pytest.raises(ConfigError) as err:
        settle(compose(args), str(tmp_path / "run"))
    assert message in str(err.value)


def test_float8_skips_the_head_and_small_layers_and_keeps_the_state_dict():
    from rapidformer.transforms.float8 import convert_to_float8, gains_from_float8

    # torchao's measured sizes: a 2048 x 2048 projection gains in tensorwise scaling, not
    # rowwise; a 512-wide key projection of a 2048 model does in neither
    assert gains_from_float8("tensorwise", 2048, 2048)
    assert not gains_from_float8("rowwise", 2048, 2048)
    assert gains_from_float8("rowwise", 8192, 2048)
    assert not gains_from_float8("tensorwise", 512, 1024)
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_float8(model, fp8(fp8_skip_small=False, fp8_emulate=True))
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    # 7 linear layers a block (q, k, v, o, gate, up, down); the output head stays
    assert len(converted) == 14 and "lm_head" not in converted
    after = model.state_dict()
    assert list(after) == list(before)  # checkpoints and the export keep their keys
    for key, value in after.items():
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key
    loss = model(input_ids=torch.randint(0, 96, (2, 16)), labels=torch.randint(0, 96, (2, 16)))
    loss.loss.backward()  # emulated float8 trains on a CPU
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_float8_refuses_a_model_it_would_not_change():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.transforms.float8 import convert_to_float8

    with pytest.raises(InputError, match="this model's blocks are transformers' Conv1D layers"):
        convert_to_float8(GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2,
                                                     vocab_size=96)), fp8(fp8_emulate=True))
    with pytest.raises(InputError, match="set precision.fp8_skip_small=false"):
        convert_to_float8(tiny_llama(), fp8(fp8_emulate=True))  # 64-wide layers gain nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_float8_and_liger_refuse_a_cpu_with_the_way_out():
    from rapidformer.config.schema import RunConfig
    from rapidformer.errors import refusal
    from rapidformer.transforms.float8 import Float8
    from rapidformer.transforms.liger import LigerKernels

    cpu = torch.device("cpu")  # what the refusal pass asks about a run on this machine
    with pytest.raises(ConfigError, match="precision.fp8_emulate=true to check the numerics"):
        raise refusal(Float8.environment_problems(RunConfig(precision=fp8()), cpu))
    assert Float8.environment_problems(RunConfig(precision=fp8(fp8_emulate=True)), cpu) == []
    with pytest.raises(ConfigError, match="kernels=liger runs Triton kernels on CUDA GPUs"):
        raise refusal(LigerKernels.environment_problems(
            RunConfig(kernels=KernelsConfig(name="liger")), cpu))


def _train_steps(model, steps: int, fused_loss: bool = False) -> list[float]:
    """bf16 steps on one batch of shifted labels: the causal LM task's loss, or (fused_loss)
    the one the model computes itself under kernels=liger."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # 8 x 64 tokens: float8's weight-gradient matmul needs a multiple of 16
    ids = torch.randint(0, 96, (8, 65), generator=torch.Generator().manual_seed(1)).cuda()
    inputs, labels = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused_loss:
                # contiguous, as the task's labels are: liger flattens them with view()
                loss = model(input_ids=inputs, shift_labels=labels.contiguous()).loss
            else:
                logits = model(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                         labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or
                    torch.cuda.get_device_capability() < (8, 9), reason="needs float8 tensor cores")
def test_float8_on_the_gpu_trains_like_bf16():
    pytest.importorskip("torchao")  # rapidformer[fp8]; GPU calls carry it only for float8 rows
    from rapidformer.transforms.float8 import convert_to_float8

    bf16 = _train_steps(tiny_llama(hidden_size=256, intermediate_size=512).cuda(), 20)
    model = tiny_llama(hidden_size=256, intermediate_size=512).cuda()
    convert_to_float8(model, fp8(fp8_skip_small=False))
    float8 = _train_steps(model, 20)
    assert float8[-1] < float8[0] - 1.0
    assert float8[-1] == pytest.approx(bf16[-1], abs=0.1), (float8, bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_liger_kernels_train_like_the_models_own_layers():
    pytest.importorskip("liger_kernel")
    from rapidformer.transforms.liger import apply_kernels

    own = _train_steps(tiny_llama().cuda(), 20)
    model = tiny_llama().cuda()
    apply_kernels(model, KernelsConfig(name="liger"))
    assert model.model.norm._get_name() == "LigerRMSNorm"  # patched in place, named anew
    fused = _train_steps(model, 20, fused_loss=True)
    assert fused == pytest.approx(own, abs=2e-2)
