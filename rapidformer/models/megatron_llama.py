"""The Llama family (Llama, Mistral, Qwen2) between Hugging Face and `model=megatron_llama`:
what a checkpoint's config.json makes the megatron-core model compute, the refusal of what it
does not, its tensors renamed and fused into megatron-core's layout (each rank then keeps its
shard: megatron_shards), and the gathered weights back as the Hugging Face class.

megatron-core's layout, per decoder layer (the same as NVIDIA's Megatron-Bridge writes):
- `linear_qkv` fuses q_proj, k_proj and v_proj grouped by key/value head: for each of the
  `num_key_value_heads` groups, its heads/groups query heads, then its key head, then its value
  head ([group][q ... q, k, v][head_dim] rows). Tensor parallelism gives each rank whole groups,
  so TP must divide the key/value heads. Qwen2's q/k/v biases are fused the same way.
- `linear_fc1` is [gate_proj; up_proj] (SwiGLU: silu(gate) x up); each tensor-parallel rank holds
  its rows of both (megatron_shards.cut).
- `linear_proj` is o_proj, `linear_fc2` down_proj, the two RMSNorms input_layernorm and
  pre_mlp_layernorm, then `decoder.final_layernorm`, `embedding.word_embeddings` and
  `output_layer` (or the embedding, for a checkpoint with tied embeddings).
The vocabulary is padded with zero rows to a multiple of lcm(128, TP) (megatron_vocab), and the
export cuts it back to the checkpoint's size.

What a checkpoint decides beyond the run's shape (model.*, which must equal it): the RMSNorm
epsilon, tied embeddings, Qwen2's q/k/v biases, and rotary scaling (Llama 3's, or linear).
What is refused, naming the key: another activation, biases elsewhere (attention_bias,
mlp_bias), a head size other than hidden / heads, rotary scaling that depends on the sequence
length or rescales attention (dynamic, yarn, longrope), sliding-window attention narrower than
data.max_seq_length.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError, InputError
from rapidformer.models.megatron_shards import checkpoint_model_type

# config.json model_type -> the transformers class prefix (LlamaConfig, LlamaForCausalLM, ...)
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
# rotary types whose frequencies are fixed and whose attention is not rescaled: megatron-core's
# RotaryEmbedding takes their inverse frequencies as they are
ROTARY_TYPES = ("default", "linear", "llama3")
# the (run field, config.json field) pairs whose values must be equal
SHAPE_FIELDS = [("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                ("num_attention_heads", "num_attention_heads"),
                ("num_key_value_heads", "num_key_value_heads"),
                ("intermediate_size", "intermediate_size"),
                ("max_position_embeddings", "max_position_embeddings"),
                ("rope_theta", "rope_theta")]
# checkpoint tensors that hold no weights (older checkpoints saved the rotary frequencies)
NOT_IMPORTED = re.compile(r"rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class LlamaSettings:
    """What the run's megatron_llama computes beyond its shape."""
    family: str = "llama"            # config.json model_type
    norm_eps: float = 1e-5           # Llama 3's
    tied: bool = False               # output layer = word embedding
    qkv_bias: bool = False           # Qwen2's q/k/v biases
    rope_theta: float = 10000.0
    vocab_size: int | None = None    # the checkpoint's embedding rows
    hf_config: object | None = None  # the checkpoint's config (the export writes it back)


def llama_settings(cfg: RunConfig) -> LlamaSettings:
    """Random weights: Llama 3's choices with model.rope_theta; model.init_from_hf: the
    checkpoint's (read once per process: the export at the end needs no directory)."""
    m = cfg.model
    if not m.init_from_hf:
        return LlamaSettings(rope_theta=float(m.rope_theta))
    return _checkpoint_settings(str(m.init_from_hf))


@functools.lru_cache(maxsize=None)
def _checkpoint_settings(directory: str) -> LlamaSettings:
    hf = read_config(directory)
    return LlamaSettings(family=hf.model_type, norm_eps=float(hf.rms_norm_eps),
                         tied=bool(hf.tie_word_embeddings), qkv_bias=hf.model_type == "qwen2",
                         rope_theta=float(rotary(hf)["rope_theta"]), vocab_size=hf.vocab_size,
                         hf_config=hf)


def _transformers_class(family: str, suffix: str):
    import transformers

    return getattr(transformers, FAMILIES[family] + suffix)


def read_config(directory: str):
    """The checkpoint's config (config.json only, never the network); a missing directory or
    another architecture is refused."""
    path, model_type = checkpoint_model_type(directory, "Llama, Mistral or Qwen2")
    if model_type not in FAMILIES:
        other = " or model=megatron_gpt" if model_type == "gpt2" else ""
        raise InputError(f"model.init_from_hf={directory} is a Hugging Face {model_type} "
                         f"checkpoint (config.json model_type={model_type!r}); "
                         f"model=megatron_llama starts from {', '.join(sorted(FAMILIES))} "
                         f"checkpoints: give one of those{other}, or train this one as it is "
                         f"with model=hf model.name_or_path={directory}")
    return _transformers_class(model_type, "Config").from_pretrained(str(path),
                                                                     local_files_only=True)


def rotary(hf) -> dict:
    """The checkpoint's rotary settings, {"rope_type", "rope_theta", ...} (transformers 5's
    rope_parameters; the rope_theta and rope_scaling of older configs)."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        return {"rope_type": "default", **params}
    scaling = dict(getattr(hf, "rope_scaling", None) or {})
    return {"rope_theta": getattr(hf, "rope_theta", 10000.0),
            "rope_type": scaling.pop("rope_type", scaling.pop("type", "default")), **scaling}


def _rotary_key(directory: str) -> str:
    """The config.json key that holds the rotary scaling, as the user's file spells it."""
    try:
        raw = json.loads((Path(directory).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"


def check_checkpoint(cfg: RunConfig, vocab_size: int) -> None:
    """Every way model.init_from_hf differs from the run or asks for what megatron_llama does
    not compute, refused at once (one sentence per key, with what to do)."""
    m, directory = cfg.model, str(cfg.model.init_from_hf)
    hf = llama_settings(cfg).hf_config
    rope = rotary(hf)
    theirs = {**hf.to_dict(), "num_key_value_heads": hf.num_key_value_heads
              or hf.num_attention_heads, "rope_theta": float(rope["rope_theta"])}
    ours = {"num_key_value_heads": m.num_key_value_heads or m.num_attention_heads,
            "rope_theta": float(m.rope_theta)}
    problems = [f"model.{field}={ours.get(field, getattr(m, field))} but {directory} has "
                f"{hf_field}={theirs[hf_field]}: set model.{field}={theirs[hf_field]}"
                for field, hf_field in SHAPE_FIELDS
                if ours.get(field, getattr(m, field)) != theirs[hf_field]]
    if hf.vocab_size < vocab_size:
        problems.append(f"the tokenizer has {vocab_size} ids but {directory} has vocab_size="
                        f"{hf.vocab_size}: ids from {hf.vocab_size} on would have no trained "
                        f"embedding; use the checkpoint's tokenizer (model.tokenizer_type="
                        f"HuggingFaceTokenizer model.tokenizer={directory})")
    if hf.hidden_act != "silu":
        problems.append(f"{directory} has hidden_act={hf.hidden_act!r}: megatron_llama's MLP is "
                        f"SwiGLU with SiLU; start from a checkpoint with hidden_act='silu'")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            problems.append(f"{directory} has {key}=True: megatron_llama has no biases (but "
                            f"Qwen2's on q/k/v); start from a checkpoint with {key}=false")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim and head_dim * hf.num_attention_heads != hf.hidden_size:
        problems.append(f"{directory} has head_dim={head_dim}, not hidden_size / "
                        f"num_attention_heads ({hf.hidden_size // hf.num_attention_heads}): "
                        f"megatron_llama's heads split the hidden size; start from a checkpoint "
                        f"whose head_dim is hidden_size / num_attention_heads")
    if rope["rope_type"] not in ROTARY_TYPES:
        problems.append(f"{directory} has {_rotary_key(directory)} of rope_type="
                        f"{rope['rope_type']!r}: megatron_llama computes the rotary types "
                        f"{', '.join(ROTARY_TYPES)} (fixed frequencies, attention not "
                        f"rescaled); start from a checkpoint with one of those, or train it as "
                        f"it is with model=hf model.name_or_path={directory}")
    window = _sliding_window(hf)
    if window is not None and window < cfg.data.max_seq_length:
        problems.append(f"{directory} has sliding_window={window} (each token attends to the "
                        f"last {window} only) but data.max_seq_length={cfg.data.max_seq_length}: "
                        f"megatron_llama attends to every earlier token, the same only up to "
                        f"the window; set data.max_seq_length<={window}")
    if problems:
        raise ConfigError([f"model.init_from_hf: {problem}" for problem in problems])


def _sliding_window(hf) -> int | None:
    """The attention window of the checkpoint's layers that have one (None: every layer
    attends to every earlier token)."""
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return None
    types = getattr(hf, "layer_types", None)
    if hf.model_type == "qwen2" and (not getattr(hf, "use_sliding_window", False) or
                                     (types and "sliding_attention" not in types)):
        return None
    return int(window)


def scale_rotary(model, settings: LlamaSettings) -> None:
    """The checkpoint's rotary scaling (Llama 3's, or linear) on megatron-core's inverse
    frequencies, computed by transformers' own function so that they are the checkpoint's."""
    hf = settings.hf_config
    if hf is None or rotary(hf)["rope_type"] == "default" or \
            not hasattr(model, "rotary_pos_emb"):
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rotary(hf)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    if not math.isclose(attention_factor, 1.0):  # refused by check_checkpoint first
        raise InputError(f"rotary type {rope['rope_type']!r} rescales attention; "
                         f"megatron_llama does not")
    current = model.rotary_pos_emb.inv_freq
    model.rotary_pos_emb.inv_freq = inv_freq.to(current.device, current.dtype)


# --- Hugging Face tensors -> megatron-core's ---------------------------------------------------
class _CheckpointTensors:
    """The checkpoint's tensors by Hugging Face name, each read when asked: from safetensors
    files, only that tensor (a rank reads only its own stage's layers); otherwise (.bin files)
    the model loaded once by transformers."""

    def __init__(self, directory: str, family: str):
        from rapidformer.models.megatron_import import unreadable, unreadable_errors

        self.directory = directory
        path = Path(directory).expanduser()
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        self._loaded: dict | None = None
        try:
            if index.is_file():
                self.files = {name: path / file for name, file
                              in json.loads(index.read_text())["weight_map"].items()}
            elif single.is_file():
                from safetensors import safe_open

                with safe_open(str(single), "pt") as handle:
                    self.files = dict.fromkeys(handle.keys(), single)
            else:
                model_class = _transformers_class(family, "ForCausalLM")
                with torch.random.fork_rng(devices=[]):  # its random init: not the run's streams
                    model = model_class.from_pretrained(str(path), local_files_only=True,
                                                        dtype=torch.float32)
                self._loaded = dict(model.state_dict())
                self.files = dict.fromkeys(self._loaded)
        # KeyError, TypeError, AttributeError: an index whose weight_map is missing or is not
        # a mapping of names to file names
        except (*unreadable_errors(), KeyError, TypeError, AttributeError) as error:
            raise unreadable(directory, error) from error

    def names(self) -> set:
        return set(self.files)

    def __call__(self, name: str) -> torch.Tensor:
        if self._loaded is not None:
            return self._loaded[name].float()
        from safetensors import safe_open

        from rapidformer.models.megatron_import import unreadable, unreadable_errors

        try:
            with safe_open(str(self.files[name]), "pt") as handle:
                return handle.get_tensor(name).float()
        except unreadable_errors() as error:
            raise unreadable(self.directory, error) from error


class LazyState(Mapping):
    """{megatron-core global name: full tensor}, each tensor made when asked."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]):
        self._makers = makers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             groups: int) -> torch.Tensor:
    """q [heads x d, ...], k and v [groups x d, ...] -> megatron-core's [group][q.., k, v][d]
    rows (weights or biases)."""
    rest = q.shape[1:]
    d = q.shape[0] // heads
    return torch.cat([q.reshape(groups, heads // groups * d, *rest),
                      k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple:
    """fuse_qkv undone: (q, k, v)."""
    rest = qkv.shape[1:]
    per = heads // groups
    grouped = qkv.reshape(groups, per + 2, -1, *rest)
    d = grouped.shape[2]
    return (grouped[:, :per].reshape(heads * d, *rest), grouped[:, per].reshape(groups * d, *rest),
            grouped[:, per + 1].reshape(groups * d, *rest))


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary's padding rows belong to no token: zero, as they come back in export."""
    out = tensor.new_zeros(rows, *tensor.shape[1:])
    out[:tensor.shape[0]] = tensor
    return out


def megatron_state(tensors, settings: LlamaSettings, num_layers: int, heads: int,
                   groups: int, padded_vocab: int) -> tuple[LazyState, set]:
    """(the megatron-core global state, each tensor made when asked; the Hugging Face names it
    reads). `tensors(name)` reads one checkpoint tensor."""
    makers: dict[str, Callable] = {}
    read: set = set()

    def take(*names):
        read.update(names)
        return names

    def add(name, names, make=lambda t: t):
        names = take(*names)
        makers[name] = lambda: make(*(tensors(n) for n in names))

    add("embedding.word_embeddings.weight", ["model.embed_tokens.weight"],
        lambda t: _padded(t, padded_vocab))
    add("decoder.final_layernorm.weight", ["model.norm.weight"])
    if not settings.tied:
        add("output_layer.weight", ["lm_head.weight"], lambda t: _padded(t, padded_vocab))
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        add(dst + "input_layernorm.weight", [src + "input_layernorm.weight"])
        add(dst + "self_attention.linear_qkv.weight",
            [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
            lambda q, k, v: fuse_qkv(q, k, v, heads, groups))
        if settings.qkv_bias:
            add(dst + "self_attention.linear_qkv.bias",
                [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"],
                lambda q, k, v: fuse_qkv(q, k, v, heads, groups))
        add(dst + "self_attention.linear_proj.weight", [attn + "o_proj.weight"])
        add(dst + "pre_mlp_layernorm.weight", [src + "post_attention_layernorm.weight"])
        add(dst + "mlp.linear_fc1.weight", [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"],
            lambda gate, up: torch.cat([gate, up], 0))
        add(dst + "mlp.linear_fc2.weight", [src + "mlp.down_proj.weight"])
    return LazyState(makers), read


def load_weights(model: torch.nn.Module, cfg: RunConfig, padded_vocab: int) -> int:
    """model.init_from_hf's weights in this rank's parameters (collective over every rank);
    the number of values copied here. A tensor the mapping needs that the checkpoint lacks, or
    one it has that nothing takes, is refused before anything is copied."""
    from rapidformer.models.megatron_shards import load_global_state

    m, settings = cfg.model, llama_settings(cfg)
    directory = str(m.init_from_hf)
    tensors = _CheckpointTensors(directory, settings.family)
    state, read = megatron_state(tensors, settings, m.num_layers, m.num_attention_heads,
                                 m.num_key_value_heads or m.num_attention_heads, padded_vocab)
    present = tensors.names()
    missing = sorted(read - present)
    # a tied checkpoint may keep lm_head.weight beside the embedding it equals
    left_over = sorted(name for name in present - read if not NOT_IMPORTED.search(name)
                       and not (settings.tied and name == "lm_head.weight"))
    problems = ([f"tensors the model needs are not in it: {missing}"] if missing else []) + \
        ([f"tensors with no megatron-core counterpart: {left_over}"] if left_over else [])
    if problems:
        raise InputError(f"model.init_from_hf={directory} ({settings.family}): "
                         f"{'; '.join(problems)}")
    return load_global_state(model, state, m.num_layers,
                             f"model.init_from_hf={directory}: the {settings.family} weights do "
                             f"not fit the megatron-core model")


# --- megatron-core's gathered weights -> the Hugging Face class ---------------------------------
def hf_config(cfg: RunConfig, padded_vocab: int, tokenizer_eod: int | None):
    """The export's config: the checkpoint's own after model.init_from_hf, else a LlamaConfig
    of the run's shape (its padded vocabulary, Llama 3's norm epsilon, untied)."""
    settings = llama_settings(cfg)
    if settings.hf_config is not None:
        return copy.deepcopy(settings.hf_config)
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(vocab_size=padded_vocab, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                       num_attention_heads=m.num_attention_heads,
                       num_key_value_heads=m.num_key_value_heads or m.num_attention_heads,
                       head_dim=m.hidden_size // m.num_attention_heads, hidden_act="silu",
                       max_position_embeddings=m.max_position_embeddings,
                       rms_norm_eps=settings.norm_eps, initializer_range=m.initializer_range,
                       rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta},
                       attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                       attention_dropout=m.attention_dropout, bos_token_id=tokenizer_eod,
                       eos_token_id=tokenizer_eod, pad_token_id=None)


def hf_state(full: dict, cfg: RunConfig, vocab: int) -> dict:
    """{Hugging Face name: tensor} of the gathered megatron-core weights: megatron_state read
    backwards, the vocabulary cut to `vocab` rows."""
    m, settings = cfg.model, llama_settings(cfg)
    heads, groups = m.num_attention_heads, m.num_key_value_heads or m.num_attention_heads
    state = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:vocab],
             "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if not settings.tied:
        state["lm_head.weight"] = full["output_layer.weight"][:vocab]
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        q, k, v = split_qkv(full[src + "self_attention.linear_qkv.weight"], heads, groups)
        state.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k,
                      attn + "v_proj.weight": v})
        if settings.qkv_bias:
            q, k, v = split_qkv(full[src + "self_attention.linear_qkv.bias"], heads, groups)
            state.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k,
                          attn + "v_proj.bias": v})
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2, 0)
        state.update({
            dst + "input_layernorm.weight": full[src + "input_layernorm.weight"],
            attn + "o_proj.weight": full[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": full[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": full[src + "mlp.linear_fc2.weight"]})
    return state


def to_hf_llama(full: dict, cfg: RunConfig, tokenizer_eod: int | None):
    """The Hugging Face causal LM (LlamaForCausalLM, or the checkpoint's class) holding the
    gathered megatron-core weights; its vocabulary the checkpoint's size (the run's padded size
    for random weights)."""
    padded = full["embedding.word_embeddings.weight"].shape[0]
    config = hf_config(cfg, padded, tokenizer_eod)
    state = hf_state(full, cfg, config.vocab_size)
    with torch.random.fork_rng(devices=[]):  # its random init leaves the run's streams alone
        model = _transformers_class(config.model_type, "ForCausalLM")(config)
    missing, unexpected = model.load_state_dict(
        {name: tensor.contiguous() for name, tensor in state.items()}, strict=False)
    missing = [name for name in missing
               if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"megatron_llama -> {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float()
