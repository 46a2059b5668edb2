"""The console script's verbs (ls, show, validate, plan, env, export, plot), the dry run and
memory=auto, run in this process through `rapidformer.cli.console.main`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from rapidformer.config.compose import GROUPS, group_options
from tests.conftest import FAST

GB = 2**30


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `rapidformer ARGV`."""
    from rapidformer.cli import console

    os.environ.pop("RAPIDFORMER_DEBUG", None)
    try:
        console.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_every_recipe_and_option_with_a_description(capsys):
    code, out, _ = cli(["ls"], capsys)
    assert code == 0
    for group in ("recipe", *GROUPS):
        assert f"\n{group}:\n" in out
        for option in group_options(group):
            line = next(l for l in out.splitlines() if l.strip().startswith(option + " "))
            assert len(line.split(option, 1)[1].strip()) > 10, line  # a description follows
            assert not line.endswith(("e.g.", "i.e.")), line  # cut inside its first sentence
    assert "memory" in out and "auto" in out and "launcher" in out and "slurm" in out


def test_show_prints_the_resolved_config_with_secrets_redacted(capsys):
    code, out, _ = cli(["show", "trainer.lr=0.005", "logger=mlflow",
                        "logger.tracking_uri=https://ann:hunter2@mlflow.example:5000"], capsys)
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["trainer"]["lr"] == 0.005 and shown["recipe"] == "quickstart"
    assert shown["logger"]["tracking_uri"] == "https://ann:***@mlflow.example:5000"
    assert "hunter2" not in out
    from rapidformer.cli.verbs.inspect import redact

    assert redact({"hf_token": "abc", "nested": {"api_key": "k", "name": "x"}}) == \
        {"hf_token": "***", "nested": {"api_key": "***", "name": "x"}}


def test_validate_reports_every_problem_at_once(capsys):
    code, out, _ = cli(["validate"], capsys)
    assert code == 0 and out.startswith("ok: recipe=quickstart")
    code, _, err = cli(["validate", "trainer.lr=abc", "model.hiden_size=3", "memory=zero5"], capsys)
    assert code == 2
    assert "3 problems" in err
    assert "model.hiden_size: unknown key; did you mean 'model.hidden_size'?" in err
    assert "memory=zero5: no such option; did you mean 'memory=zero3'?" in err
    assert "trainer.lr: expected a number, got 'abc'" in err
    if not torch.cuda.is_available():  # what this machine cannot run is a problem too
        code, _, err = cli(["validate", "memory=zero2", "precision=fp16"], capsys)
        assert code == 2 and "DeepSpeed has no fp16 on a CPU" in err


def test_env_names_versions_devices_and_what_each_accelerator_needs(capsys):
    code, out, _ = cli(["env", "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    assert info["versions"]["torch"] == torch.__version__
    assert info["devices"]["cuda"] == torch.cuda.is_available()
    settings = {row["setting"]: row for row in info["accelerators"]}
    assert settings["memory=zero1/2/3"]["available"]  # deepspeed is a test dependency
    assert not settings["graph=ort"]["available"] or info["versions"]["onnxruntime-training"]


# --- the memory plan ------------------------------------------------------------------------

def _cfg(*overrides: str):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    return settle(compose(list(overrides)))[1]


def test_the_plan_counts_the_parameters_of_the_model_the_run_builds():
    from transformers import BertConfig, BertForSequenceClassification

    from rapidformer.planning.model_shape import model_shape

    # the generated pairs hold more words than 100 entries: the trained vocabulary is full
    shape = model_shape(_cfg("model=bert_tiny", "model.vocab_size=100",
                             "data.synthetic_train_size=200"))
    real = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=256, max_position_embeddings=128))
    assert shape.parameters == sum(p.numel() for p in real.parameters())
    assert shape.block_parameters == sum(p.numel() for p in real.bert.encoder.layer[0].parameters())
    assert (shape.layers, shape.hidden, shape.ffn, shape.vocab) == (2, 64, 256, 100)


def test_model_state_estimates_follow_the_zero_arithmetic():
    """16 bytes per parameter unsharded; ZeRO/FSDP divide what they shard by the ranks."""
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import ModelShape

    p = 1_000_000_000
    shape = ModelShape(p, p // 24, 24, 2048, 16, 8192, 50257, True)
    world4 = ["launcher.nproc_per_node=4", "trainer.global_batch_size=128", "precision=bf16"]
    cfg = _cfg(*world4)
    states = {m: estimate(shape, cfg, Mode(m)).model_states for m in
              ("none", "zero1", "zero2", "zero3", "fsdp")}
    assert states["none"] == 16 * p                      # fp32 weights, grads, two moments
    assert states["zero1"] == 2 * p + 2 * p + 12 * p // 4  # 16-bit weights+grads, sharded rest
    assert states["zero2"] == 2 * p + 14 * p // 4
    assert states["zero3"] == 16 * p // 4 and states["fsdp"] == 16 * p // 4
    offloaded = estimate(shape, cfg, Mode("zero3", True, True)).model_states
    assert offloaded == 0
    # activations: checkpointing keeps one layer's input per layer plus one whole layer
    full = estimate(shape, cfg, Mode("none")).activations
    ckpt = estimate(shape, cfg, Mode("none", checkpoint_activations=True)).activations
    assert ckpt < full / 2
    # trainer.offload_activations: the layers' inputs (24 x seq x micro x hidden, fp32
    # residual) are in host memory
    offload = _cfg(*world4, "trainer.checkpoint_activations=true",
                   "trainer.offload_activations=true", "trainer.device=cuda")
    moved = estimate(shape, offload, Mode("none", checkpoint_activations=True)).activations
    c = offload.trainer.micro_batch_size * offload.data.max_seq_length * 2048
    assert ckpt - moved == 24 * c * 4


@pytest.mark.parametrize("peft, base_bytes", [
    # the frozen base's weights only: bf16 (peft.base_dtype=bf16), fp32 (auto: a checkpoint's
    # values decide, counted fp32), qlora's blocks in 4 bits with its scales, the rest bf16
    (["peft=lora", "peft.base_dtype=bf16"], lambda p, blocks: 2 * p),
    (["peft=lora"], lambda p, blocks: 4 * p),
    (["peft=qlora"], lambda p, blocks: blocks * (0.5 + 1 / 64 + 4 / (64 * 256))
     + (p - blocks) * 2),
])
def test_a_peft_run_plans_a_frozen_base_and_trained_adapters(peft, base_bytes):
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import ModelShape

    p, layers, h, f = 8_000_000_000, 32, 4096, 14336
    shape = ModelShape(p, 218_000_000, layers, h, 32, f, 128256, True)
    cfg = _cfg("+recipe=llama_lora", "precision=bf16", "peft.modules_to_save=null", *peft)
    full = estimate(shape, _cfg("+recipe=llama_lora", "precision=bf16", "peft=none"), Mode("none"))
    tuned = estimate(shape, cfg, Mode("none"))
    adapters = cfg.peft.r * layers * (4 * 2 * h + 3 * (h + f))
    assert tuned.model_states == pytest.approx(base_bytes(p, layers * 218_000_000)
                                               + 16 * adapters, rel=1e-6)
    assert full.model_states == 16 * p and tuned.model_states < full.model_states / 3
    assert tuned.activations == full.activations
    # the modules trained in full (the recipe's: embeddings and head, each vocabulary x hidden)
    # add their 16 bytes a parameter
    saved = estimate(shape, _cfg("+recipe=llama_lora", "precision=bf16", *peft,
                                 "peft.modules_to_save=[embed_tokens,lm_head]"), Mode("none"))
    assert saved.model_states - tuned.model_states == pytest.approx(16 * 2 * 128256 * h)
    # DeepSpeed under bf16 holds its weights, the frozen base's too, in 16 bits
    zero2 = estimate(shape, cfg, Mode("zero2"))
    assert zero2.model_states < tuned.model_states or cfg.peft.base_dtype == "bf16" or \
        cfg.peft.name == "qlora"
    assert zero2.model_states <= 2 * p + 16 * adapters


def test_memory_auto_picks_the_fastest_mode_that_fits(capsys):
    from rapidformer.planning.memory_plan import plan
    from rapidformer.planning.model_shape import model_shape

    big = ["model=bert_base", "data.max_seq_length=512", "trainer.micro_batch_size=32",
           "trainer.global_batch_size=64", "launcher.nproc_per_node=2", "precision=bf16"]
    roomy = _cfg(*big, "memory=auto", "memory.device_memory_gb=80")
    assert (roomy.memory.name, roomy.trainer.checkpoint_activations) == ("none", False)
    planned = _cfg(*big, "memory.device_memory_gb=80")
    estimates, _, _ = plan(planned, model_shape(planned))
    need = {e.mode.label(): e.total / GB for e in estimates}
    assert need["fsdp"] < need["zero1"] < need["none"]  # sharding over 2 ranks saves memory
    # a GPU just too small for every mode without checkpointing: the fastest with it
    smallest_plain = min(v for k, v in need.items() if "ckpt" not in k and "offload" not in k)
    tight = (smallest_plain - 0.05 + 1.5) / 0.95
    cfg = _cfg(*big, "memory=auto", f"memory.device_memory_gb={tight}")
    assert cfg.trainer.checkpoint_activations and cfg.memory.name == "none", need
    # between zero1's and none's needs: zero1
    between = ((need["zero1"] + need["none"]) / 2 + 1.5) / 0.95
    assert _cfg(*big, "memory=auto", f"memory.device_memory_gb={between}").memory.name == "zero1"
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="no memory mode fits 1.0 GB"):
        _cfg(*big, "memory=auto", "memory.device_memory_gb=1")


# the Megatron GPT pretraining config the plan is asked about (its data need not exist)
MEGATRON_GPT = ["task=causal_lm", "data=megatron", "data.path=corpus_text_document",
                "trainer.train_iters=10", "model.tokenizer_type=GPT2BPETokenizer",
                "model.tokenizer=vocab.json", "model.merge_file=merges.txt",
                "trainer.export_hf=false", "model=megatron_gpt_tiny"]


def _labels(*overrides: str) -> list[str]:
    from rapidformer.planning.memory_plan import candidate_modes

    return [m.label() for m in candidate_modes(_cfg(*overrides))]


def test_the_candidate_modes_are_tried_fastest_first():
    plain = ["none", "zero1", "zero2", "fsdp", "zero3"]
    offloads = ["zero2 + offload optimizer, act. ckpt", "zero3 + offload optimizer, act. ckpt",
                "zero3 + offload optimizer, offload params, act. ckpt",
                "fsdp + offload optimizer, offload params, act. ckpt"]
    assert _labels("precision=bf16") == \
        [*plain, *(f"{m} + act. ckpt" for m in plain), *offloads]
    assert _labels("precision=bf16", "trainer.checkpoint_activations=true") == \
        [*(f"{m} + act. ckpt" for m in plain), *offloads]
    # the plan's order names every memory option but auto
    from rapidformer.planning.memory_plan import OFFLOADING, SHARDING

    assert set(SHARDING) | set(OFFLOADING) == set(group_options("memory")) - {"auto"}


@pytest.mark.parametrize("overrides, left_out", [
    # LoRA's refusal: FSDP2 and ZeRO-3 would drop the 4-bit base's quantization state
    (["model=llama_tiny", "peft=qlora", "precision=bf16"], ("fsdp", "zero3")),
    # float8's refusal: DeepSpeed's own weight copies bypass torchao's layers
    (["model=llama_tiny", "precision=fp8"], ("zero1", "zero2", "zero3")),
    # precision.fp8_all_gather gathers FSDP2's shards: every other mode refuses it
    (["model=llama_tiny", "precision=fp8", "memory=fsdp", "precision.fp8_all_gather=true"],
     ("none", "zero1", "zero2", "zero3")),
    (["precision=fp16"], ("fsdp",)),  # FSDP2's: no sharded loss scaling
    (["graph=ort"], ("zero1", "zero2", "zero3", "fsdp")),  # ORTModule's one ONNX graph
    # megatron-core runs memory=none/zero1/zero2, without offload
    ([*MEGATRON_GPT, "precision=bf16"], ("fsdp", "zero3", "offload")),
], ids=["qlora", "fp8", "fp8_all_gather", "fp16", "ort", "megatron"])
def test_the_plan_tries_no_mode_the_run_would_refuse(overrides, left_out):
    """The candidates are what the refusal pass allows, asked of it: nothing refused is tried."""
    from rapidformer.planning.memory_plan import candidate_modes, with_mode
    from rapidformer.refusals import config_problems as refusals

    cfg = _cfg(*overrides)
    modes = candidate_modes(cfg)
    assert modes and all(refusals(with_mode(cfg, m)) == [] for m in modes)
    labels = [m.label() for m in modes]
    assert not [label for label in labels if any(word in label for word in left_out)], labels


def test_memory_auto_picks_no_mode_the_run_refuses():
    """precision=fp8 on a 16 GB GPU: ZeRO-2 fits first, which float8 refuses; FSDP2 runs."""
    cfg = _cfg("model=llama_1b", "precision=fp8", "memory=auto", "memory.device_memory_gb=16")
    assert (cfg.memory.name, cfg.memory.offload_params) == ("fsdp", True)


STRATEGY_CONFIGS = [  # (strategy, config, what it shards over the data-parallel ranks)
    ("ddp", ["memory=none"], set()),
    ("ort", ["graph=ort"], set()),
    ("deepspeed", ["memory=zero1"], {"optimizer state"}),
    ("deepspeed", ["memory=zero2"], {"optimizer state", "gradients"}),
    ("deepspeed", ["memory=zero3"], {"optimizer state", "gradients", "parameters"}),
    ("fsdp2", ["memory=fsdp"], {"optimizer state", "gradients", "parameters"}),
    ("megatron", [*MEGATRON_GPT, "memory=none"], set()),
    ("megatron", [*MEGATRON_GPT, "memory=zero1"], {"optimizer state"}),
    ("megatron", [*MEGATRON_GPT, "memory=zero2"], {"optimizer state"}),  # its grads stay whole
]


@pytest.mark.parametrize("name, overrides, sharded", STRATEGY_CONFIGS,
                         ids=[" ".join(o[-1:]) + f" {n}" for n, o, _ in STRATEGY_CONFIGS])
def test_a_strategys_shards_are_what_the_plan_divides_by_the_ranks(name, overrides, sharded):
    """One fact per strategy: its `shards` and the plan's model states come from its
    state_bytes; over 4 ranks the plan divides exactly what it shards."""
    from rapidformer.accelerators.table import STRATEGIES, select
    from rapidformer.planning.memory_plan import Mode, estimate
    from rapidformer.planning.model_shape import model_shape

    assert {n for n, _, _ in STRATEGY_CONFIGS} == set(STRATEGIES)
    one, four = (_cfg(*overrides, "precision=bf16" if name != "ort" else "precision=fp32",
                      f"launcher.nproc_per_node={n}", "trainer.global_batch_size=128")
                 for n in (1, 4))
    cls = select(four)
    assert cls is STRATEGIES[name]
    strategy = cls.__new__(cls)  # `shards` reads the config only: no process group
    strategy.cfg = four
    assert strategy.shards == cls.state_bytes(four).sharded == sharded
    facts = cls.state_bytes(four)
    widths = {"parameters": facts.weights, "gradients": facts.gradients,
              "optimizer state": facts.optimizer}
    mode = Mode(four.memory.name)
    states = [estimate(model_shape(c), c, mode).model_states for c in (one, four)]
    # states(D) = whole + split / D: what one rank saves going from 1 to 4 ranks is 3/4 split
    split = sum(widths[kind] for kind in sharded) / sum(widths.values()) * states[0]
    assert abs((states[0] - states[1]) - split * 3 / 4) <= 2


def test_plan_verb_and_dry_run_print_the_plan_and_start_nothing(tmp_path, capsys):
    code, out, _ = cli(["plan", "memory.device_memory_gb=24"], capsys)
    assert code == 0
    assert "parameters" in out and "| zero3 |" in out and "memory=auto picks: none" in out
    from rapidformer import __main__ as module_main

    run_dir = tmp_path / "never"
    module_main.main(["trainer.dry_run=true", f"trainer.output_dir={run_dir}"])
    assert "| fsdp |" in capsys.readouterr().out
    assert not run_dir.exists()


# --- export and plot --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> Path:
    """One process under DeepSpeed ZeRO-2 (a group of one: no MPI, no launcher)."""
    from rapidformer import __main__ as module_main

    run_dir = tmp_path_factory.mktemp("zero2_one_process")
    module_main.main([*FAST, "memory=zero2", "precision=bf16", "trainer.global_batch_size=16",
                      f"trainer.output_dir={run_dir}"])
    return run_dir


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_export_rebuilds_the_hf_model_from_a_zero_checkpoint(zero2_run, tmp_path, capsys):
    out = tmp_path / "exported"
    code, stdout, err = cli(["export", str(zero2_run), "--to", str(out)], capsys)
    assert code == 0, err
    exported, at_end = _weights(out), _weights(zero2_run / "hf_model")
    assert exported.keys() == at_end.keys()
    assert all(torch.equal(exported[k], at_end[k]) for k in at_end)
    assert (out / "tokenizer.json").is_file()
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(str(out))  # loads as a HF model
    # without the run's own export, the model is rebuilt from its config
    hidden = zero2_run.parent / "hf_model_aside"
    os.rename(zero2_run / "hf_model", hidden)
    try:
        code, _, err = cli(["export", str(zero2_run), "--to", str(tmp_path / "again")], capsys)
    finally:
        os.rename(hidden, zero2_run / "hf_model")
    assert code == 0, err
    assert all(torch.equal(_weights(tmp_path / "again")[k], at_end[k]) for k in at_end)
    # an existing target is refused and left alone; a missing run is named
    code, _, err = cli(["export", str(zero2_run), "--to", str(out)], capsys)
    assert code == 2 and "exists already" in err
    code, _, err = cli(["export", str(tmp_path / "nope"), "--to", str(tmp_path / "x")], capsys)
    assert code == 2 and "no complete checkpoint" in err


def test_plot_writes_png_curves_for_each_run(zero2_run, tmp_path, capsys):
    code, out, err = cli(["plot", str(zero2_run), str(zero2_run), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    for name in ("loss.png", "lr.png", "throughput.png", "eval.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = cli(["plot", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no metrics.jsonl" in err
