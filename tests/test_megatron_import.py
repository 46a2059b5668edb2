"""model.init_from_hf: a megatron-core GPT started from a Hugging Face GPT-2 checkpoint
(rapidformer/models/megatron_import.py). In-process at TP=1: the imported model's logits are
the checkpoint's (its tanh GELU included), and the export gives the checkpoint back. On 2 gloo
ranks at TP=2 and at PP=2: the sharded model computes the checkpoint's logits and the export
(gathered from the shards) is the checkpoint. Refused with one sentence each: another shape,
another architecture's directory, a missing one, and init_from_hf with a non-megatron model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, free_port

VOCAB, SEQ, BATCH = 300, 16, 2
PADDED_VOCAB = 384  # 300 rounded up to a multiple of 128
# megatron_gpt_tiny's shape, with GPT-2's own activation
GPT2_SHAPE = dict(n_layer=4, n_embd=64, n_head=4, n_positions=256, vocab_size=VOCAB,
                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0)


def _cfg(overrides: list[str]):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    return settle(compose(["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "data.path=x",
                            "model.tokenizer=v", "model.merge_file=m", "data.max_seq_length=64",
                            *overrides]), "unused")[1]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _save_gpt2(directory: Path, **changes) -> Path:
    """A random GPT-2 of megatron_gpt_tiny's shape (with `changes`) saved to `directory`, its
    biases and norms away from 0 and 1 so that a tensor put in the wrong place shows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**GPT2_SHAPE, **changes}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory)
    return directory


def _gpt2_logits(directory, tokens) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(directory).eval()(input_ids=tokens).logits


def _max_difference(a: dict, b: dict) -> float:
    """The largest difference between two GPT-2 state dicts, b's padded vocabulary rows
    compared with zeros."""
    worst = 0.0
    for name, tensor in a.items():
        other = b[name]
        if name in ("transformer.wte.weight", "lm_head.weight"):
            other, padding = other[:tensor.shape[0]], other[tensor.shape[0]:]
            worst = max(worst, float(padding.abs().sum()))
        worst = max(worst, float((tensor - other).abs().max()))
    return worst


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _save_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def one_rank():
    """megatron-core's groups for one CPU process (TP=1), as the CPU runs set them up."""
    from megatron.core import parallel_state

    from rapidformer.accelerators import megatron_cpu
    from rapidformer.accelerators.parallel import initialize

    # an earlier test in this process may have left groups of a process group since destroyed
    parallel_state.destroy_model_parallel()
    initialize(_cfg([]), torch.device("cpu"))
    yield
    parallel_state.destroy_model_parallel()
    megatron_cpu.disable()


def test_imported_model_gives_the_checkpoints_logits_and_exports_it_back(one_rank, gpt2_dir):
    from transformers import GPT2LMHeadModel

    from rapidformer.models.megatron import build_megatron_gpt, gelu_tanh
    from rapidformer.models.megatron_export import gather_full_state, to_hf_gpt2

    cfg = _cfg([f"model.init_from_hf={gpt2_dir}"])
    model = build_megatron_gpt(cfg, VOCAB).eval()
    assert model.config.activation_func is gelu_tanh  # GPT-2's gelu_new
    tokens, expected = _tokens(), _gpt2_logits(gpt2_dir, _tokens())
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    assert logits.shape == (BATCH, SEQ, PADDED_VOCAB)
    torch.testing.assert_close(logits[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)
    assert float(logits[..., VOCAB:].abs().max()) == 0.0  # the padded rows are zero

    exported = to_hf_gpt2(gather_full_state(model, 4), cfg, PADDED_VOCAB, 0).eval()
    assert exported.config.activation_function == "gelu_new"
    original = GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    assert _max_difference(original, exported.state_dict()) == 0.0
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits[..., :VOCAB], expected,
                                   atol=1e-5, rtol=1e-5)


def test_random_weights_keep_exact_gelu_and_export_it(one_rank):
    import torch.nn.functional as F

    from rapidformer.models.megatron import mlp_activation, transformer_config

    cfg = _cfg([])
    assert transformer_config(cfg).activation_func is F.gelu
    assert mlp_activation(cfg) == "gelu"  # what to_hf_gpt2 writes for it


def test_exact_gelu_checkpoint_imports_exact_gelu(one_rank, tmp_path):
    import torch.nn.functional as F

    from rapidformer.models.megatron import build_megatron_gpt

    directory = _save_gpt2(tmp_path / "exact", activation_function="gelu")
    model = build_megatron_gpt(_cfg([f"model.init_from_hf={directory}"]), VOCAB).eval()
    assert model.config.activation_func is F.gelu
    with torch.no_grad():
        logits = model(_tokens(), torch.arange(SEQ).expand(BATCH, SEQ), None)
    torch.testing.assert_close(logits[..., :VOCAB], _gpt2_logits(directory, _tokens()),
                               atol=1e-5, rtol=1e-5)


# --- what is refused ---------------------------------------------------------------------------
def _gpt2_config_only(directory: Path, **changes) -> Path:
    """A GPT-2 config.json (no weights): the shape checks read nothing else."""
    from transformers import GPT2Config

    GPT2Config(**{**GPT2_SHAPE, **changes}).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("changes,messages", [
    # GPT-2's MLP is 4 x hidden when n_inner is null
    ({"n_embd": 32}, ["model.hidden_size=64 but {dir} has n_embd=32: set model.hidden_size=32",
                      "model.intermediate_size=256 but {dir} has n_inner=128"]),
    ({"n_layer": 6, "n_positions": 1024, "n_inner": 128},
     ["model.num_layers=4 but {dir} has n_layer=6: set model.num_layers=6",
      "model.max_position_embeddings=256 but {dir} has n_positions=1024: set "
      "model.max_position_embeddings=1024",
      "model.intermediate_size=256 but {dir} has n_inner=128: set model.intermediate_size=128"]),
    ({"n_head": 8}, ["model.num_attention_heads=4 but {dir} has n_head=8"]),
    ({"vocab_size": 500}, ["{dir} has vocab_size=500, more than the run's padded vocabulary of "
                           "384 (the tokenizer's 300 ids rounded up to a multiple of 128)"]),
    ({"vocab_size": 200}, ["the tokenizer has 300 ids but {dir} has vocab_size=200"]),
    ({"layer_norm_epsilon": 1e-6}, ["{dir} has layer_norm_epsilon=1e-06 but "
                                    "model=megatron_gpt's layer norms use 1e-05"]),
    ({"scale_attn_by_inverse_layer_idx": True},
     ["{dir} has scale_attn_by_inverse_layer_idx=True: megatron_gpt does not scale attention by "
      "layer"]),
    ({"activation_function": "relu"},
     ["{dir} has activation_function='relu', which model=megatron_gpt does not compute"]),
])
def test_another_shape_is_refused_before_the_model_is_built(one_rank, tmp_path, changes,
                                                             messages):
    from rapidformer.errors import ConfigError
    from rapidformer.models.megatron import build_megatron_gpt

    directory = _gpt2_config_only(tmp_path / "other", **changes)
    with pytest.raises(ConfigError) as info:
        build_megatron_gpt(_cfg([f"model.init_from_hf={directory}"]), VOCAB)
    assert len(info.value.problems) == len(messages), info.value.problems
    for message in messages:
        assert message.format(dir=directory) in str(info.value)


def test_other_directories_are_refused(one_rank, tmp_path):
    from transformers import BertConfig, LlamaConfig

    from rapidformer.errors import InputError
    from rapidformer.models.megatron import build_megatron_gpt

    def refusal(directory) -> str:
        with pytest.raises(InputError) as info:
            build_megatron_gpt(_cfg([f"model.init_from_hf={directory}"]), VOCAB)
        return str(info.value)

    LlamaConfig(hidden_size=64, num_hidden_layers=4).save_pretrained(tmp_path / "llama")
    assert (f"model.init_from_hf={tmp_path / 'llama'} is a Hugging Face llama checkpoint "
            f"(config.json model_type='llama'); model=megatron_gpt starts only from GPT-2 "
            f"checkpoints") in refusal(tmp_path / "llama")
    BertConfig().save_pretrained(tmp_path / "bert")
    assert "is a Hugging Face bert checkpoint" in refusal(tmp_path / "bert")
    assert (f"model.init_from_hf={tmp_path / 'absent'} does not exist; give a Hugging Face "
            f"GPT-2 checkpoint directory") in refusal(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refusal(tmp_path / "empty")
    no_weights = _gpt2_config_only(tmp_path / "no_weights")
    assert f"model.init_from_hf={no_weights}: its weights could not be read" in refusal(
        no_weights)


def test_a_damaged_weights_file_is_one_clear_error(gpt2_dir, tmp_path):
    import shutil

    from rapidformer.errors import InputError
    from rapidformer.models.megatron_import import read_gpt2_state

    broken = tmp_path / "cut"
    shutil.copytree(gpt2_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(InputError, match=f"model.init_from_hf={broken}: its weights could not "
                                         f"be read \\("):
        read_gpt2_state(str(broken))


def test_a_tensor_left_over_or_missing_is_an_error(one_rank, gpt2_dir):
    from transformers import GPT2LMHeadModel

    from rapidformer.errors import InputError
    from rapidformer.models.megatron import build_megatron_gpt
    from rapidformer.models.megatron_import import copy_shards, megatron_state

    gpt2 = GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    with pytest.raises(InputError, match=r"no megatron-core counterpart: \['transformer.extra'\]"):
        megatron_state({**gpt2, "transformer.extra": torch.zeros(1)}, 4, 4, PADDED_VOCAB)
    state = megatron_state(gpt2, 4, 4, PADDED_VOCAB)
    del state["decoder.layers.2.mlp.linear_fc1.bias"]
    model = build_megatron_gpt(_cfg([]), VOCAB)
    used, problems, _ = copy_shards(model, state, 4)
    assert problems == ["megatron parameter decoder.layers.2.mlp.linear_fc1.bias "
                        "(decoder.layers.2.mlp.linear_fc1.bias) has no tensor in the checkpoint"]
    assert used == set(state)


@pytest.mark.parametrize("model", ["gpt2_tiny", "megatron_bert_tiny"])
def test_init_from_hf_needs_megatron_gpt(model):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.errors import ConfigError

    arch = {"gpt2_tiny": "gpt2", "megatron_bert_tiny": "megatron_bert"}[model]
    with pytest.raises(ConfigError) as info:
        settle(compose(["+recipe=gpt_pretrain", f"model={model}", "data.path=x",
                         "model.tokenizer=v", "model.merge_file=m", "model.init_from_hf=ckpt"]),
                "unused")
    assert (f"model.init_from_hf=ckpt with model.arch={arch}: only model=megatron_gpt starts "
            f"from a Hugging Face GPT-2 checkpoint; use model=megatron_gpt") in str(info.value)


# --- tensor and pipeline parallelism: 2 gloo ranks ---------------------------------------------
def _megatron_logits(model) -> torch.Tensor | None:
    """The whole vocabulary's logits of the sharded model on the last stage (None elsewhere):
    TP shards gathered, PP's hidden states sent from the first stage to the last."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens, positions = _tokens(), torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        if ps.get_pipeline_model_parallel_world_size() > 1:
            if ps.is_pipeline_first_stage():
                dist.send(model(tokens, positions, None).contiguous(),
                          ps.get_pipeline_model_parallel_next_rank())
                return None
            hidden = torch.empty(SEQ, BATCH, model.config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        logits = model(tokens, positions, None)
    shards = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, logits, group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, -1)


def _layout_worker(rank: int, port: int, layout: str, directory: str, out: str):
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    from rapidformer.accelerators.parallel import initialize
    from rapidformer.models.megatron import build_megatron_gpt
    from rapidformer.models.megatron_export import gather_full_state, to_hf_gpt2

    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = _cfg([f"parallelism={layout}", "launcher.nproc_per_node=2",
                f"model.init_from_hf={directory}"])
    initialize(cfg, torch.device("cpu"))
    model = build_megatron_gpt(cfg, VOCAB).eval()
    expected = _gpt2_logits(directory, _tokens())
    result = {}
    logits = _megatron_logits(model)
    if logits is not None:
        assert logits.shape[-1] == PADDED_VOCAB
        result["megatron_logits"] = float((logits[..., :VOCAB] - expected).abs().max())
    full = gather_full_state(model, 4)
    if full is not None:
        exported = to_hf_gpt2(full, cfg, PADDED_VOCAB, 0).eval()
        original = GPT2LMHeadModel.from_pretrained(directory).state_dict()
        with torch.no_grad():
            theirs = exported(input_ids=_tokens()).logits[..., :VOCAB]
        result.update(export_tensors=_max_difference(original, exported.state_dict()),
                      export_logits=float((theirs - expected).abs().max()),
                      activation=exported.config.activation_function)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


# 6-7 s each measured (2 spawned processes import megatron-core): under the slow mark's 15 s
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_layouts_import_the_checkpoint_and_export_it_back(tmp_path, gpt2_dir, layout):
    """Each rank cuts its shard of the checkpoint: the sharded model's logits are GPT-2's, and
    gathering the shards back through the export gives the checkpoint's tensors."""
    port = free_port()
    out = tmp_path / "results.json"
    mp.start_processes(_layout_worker, args=(port, layout, str(gpt2_dir), str(out)), nprocs=2,
                       start_method="spawn")
    first, last = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1))
    # TP: both ranks hold the last stage; PP: rank 1 does
    for result in ([first, last] if layout == "tp2" else [last]):
        assert result["megatron_logits"] <= 1e-5, result
    assert first["export_tensors"] == 0.0 and first["export_logits"] <= 1e-5, first
    assert first["activation"] == "gelu_new"
