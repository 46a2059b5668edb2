"""A Hugging Face GPT-2 checkpoint as the starting weights of a megatron-core GPT
(`model.init_from_hf=DIR`): the inverse of megatron_export.to_hf_gpt2.

GPT-2's tensors are renamed to megatron-core's, its separate q, k, v columns re-interleaved per
head ([head][q|k|v][head_dim], megatron-core's fused layout), its Conv1D weights transposed back
to Linear weights and its vocabulary padded with zero rows to the run's padded size; then each
rank keeps its tensor-parallel shard of its pipeline stage's layers. The checkpoint's shape must
be the run's (model.*): a mismatch is refused before the model is built.
"""
from __future__ import annotations

import functools
import math
import re

import torch

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError, InputError
from rapidformer.models.megatron_shards import checkpoint_model_type
from rapidformer.models.megatron_shards import copy_shards, load_global_state  # noqa: F401 (copy_shards: its callers' name for it here)
from rapidformer.models.megatron_vocab import VOCAB_MULTIPLE

# GPT-2 configs' activation_function -> the name megatron_gpt computes it under: exact GELU, or
# the tanh approximation (OpenAI's GPT-2; gelu_pytorch_tanh is torch's kernel of the same formula)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}
# the (run field, GPT-2 config field) pairs whose values must be equal
SHAPE_FIELDS = [("num_layers", "n_layer"), ("hidden_size", "n_embd"),
                ("num_attention_heads", "n_head"), ("intermediate_size", "n_inner"),
                ("max_position_embeddings", "n_positions")]
# GPT-2's tensors that hold no weights of their own (the causal-mask buffers of old checkpoints,
# the output layer tied to the word embedding)
NOT_IMPORTED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|^lm_head\.weight)$")


def read_gpt2_config(directory: str):
    """The GPT2Config of a checkpoint directory (config.json only, never the network); a
    missing directory or another architecture is refused."""
    from transformers import GPT2Config

    path, model_type = checkpoint_model_type(directory, "GPT-2")
    if model_type != "gpt2":
        raise InputError(f"model.init_from_hf={directory} is a Hugging Face {model_type} "
                         f"checkpoint (config.json model_type={model_type!r}); model=megatron_gpt "
                         f"starts only from GPT-2 checkpoints (model_type 'gpt2'): give a GPT-2 "
                         f"directory, or train this one as it is with model=hf "
                         f"model.name_or_path={directory}")
    return GPT2Config.from_json_file(str(path / "config.json"))


@functools.lru_cache(maxsize=None)
def _checkpoint_activation(directory: str) -> str:
    # read once per process: the export at the end of a run must not need the directory again
    name = read_gpt2_config(directory).activation_function
    if name not in ACTIVATIONS:
        raise ConfigError([f"model.init_from_hf={directory} has activation_function={name!r}, "
                           f"which model=megatron_gpt does not compute (it has "
                           f"{', '.join(sorted(ACTIVATIONS))}); start from a GPT-2 checkpoint "
                           f"with one of those"])
    return ACTIVATIONS[name]


def hf_activation(cfg: RunConfig) -> str:
    """GPT-2's name for the MLP activation of the run's megatron GPT: exact GELU ("gelu") for
    random weights, the checkpoint's for model.init_from_hf ("gelu_new": the tanh approximation
    of GPT-2's own checkpoints)."""
    if not cfg.model.init_from_hf:
        return "gelu"
    return _checkpoint_activation(str(cfg.model.init_from_hf))


def check_gpt2_checkpoint(cfg: RunConfig, layernorm_epsilon: float, vocab_size: int,
                          padded_vocab: int) -> None:
    """Every way model.init_from_hf's architecture differs from the run's, refused at once."""
    m, directory = cfg.model, cfg.model.init_from_hf
    hf = read_gpt2_config(directory)
    theirs = {**hf.to_dict(), "n_inner": hf.n_inner or 4 * hf.n_embd}  # GPT-2's default MLP
    problems = [f"model.{field}={getattr(m, field)} but {directory} has {hf_field}="
                f"{theirs[hf_field]}: set model.{field}={theirs[hf_field]}"
                for field, hf_field in SHAPE_FIELDS if getattr(m, field) != theirs[hf_field]]
    if hf.vocab_size > padded_vocab:
        step = math.lcm(VOCAB_MULTIPLE, cfg.parallelism.tensor_model_parallel_size)
        problems.append(f"{directory} has vocab_size={hf.vocab_size}, more than the run's padded "
                        f"vocabulary of {padded_vocab} (the tokenizer's {vocab_size} ids rounded "
                        f"up to a multiple of {step}): use the checkpoint's tokenizer "
                        f"(model.tokenizer, model.merge_file)")
    elif hf.vocab_size < vocab_size:
        problems.append(f"the tokenizer has {vocab_size} ids but {directory} has vocab_size="
                        f"{hf.vocab_size}: ids from {hf.vocab_size} on would have no trained "
                        f"embedding; use the checkpoint's tokenizer (model.tokenizer, "
                        f"model.merge_file)")
    if not math.isclose(hf.layer_norm_epsilon, layernorm_epsilon, rel_tol=1e-6):
        problems.append(f"{directory} has layer_norm_epsilon={hf.layer_norm_epsilon} but "
                        f"model=megatron_gpt's layer norms use {layernorm_epsilon} (GPT-2's); "
                        f"start from a checkpoint trained with layer_norm_epsilon="
                        f"{layernorm_epsilon}")
    # what GPT-2's config can switch that megatron-core's GPT does not compute
    for field, wanted, meaning in (
            ("tie_word_embeddings", True, "megatron_gpt ties its output layer to the word "
                                          "embedding"),
            ("scale_attn_weights", True, "megatron_gpt scales attention scores by "
                                         "1/sqrt(head_dim)"),
            ("scale_attn_by_inverse_layer_idx", False, "megatron_gpt does not scale attention "
                                                       "by layer"),
            ("add_cross_attention", False, "megatron_gpt is a decoder without cross-attention")):
        if bool(getattr(hf, field, wanted)) != wanted:
            problems.append(f"{directory} has {field}={not wanted}: {meaning}; start from a "
                            f"checkpoint with {field}={wanted}")
    if problems:
        raise ConfigError([f"model.init_from_hf: {problem}" for problem in problems])


def unreadable_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or cut-short checkpoint raises (safetensors' own error, torch's
    unpickling of a .bin, an empty file, JSON): each becomes one InputError naming the
    directory."""
    import pickle

    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError,
            SafetensorError)


def unreadable(directory: str, error: BaseException) -> InputError:
    return InputError(f"model.init_from_hf={directory}: its weights could not be read "
                      f"({type(error).__name__}: {error}); give the directory that "
                      f"save_pretrained wrote (model.safetensors or pytorch_model.bin), "
                      f"complete")


def read_gpt2_state(directory: str) -> dict:
    """The checkpoint's tensors under GPT2LMHeadModel's names (transformers reads every file
    layout, old unprefixed names included); local files only."""
    from transformers import GPT2LMHeadModel

    # transformers may draw weights it then overwrites; the run's random streams stay untouched
    with torch.random.fork_rng(devices=[]):
        try:
            model = GPT2LMHeadModel.from_pretrained(directory, local_files_only=True)
        except unreadable_errors() as error:
            raise unreadable(directory, error) from error
    return dict(model.state_dict())


def megatron_state(gpt2: dict, num_layers: int, heads: int, padded_vocab: int) -> dict:
    """{megatron-core global name: full tensor} from GPT2LMHeadModel's state: to_hf_gpt2 read
    backwards. Every GPT-2 tensor is used; one left over is an error."""
    gpt2 = {name: tensor for name, tensor in gpt2.items() if not NOT_IMPORTED.search(name)}
    take = gpt2.pop
    word_embeddings = take("transformer.wte.weight")
    hidden = word_embeddings.shape[1]
    head_dim = hidden // heads
    # the padded rows belong to no token: zero, as they would come back from the export
    padded = word_embeddings.new_zeros(padded_vocab, hidden)
    padded[:word_embeddings.shape[0]] = word_embeddings
    state = {"embedding.word_embeddings.weight": padded,
             "embedding.position_embeddings.weight": take("transformer.wpe.weight"),
             "decoder.final_layernorm.weight": take("transformer.ln_f.weight"),
             "decoder.final_layernorm.bias": take("transformer.ln_f.bias")}
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        # GPT-2's Conv1D stores (in, out): the transpose of a Linear's weight. Its c_attn
        # columns are [q | k | v]; megatron-core's rows are [head][q|k|v][head_dim]
        qkv_weight = take(src + "attn.c_attn.weight").t().reshape(3, heads, head_dim, hidden)
        qkv_bias = take(src + "attn.c_attn.bias").reshape(3, heads, head_dim)
        state.update({
            dst + "input_layernorm.weight": take(src + "ln_1.weight"),
            dst + "input_layernorm.bias": take(src + "ln_1.bias"),
            dst + "self_attention.linear_qkv.weight":
                qkv_weight.transpose(0, 1).reshape(3 * hidden, hidden),
            dst + "self_attention.linear_qkv.bias": qkv_bias.transpose(0, 1).reshape(3 * hidden),
            dst + "self_attention.linear_proj.weight": take(src + "attn.c_proj.weight").t(),
            dst + "self_attention.linear_proj.bias": take(src + "attn.c_proj.bias"),
            dst + "pre_mlp_layernorm.weight": take(src + "ln_2.weight"),
            dst + "pre_mlp_layernorm.bias": take(src + "ln_2.bias"),
            dst + "mlp.linear_fc1.weight": take(src + "mlp.c_fc.weight").t(),
            dst + "mlp.linear_fc1.bias": take(src + "mlp.c_fc.bias"),
            dst + "mlp.linear_fc2.weight": take(src + "mlp.c_proj.weight").t(),
            dst + "mlp.linear_fc2.bias": take(src + "mlp.c_proj.bias"),
        })
    if gpt2:
        raise InputError(f"GPT-2 -> megatron GPT: tensors with no megatron-core counterpart: "
                         f"{sorted(gpt2)}")
    return state


def load_gpt2_weights(model: torch.nn.Module, cfg: RunConfig, padded_vocab: int) -> int:
    """model.init_from_hf's weights in this rank's parameters (collective over every rank, so
    that a problem on one rank stops them all); the number of values copied here."""
    m = cfg.model
    state = megatron_state(read_gpt2_state(m.init_from_hf), m.num_layers,
                           m.num_attention_heads, padded_vocab)
    return load_global_state(model, state, m.num_layers,
                             f"model.init_from_hf={m.init_from_hf}: the GPT-2 weights do not fit "
                             f"the megatron-core GPT")
