"""model=megatron_llama: a Llama-family megatron-core decoder (RMSNorm, SwiGLU, rotary positions,
grouped-query attention) started from Hugging Face Llama, Mistral and Qwen2 checkpoints
(rapidformer/models/megatron_llama.py) and exported back to their classes.

In-process at TP=1: each family's logits are the checkpoint's (Qwen2's q/k/v biases, Llama 3's
rotary scaling and tied embeddings, Mistral's window wider than the sequence included), the export
is the checkpoint tensor for tensor, and the saved export loads with the same logits; random
weights export as a LlamaForCausalLM with the same logits. On 2 gloo ranks: TP=2 (also with
sequence parallelism) and PP=2 cut the checkpoint and gather it back. Through the CLI: a run from
a checkpoint learns, TP=2 and DP=2 with the distributed optimizer follow one process, TP=2's
checkpoint resumes on one process, the export loads.
Refused with one sentence per key: what megatron_llama does not compute."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, assert_ok, free_port, run_cli, train_losses

VOCAB, SEQ, BATCH = 300, 16, 2
PADDED_VOCAB = 384  # 300 rounded up to a multiple of 128
# megatron_llama_tiny's shape
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, max_position_embeddings=256, vocab_size=VOCAB)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Llama 3's scaling at a tiny scale: an original context of 32 positions puts the 8 frequencies
# of a 16-wide head on both sides of the smoothed band
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters=DEFAULT_ROPE, rms_norm_eps=1e-5)),
    "llama3_tied": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(rope_parameters=DEFAULT_ROPE, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", dict(rope_parameters=DEFAULT_ROPE, sliding_window=64)),
}


def _cfg(overrides: list[str]):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    return settle(compose(["+recipe=gpt_pretrain", "model=megatron_llama_tiny", "data.path=x",
                            "model.tokenizer=v", "model.merge_file=m", "data.max_seq_length=64",
                            *overrides]), "unused")[1]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _hf_config(family: str, **changes):
    import transformers

    name, settings = FAMILIES[family]
    return getattr(transformers, name)(**{**SHAPE, **settings, **changes})


def _save(directory: Path, family: str, **changes) -> Path:
    """A random checkpoint of megatron_llama_tiny's shape, its norms and biases away from 1 and
    0 so that a tensor put in the wrong place shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family, **changes))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory)
    return directory


def _hf_logits(directory, tokens=None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=_tokens() if tokens is None else tokens).logits


def _hf_state(directory) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {family: _save(tmp_path_factory.mktemp(family), family) for family in FAMILIES}


@pytest.fixture(scope="module")
def one_rank():
    """megatron-core's groups for one CPU process (TP=1), as the CPU runs set them up."""
    from megatron.core import parallel_state

    from rapidformer.accelerators import megatron_cpu
    from rapidformer.accelerators.parallel import initialize

    parallel_state.destroy_model_parallel()
    initialize(_cfg([]), torch.device("cpu"))
    yield
    parallel_state.destroy_model_parallel()
    megatron_cpu.disable()


def _megatron_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens(), torch.arange(SEQ).expand(BATCH, SEQ), None)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_gives_its_logits_and_exports_back(one_rank, checkpoints, family, tmp_path):
    from transformers import AutoModelForCausalLM

    from rapidformer.models.megatron import build_megatron_decoder
    from rapidformer.models.megatron_export import gather_full_state, to_hf

    directory = checkpoints[family]
    cfg = _cfg([f"model.init_from_hf={directory}"])
    model = build_megatron_decoder(cfg, VOCAB).eval()
    assert model.share_embeddings_and_output_weights == (family == "llama3_tied")
    assert model.config.add_qkv_bias == (family == "qwen2")
    expected = _hf_logits(directory)
    logits = _megatron_logits(model)
    assert logits.shape == (BATCH, SEQ, PADDED_VOCAB)
    torch.testing.assert_close(logits[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)
    assert float(logits[..., VOCAB:].abs().max()) == 0.0  # the padded rows are zero

    exported = to_hf(gather_full_state(model, 2), cfg, 0).eval()
    original = AutoModelForCausalLM.from_pretrained(directory)
    assert type(exported) is type(original)
    assert exported.config.to_diff_dict() == original.config.to_diff_dict()
    assert _max_difference(original.state_dict(), exported.state_dict()) == 0.0
    exported.save_pretrained(tmp_path / "export")
    torch.testing.assert_close(_hf_logits(tmp_path / "export"), expected, atol=1e-5, rtol=1e-5)


def test_random_weights_export_as_llama_with_the_same_logits(one_rank):
    from transformers import LlamaForCausalLM

    from rapidformer.models.megatron import build_megatron_decoder
    from rapidformer.models.megatron_export import gather_full_state, to_hf

    cfg = _cfg(["model.rope_theta=500000"])
    model = build_megatron_decoder(cfg, VOCAB).eval()
    with torch.no_grad():  # norms away from 1
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    exported = to_hf(gather_full_state(model, 2), cfg, 7).eval()
    assert type(exported) is LlamaForCausalLM
    config = exported.config
    assert (config.vocab_size, config.rms_norm_eps, config.tie_word_embeddings,
            config.num_key_value_heads, config.rope_parameters["rope_theta"],
            config.eos_token_id) == (PADDED_VOCAB, 1e-5, False, 2, 500000.0, 7)
    with torch.no_grad():
        theirs = exported(input_ids=_tokens()).logits
    torch.testing.assert_close(_megatron_logits(model), theirs, atol=1e-5, rtol=1e-5)
    # megatron-core's own DotProductAttention (grouped-query too) computes the same
    eager = build_megatron_decoder(_cfg(["model.rope_theta=500000",
                                         "model.attn_implementation=eager"]), VOCAB).eval()
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(_megatron_logits(eager), theirs, atol=1e-5, rtol=1e-5)


# --- what is refused ---------------------------------------------------------------------------
def _config_only(directory: Path, family: str = "llama", **changes) -> Path:
    _hf_config(family, **changes).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family,changes,messages", [
    ("llama", {"hidden_size": 32, "num_key_value_heads": 4, "max_position_embeddings": 4096},
     ["model.hidden_size=64 but {dir} has hidden_size=32: set model.hidden_size=32",
      "model.num_key_value_heads=2 but {dir} has num_key_value_heads=4",
      "model.max_position_embeddings=256 but {dir} has max_position_embeddings=4096"]),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
     ["model.rope_theta=10000.0 but {dir} has rope_theta=500000.0: set model.rope_theta=500000.0"]),
    ("llama", {"vocab_size": 200}, ["the tokenizer has 300 ids but {dir} has vocab_size=200"]),
    ("llama", {"hidden_act": "gelu", "attention_bias": True, "mlp_bias": True, "head_dim": 32},
     ["{dir} has hidden_act='gelu': megatron_llama's MLP is SwiGLU with SiLU",
      "{dir} has attention_bias=True: megatron_llama has no biases",
      "{dir} has mlp_bias=True", "{dir} has head_dim=32, not hidden_size / num_attention_heads"]),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     ["{dir} has rope_parameters of rope_type='yarn': megatron_llama computes the rotary types "
      "default, linear, llama3"]),
    ("mistral", {"sliding_window": 32},
     ["{dir} has sliding_window=32 (each token attends to the last 32 only) but "
      "data.max_seq_length=64: megatron_llama attends to every earlier token, the same only up "
      "to the window; set data.max_seq_length<=32"]),
])
def test_what_megatron_llama_does_not_compute_is_refused(one_rank, tmp_path, family, changes,
                                                        messages):
    from rapidformer.errors import ConfigError
    from rapidformer.models.megatron import build_megatron_decoder

    directory = _config_only(tmp_path / "other", family, **changes)
    with pytest.raises(ConfigError) as info:
        build_megatron_decoder(_cfg([f"model.init_from_hf={directory}"]), VOCAB)
    text = str(info.value)
    for message in messages:
        assert message.format(dir=directory) in text, text
    assert len(info.value.problems) == len(messages), info.value.problems


def test_other_directories_and_missing_tensors_are_refused(one_rank, tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config

    from rapidformer.errors import InputError
    from rapidformer.models.megatron import build_megatron_decoder

    def refusal(directory) -> str:
        with pytest.raises(InputError) as info:
            build_megatron_decoder(_cfg([f"model.init_from_hf={directory}"]), VOCAB)
        return str(info.value)

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    assert (f"model.init_from_hf={tmp_path / 'gpt2'} is a Hugging Face gpt2 checkpoint "
            f"(config.json model_type='gpt2'); model=megatron_llama starts from llama, mistral, "
            f"qwen2 checkpoints: give one of those or model=megatron_gpt") in refusal(
        tmp_path / "gpt2")
    assert f"model.init_from_hf={tmp_path / 'absent'} does not exist" in refusal(
        tmp_path / "absent")
    no_weights = _config_only(tmp_path / "no_weights")
    assert f"model.init_from_hf={no_weights}: its weights could not be read" in refusal(
        no_weights)
    # a weights file cut short, one of noise, an index that is no JSON: one message each
    whole = (checkpoints["llama"] / "model.safetensors").read_bytes()
    for name, content, file in [("cut", whole[:len(whole) // 2], "model.safetensors"),
                                ("noise", b"\x07" * 4096, "model.safetensors"),
                                ("index", b"{not json", "model.safetensors.index.json"),
                                ("map_list", b'{"weight_map": ["a"]}',
                                 "model.safetensors.index.json"),
                                ("index_null", b"null", "model.safetensors.index.json"),
                                ("bin_noise", b"\x80\x02junk" * 100, "pytorch_model.bin"),
                                ("bin_empty", b"", "pytorch_model.bin")]:
        broken = _config_only(tmp_path / name)
        (broken / file).write_bytes(content)
        assert f"model.init_from_hf={broken}: its weights could not be read (" in \
            refusal(broken), name
    # a checkpoint short of one tensor and holding one nothing takes
    damaged = tmp_path / "damaged"
    _config_only(damaged)
    tensors = load_file(checkpoints["llama"] / "model.safetensors")
    tensors["model.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    text = refusal(damaged)
    assert "tensors the model needs are not in it: ['model.layers.1.mlp.up_proj.weight']" in text
    assert "tensors with no megatron-core counterpart: ['model.extra.weight']" in text


def test_config_refusals():
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError
    from rapidformer.preflight import settle

    def problems(overrides) -> str:
        with pytest.raises(ConfigError) as info:
            _cfg(overrides)
        return str(info.value)

    assert ("model.num_key_value_heads=2 does not divide by "
            "parallelism.tensor_model_parallel_size=4: each tensor-parallel rank holds whole "
            "key/value heads") in problems(["parallelism.tensor_model_parallel_size=4",
                                             "launcher.nproc_per_node=4"])
    assert "data.reset_position_ids=true with model=megatron_llama" in problems(
        ["data.reset_position_ids=true"])
    with pytest.raises(ConfigError) as info:
        settle(compose(["+recipe=gpt_pretrain", "model=megatron_bert_tiny", "data.path=x",
                         "model.tokenizer=v", "model.merge_file=m", "model.init_from_hf=ckpt"]),
               "unused")
    assert ("model.init_from_hf=ckpt with model.arch=megatron_bert: only model=megatron_gpt "
            "starts from a Hugging Face GPT-2 checkpoint; use model=megatron_gpt "
            "(model=megatron_llama for a Llama, Mistral or Qwen2 checkpoint)") in str(info.value)


# --- tensor and pipeline parallelism: 2 gloo ranks ---------------------------------------------
def _sharded_logits(model) -> torch.Tensor | None:
    """The whole vocabulary's logits on the last stage (None elsewhere), as for GPT-2 (the same
    tokens: the same VOCAB, SEQ, BATCH and seed)."""
    from tests.test_megatron_import import _megatron_logits

    return _megatron_logits(model)


# (layout, its overrides, the checkpoint): TP cuts the fused q/k/v by key/value group and
# SwiGLU's gate and up rows separately; PP=2 puts the tied embedding on both stages
LAYOUTS = [("tp2", ["parallelism=tp2"], "qwen2"),
           ("tp2_sp", ["parallelism=tp2", "parallelism.sequence_parallel=true"], "llama"),
           ("pp2", ["parallelism=pp2"], "llama3_tied")]


def _layout_worker(rank: int, port: int, directories: dict, out: str):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rapidformer.accelerators.parallel import initialize
    from rapidformer.models.megatron import build_megatron_decoder
    from rapidformer.models.megatron_export import gather_full_state, to_hf

    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for layout, overrides, family in LAYOUTS:
        directory = directories[family]
        cfg = _cfg([*overrides, "launcher.nproc_per_node=2", f"model.init_from_hf={directory}"])
        parallel_state.destroy_model_parallel()
        initialize(cfg, torch.device("cpu"))
        model = build_megatron_decoder(cfg, VOCAB).eval()
        expected = _hf_logits(directory)
        result = results[layout] = {}
        logits = _sharded_logits(model)
        if logits is not None:
            result["logits"] = float((logits[..., :VOCAB] - expected).abs().max())
        full = gather_full_state(model, 2)
        if full is not None:
            exported = to_hf(full, cfg, 0).eval()
            with torch.no_grad():
                theirs = exported(input_ids=_tokens()).logits
            result.update(export_tensors=_max_difference(_hf_state(directory),
                                                         exported.state_dict()),
                          export_logits=float((theirs - expected).abs().max()),
                          hf_class=type(exported).__name__)
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


# one pair of spawned processes for the three layouts (each spawn imports megatron-core):
# 18 s measured on 2 shared cores
@pytest.mark.slow
def test_layouts_cut_the_checkpoint_and_gather_it_back(tmp_path, checkpoints):
    port = free_port()
    out = tmp_path / "results.json"
    mp.start_processes(_layout_worker, args=(port, {k: str(v) for k, v in checkpoints.items()},
                                             str(out)), nprocs=2, start_method="spawn")
    first, last = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1))
    classes = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
               "llama3_tied": "LlamaForCausalLM"}
    for layout, _, family in LAYOUTS:
        # TP: both ranks hold the last stage; PP: rank 1 does
        for result in ([first[layout], last[layout]] if layout != "pp2" else [last[layout]]):
            assert result["logits"] <= 1e-5, (layout, result)
        assert first[layout]["export_tensors"] == 0.0, (layout, first[layout])
        assert first[layout]["export_logits"] <= 1e-5, (layout, first[layout])
        assert first[layout]["hf_class"] == classes[family]


# --- through the CLI ---------------------------------------------------------------------------
def _cli_args(data: dict) -> list[str]:
    return ["+recipe=gpt_pretrain", "model=megatron_llama_tiny", f"data.path={data['gpt']}",
            f"model.tokenizer={data['gpt2_vocab']}", f"model.merge_file={data['merges']}",
            "data.max_seq_length=64", "data.num_workers=0", "trainer.micro_batch_size=4",
            "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.train_iters=6",
            "trainer.log_interval=1", "trainer.eval_iters=1", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "trainer.save_last=false"]


@pytest.mark.slow  # 3 runs through the CLI, one of them on 2 processes: 40 s measured
def test_cli_trains_from_a_checkpoint_resumes_and_exports_it(tmp_path, pretraining_data):
    """A run from a Llama checkpoint (the data's tokenizer) learns; 2 gloo ranks at TP=2 give
    one process's losses; TP=2's checkpoint (megatron-core saves SwiGLU's gate and up apart)
    resumes on one process with the same losses; the hf_model loads as LlamaForCausalLM of the
    checkpoint's config. (DP=2 with the distributed optimizer, which does not depend on the
    model: tests/test_strategies.py, in-process.)"""
    from transformers import LlamaForCausalLM

    from rapidformer.data.pretraining_tokenizer import load_pretraining_tokenizer

    d = pretraining_data
    tokenizer = load_pretraining_tokenizer(_cfg([f"model.tokenizer={d['gpt2_vocab']}",
                                                 f"model.merge_file={d['merges']}"]).model,
                                           d["gpt"])
    start = _save(tmp_path / "llama", "llama", vocab_size=tokenizer.vocab_size)
    args = [*_cli_args(d), f"model.init_from_hf={start}"]
    runs = {}
    for name, extra in {
            "one": [],
            "tp2": ["parallelism=tp2", "launcher.nproc_per_node=2", "trainer.save_interval=3"],
            "resumed": ["trainer.export_hf=false",
                        f"trainer.resume={tmp_path / 'tp2' / 'checkpoints' / 'step_00000003'}"],
    }.items():
        result = assert_ok(run_cli([*args, *extra, f"trainer.output_dir={tmp_path / name}"],
                                   cwd=tmp_path))
        runs[name] = train_losses(tmp_path / name)
        if name == "one":
            assert f"model.init_from_hf: weights of {start} (llama)" in result.stderr + \
                result.stdout
    assert runs["one"][6] < runs["one"][1] - 0.3, runs["one"]
    assert sorted(runs["resumed"]) == [4, 5, 6], runs["resumed"]
    for name in ("tp2", "resumed"):
        for step, loss in runs[name].items():
            assert loss == pytest.approx(runs["one"][step], rel=1e-4), (name, step, runs)
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "tp2" / "hf_model")
    assert exported.config.to_diff_dict() == LlamaForCausalLM.from_pretrained(
        start).config.to_diff_dict()
    assert _max_difference(_hf_state(start), exported.state_dict()) > 1e-3  # it trained
