"""A pretrained model's shape is its own: the model group's shape keys, where set (the seed's
`--num-layers 12 --hidden-size 768 ...` beside `--pretrained-model-name-or-path`), must equal
the checkpoint's config, else the run is refused — never silently ignored."""
from __future__ import annotations

from rapidformer.config.schema import ModelConfig
from rapidformer.errors import ConfigError

# model.<key> -> the names Hugging Face configs use for it, by family
CONFIG_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner", "d_ff"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "vocab_size": ("vocab_size",),
}


def _value(config, names: tuple[str, ...]):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def shape_problems(m: ModelConfig, config) -> list[str]:
    """The set shape keys that differ from the pretrained `config` (a transformers config)."""
    problems = []
    for key, names in CONFIG_NAMES.items():
        given = getattr(m, key)
        own = _value(config, names)
        if given is None or own is None or given == own:
            continue
        problems.append(
            f"model.{key}={given}, but the pretrained model {m.name_or_path} has {own}: a "
            f"pretrained model keeps its own shape; drop the override (or the seed flag), set "
            f"model.{key}={own}, or build a model of that shape from a config (e.g. "
            f"model=bert_base)")
    return problems


def check_shape(m: ModelConfig, config) -> None:
    problems = shape_problems(m, config)
    if problems:
        raise ConfigError(problems)


def local_config(m: ModelConfig):
    """A pretrained model's transformers config where its config.json is on this machine (a
    local directory or the Hugging Face cache), else None: nothing is downloaded."""
    if m.source != "pretrained" or not m.name_or_path:
        return None
    from transformers import AutoConfig

    try:  # a model with its own code is not run (nor asked about) to read its config
        return AutoConfig.from_pretrained(m.name_or_path, local_files_only=True,
                                          trust_remote_code=False)
    except (OSError, ValueError):
        return None


# model types whose positions are learned embeddings, a table of a fixed length: a longer
# sequence has no position to read (models with rotary or relative positions have no such
# limit). The number: positions the table keeps for itself (RoBERTa's start after its padding id)
LEARNED_POSITIONS = {"bert": 0, "distilbert": 0, "electra": 0, "albert": 0, "megatron-bert": 0,
                     "ernie": 0, "mobilebert": 0, "gpt2": 0, "gpt_neo": 0, "opt": 0, "bart": 0,
                     "mbart": 0, "roberta": 2, "xlm-roberta": 2, "camembert": 2,
                     "longformer": 2}


def position_problem(m: ModelConfig, config, max_seq_length: int) -> str | None:
    """data.max_seq_length beyond the positions a pretrained model has learned."""
    reserved = LEARNED_POSITIONS.get(getattr(config, "model_type", None))
    table = _value(config, CONFIG_NAMES["max_position_embeddings"])
    if reserved is None or table is None or max_seq_length <= table - reserved:
        return None
    return (f"data.max_seq_length={max_seq_length} is longer than the {table - reserved} "
            f"positions the pretrained model {m.name_or_path} ({config.model_type}) has learned "
            f"(max_position_embeddings in its config.json); set data.max_seq_length="
            f"{table - reserved} or less")


def new_token_room(config, prompt_length: int, wanted: int) -> int:
    """How many tokens a generation may add after a prompt of `prompt_length` tokens: `wanted`,
    or fewer where the model's learned positions end sooner (GPT-2's 1,024)."""
    reserved = LEARNED_POSITIONS.get(getattr(config, "model_type", None))
    table = _value(config, CONFIG_NAMES["max_position_embeddings"])
    if reserved is None or table is None:
        return wanted
    return max(0, min(wanted, table - reserved - prompt_length))


def check_local_shape(m: ModelConfig, max_seq_length: int | None = None) -> None:
    """Before the run starts: the check (and the sequence length against the model's learned
    positions), where the model's config.json is on this machine. Elsewhere the shape check
    runs when the model loads."""
    if all(getattr(m, key) is None for key in CONFIG_NAMES) and max_seq_length is None:
        return
    config = local_config(m)
    if config is None:
        return
    problems = shape_problems(m, config)
    if max_seq_length is not None and (problem := position_problem(m, config, max_seq_length)):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)


def known_model_type(m: ModelConfig) -> str | None:
    """The Hugging Face model type the run will build, known before it builds it: a
    config-built model's arch, a pretrained one's config.json where it is on this machine;
    None where only loading the model would tell (or for megatron-core models)."""
    if m.source == "config":
        return None if m.is_megatron or m.arch == "auto" else m.arch
    try:
        model_type = getattr(local_config(m), "model_type", None)
    except Exception:  # noqa: BLE001 - a config.json transformers cannot read: loading the
        return None  # model reports it, where the run needs it
    return model_type if isinstance(model_type, str) else None
