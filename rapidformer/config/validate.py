"""Check a composed config against the schemas and turn it into a typed `RunConfig`.

Every problem is collected before anything is reported, so a user fixes them in one go:
unknown keys (with the closest valid name), wrong types, impossible values and incompatible
settings. Nothing here touches the disk, a device or the network.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Literal, Union

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError


def closest(name: str, choices) -> str | None:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_message(path: str, key: str, valid) -> str:
    hint = closest(key, valid)
    where = f"{path}.{key}" if path else key
    if hint:
        full = f"{path}.{hint}" if path else hint
        return f"{where}: unknown key; did you mean '{full}'?"
    return f"{where}: unknown key; valid keys here: {', '.join(sorted(valid))}"


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin is list:
        item, = typing.get_args(tp) or (Any,)
        return f"a list of {_describe(item).removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp) -> tuple[bool, Any]:
    """(ok, value converted to tp). Accepts an int where a float is expected, nothing looser."""
    origin = typing.get_origin(tp)
    if origin is Union:
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            ok, converted = _coerce(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return (value in typing.get_args(tp) and not isinstance(value, bool)), value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        item, = typing.get_args(tp) or (Any,)
        converted = [_coerce(v, item) for v in value]
        return all(ok for ok, _ in converted), [v for _, v in converted]
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return math.isfinite(float(value)), float(value)
        return False, value
    if tp is dict:
        return isinstance(value, dict), value
    if tp is str:
        # YAML turns `mrpc` into a str but `1.0` into a float: a str field takes plain scalars
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, value
    return True, value


def _build(cls, raw: Any, path: str, problems: list[str]):
    if not isinstance(raw, dict):
        problems.append(f"{path or 'config'}: expected a mapping of keys, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            problems.append(unknown_key_message(path, str(key), fields))
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        where = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw[name], where, problems)
            continue
        ok, converted = _coerce(raw[name], tp)
        if not ok:
            problems.append(f"{where}: expected {_describe(tp)}, got {raw[name]!r}")
            continue
        values[name] = converted
    return cls(**values)


def build_run_config(raw: dict) -> RunConfig:
    """Typed config from a resolved plain dict; raises ConfigError listing every problem."""
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    if not problems:
        from rapidformer.config.sizes import fill

        fill(cfg)  # nproc_per_node=auto and global_batch_size=null become numbers
        problems.extend(check_values(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def world_size(cfg: RunConfig) -> int:
    return cfg.launcher.nproc_per_node * cfg.launcher.nnodes


def data_parallel_size(cfg: RunConfig) -> int:
    model_parallel = cfg.parallelism.tensor_model_parallel_size * cfg.parallelism.pipeline_model_parallel_size
    return max(world_size(cfg) // max(model_parallel, 1), 1)  # sizes below 1 are reported


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a number in the config may take: from `low` to `high` (an end left out is
    open-ended; each given end is included unless it is `*_open`), and null where `null` says
    what null does. `example` is the value the message suggests; `note` says what the ends mean."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: str | None = None
    example: str = ""
    note: str = ""

    def holds(self, value) -> bool:
        if value is None:
            return self.null is not None
        if isinstance(value, (str, list)):  # a key's named or listed values: checked by name
            return True
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (value == self.high and not self.high_open)

    def phrase(self, integer: bool) -> str:
        """What the value must be, as in `... must be in [0, 1)`."""
        low, high = (_number(v) for v in (self.low, self.high))
        if self.high is not None and self.low is not None:
            return (f"be in {'(' if self.low_open else '['}{low}, {high}"
                    f"{')' if self.high_open else ']'}")
        if self.high is not None:
            return f"be below {high}" if self.high_open else f"be at most {high}"
        if self.low == 0:
            return "be positive" if self.low_open else "not be negative"
        if self.low == 1 and integer and not self.low_open:
            return "be a positive integer"
        return f"be above {low}" if self.low_open else f"be at least {low}"


def _number(value) -> str:
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else str(value)


PRETRAINED_OWN = "a pretrained model's own (model.source=pretrained)"
# the architecture keys a config-built model is made from (null only with a pretrained model)
SHAPE_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings", "vocab_size")

# every number of the schema that has a valid range, checked before anything runs (the ones
# checked against other keys are data.max_seq_length, launcher.node_rank and, for
# question_answering, task.doc_stride; data.synthetic_seed takes any integer)
BOUNDS: dict[str, Bound] = {
    "task.num_labels": Bound(2, null="inferred from the training labels", example="2"),
    "task.doc_stride": Bound(1, example="32"),
    "task.max_answer_length": Bound(1, example="30"),
    "task.n_best_size": Bound(1, example="20"),
    "task.max_target_length": Bound(1, example="64"),
    "task.num_beams": Bound(1, example="4"),
    "task.sample_generations": Bound(0, example="4", note="0: no sample generations"),
    "task.max_new_tokens": Bound(1, example="64"),
    "peft.r": Bound(1, example="8", note="the adapters' rank"),
    "peft.alpha": Bound(0, low_open=True, example="16", note="the adapters' scale is alpha / r"),
    "peft.dropout": Bound(0, 1, high_open=True, example="0.05",
                          note="a probability; 0 turns it off"),
    "model.hidden_size": Bound(1, null=PRETRAINED_OWN, example="768"),
    "model.num_layers": Bound(1, null=PRETRAINED_OWN, example="12"),
    "model.num_attention_heads": Bound(1, null=PRETRAINED_OWN, example="12"),
    "model.num_key_value_heads": Bound(1, null="one per attention head", example="8"),
    "model.rope_theta": Bound(0, low_open=True, example="500000"),
    "model.intermediate_size": Bound(1, null=PRETRAINED_OWN, example="3072"),
    "model.max_position_embeddings": Bound(1, null=PRETRAINED_OWN, example="512"),
    "model.vocab_size": Bound(1, null=PRETRAINED_OWN, example="30522"),
    "model.hidden_dropout": Bound(0, 1, high_open=True, example="0.1",
                                  note="a probability; 0 turns dropout off"),
    "model.attention_dropout": Bound(0, 1, high_open=True, example="0.1",
                                     note="a probability; 0 turns dropout off"),
    "model.initializer_range": Bound(0, low_open=True, example="0.02",
                                     note="the standard deviation of the initial weights"),
    "data.num_workers": Bound(0, example="2", note="0 loads batches in the training process"),
    "data.mask_prob": Bound(0, 1, low_open=True, high_open=True, example="0.15",
                            note="the share of tokens masked"),
    "data.short_seq_prob": Bound(0, 1, example="0.1",
                                 note="a probability: how often a sample is made shorter"),
    "data.synthetic_train_size": Bound(1, example="4000"),
    "data.synthetic_eval_size": Bound(1, example="400"),
    "precision.initial_scale": Bound(0, low_open=True, example="65536",
                                     note="fp16's first loss scale"),
    "precision.growth_interval": Bound(1, example="2000"),
    "memory.device_memory_gb": Bound(0, low_open=True, null="the detected GPU's memory",
                                     example="80"),
    "parallelism.tensor_model_parallel_size": Bound(1, example="1"),
    "parallelism.pipeline_model_parallel_size": Bound(1, example="1"),
    "parallelism.ddp_bucket_cap_mb": Bound(1, example="25"),
    "optim.beta1": Bound(0, 1, high_open=True, example="0.9",
                         note="AdamW's decay rate of the gradient average"),
    "optim.beta2": Bound(0, 1, high_open=True, example="0.999",
                         note="AdamW's decay rate of the squared-gradient average"),
    "optim.eps": Bound(0, low_open=True, example="1e-8",
                       note="added to AdamW's denominator"),
    "scheduler.warmup_iters": Bound(0, example="100"),
    "scheduler.warmup_fraction": Bound(0, 1, high_open=True, null="scheduler.warmup_iters decides",
                                       example="0.06", note="a share of the iterations"),
    "scheduler.min_lr": Bound(0, example="0.0"),
    "scheduler.decay_iters": Bound(1, null="decay until the last iteration", example="2000"),
    "trainer.epochs": Bound(1, null="trainer.train_iters decides", example="3"),
    "trainer.train_iters": Bound(1, null="trainer.epochs decides", example="1000"),
    "trainer.micro_batch_size": Bound(1, example="16"),
    "trainer.global_batch_size": Bound(1, null="trainer.micro_batch_size x data-parallel size",
                                       example="64"),
    "trainer.lr": Bound(0, example="2e-5", note="a typical fine-tuning lr is 2e-5"),
    "trainer.weight_decay": Bound(0, example="0.01"),
    "trainer.clip_grad": Bound(0, example="1.0", note="0 disables clipping"),
    "trainer.seed": Bound(0, 2**32 - 1, example="42", note="numpy's seed range"),
    "trainer.log_interval": Bound(1, example="10"),
    "trainer.eval_interval": Bound(1, null="evaluate at the end of every epoch", example="100"),
    "trainer.eval_iters": Bound(0, example="10", note="0: no evaluation"),
    "trainer.save_interval": Bound(1, null="save at the end of every epoch", example="1000"),
    "trainer.exit_interval": Bound(1, null="never stop early", example="1000"),
    "trainer.keep_last": Bound(0, example="2", note="0 keeps every checkpoint"),
    "trainer.early_stopping_patience": Bound(1, null="train to the end", example="3",
                                             note="evaluations without improvement"),
    "trainer.early_stopping_min_delta": Bound(0, example="0.001",
                                              note="the least change that is an improvement"),
    "trainer.max_nonfinite_steps": Bound(1, null="never stop on a non-finite loss", example="5"),
    "trainer.grad_norm_spike_factor": Bound(1, low_open=True, null="no spike warnings",
                                            example="10",
                                            note="a window max this many times the recent median"),
    "launcher.nproc_per_node": Bound(1, example="1"),
    "data.pad_to": Bound(1, example="16"),
    "launcher.nnodes": Bound(1, example="1"),
    "launcher.master_port": Bound(1, 65535, example="6010", note="a TCP port"),
    "launcher.rendezvous_timeout": Bound(1, example="300", note="seconds"),
    "launcher.collective_timeout": Bound(1, example="600", note="seconds"),
    "launcher.max_restarts": Bound(0, example="3", note="0: a failed worker ends the job"),
}

# the shortest data.max_seq_length: the special tokens of the longest framing below (3) and at
# least a token of each text, with room left (question answering also needs the question and
# task.doc_stride tokens of overlap); below it a tokenizer cannot cut a text to fit and leaves
# it whole, so samples come out longer than the limit (and than the position embeddings)
MIN_SEQ_LENGTH = 8
SAMPLE_LAYOUTS = {
    "sequence_classification": "[CLS] text [SEP]",
    "token_classification": "[CLS] words [SEP]",
    "question_answering": "[CLS] question [SEP] context [SEP]",
    "masked_lm": "[CLS] text [SEP]",
    "seq2seq_lm": "task.source_prefix + document + </s>",
    "bert_pretraining": "[CLS] segment A [SEP] segment B [SEP]",
    "causal_lm": "a window of tokens, each predicting the next",
}
# a question-answering window: [CLS] question [SEP] context [SEP] holds 3 special tokens, at least
# one token of question and task.doc_stride tokens of overlap plus one new token of context
QA_WINDOW_EXTRA = 4


def _field_type(path: str):
    cls = RunConfig
    for part in path.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def value_at(cfg: RunConfig, path: str):
    """The value of a dotted key ("optim.beta1") of a typed config."""
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def schema_default(path: str):
    """The schema's default of a dotted key ("memory.offload_optimizer")."""
    cls, spec = RunConfig, None
    for part in path.split("."):
        spec = {f.name: f for f in dataclasses.fields(cls)}[part]
        cls = typing.get_type_hints(cls)[part]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def bound_problem(key: str, value, bound: Bound) -> str | None:
    """The message for a value outside its bound (None when it is inside)."""
    if bound.holds(value):
        return None
    integer = int in (_field_type(key), *typing.get_args(_field_type(key)))
    text = f"{key}={value} must {bound.phrase(integer)}"
    if bound.note:
        text += f" ({bound.note})"
    if bound.null is not None:
        text += f" or null ({bound.null})"
    return text + f"; set e.g. {key}={bound.example}"


def range_problems(cfg: RunConfig) -> list[str]:
    """Every number outside its valid range, and data.max_seq_length too short for its task."""
    p = [problem for key, bound in BOUNDS.items()
         if (problem := bound_problem(key, value_at(cfg, key), bound))]
    d, m, task = cfg.data, cfg.model, cfg.task.name
    if d.max_seq_length < MIN_SEQ_LENGTH:
        layout = SAMPLE_LAYOUTS[task]
        if task == "sequence_classification" and d.text_b_column:
            layout = "[CLS] text_a [SEP] text_b [SEP]"
        example = 128 if m.source != "config" or m.max_position_embeddings < MIN_SEQ_LENGTH \
            else min(128, m.max_position_embeddings)
        p.append(f"data.max_seq_length={d.max_seq_length} must be at least {MIN_SEQ_LENGTH}: a "
                 f"task={task} sample is {layout}, and a limit with no room for its special "
                 f"tokens and some text of each part is not applied (the tokenizer leaves the "
                 f"text whole, longer than the limit); set e.g. data.max_seq_length={example}")
    return p


def _divisor_below(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


def check_values(cfg: RunConfig) -> list[str]:
    """Impossible values and incompatible settings; each message names the key(s) and a fix."""
    m = cfg.model
    unset = [k for k in SHAPE_KEYS if getattr(m, k) is None]
    if m.source == "config" and unset:  # the checks below do arithmetic on the shape
        return [f"model.{k} is null, but model={m.name} is built from its config "
                f"(model.source=config): set it, e.g. model.{k}={BOUNDS['model.' + k].example}"
                for k in unset]
    p: list[str] = range_problems(cfg)
    t, s, m, d = cfg.trainer, cfg.scheduler, cfg.model, cfg.data

    if t.epochs is None and t.train_iters is None:
        p.append("trainer.epochs and trainer.train_iters are both null; set one of them, "
                 "e.g. trainer.epochs=3")
    if t.micro_batch_size >= 1 and t.global_batch_size is not None and t.global_batch_size >= 1:
        step = t.micro_batch_size * data_parallel_size(cfg)
        if t.global_batch_size % step:
            dp = data_parallel_size(cfg)
            suggestion = max(step, round(t.global_batch_size / step) * step)
            p.append(
                f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
                f"trainer.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp}) = "
                f"{step}; set it to a multiple, e.g. trainer.global_batch_size={suggestion}")

    if 0 <= t.lr < s.min_lr:
        p.append(f"scheduler.min_lr={s.min_lr} is above trainer.lr={t.lr}; lower min_lr")

    if m.source == "pretrained" and not m.name_or_path:
        p.append("model.name_or_path is empty but model.source=pretrained; give a hub name or a "
                 "local directory, e.g. model.name_or_path=bert-base-cased")
    if m.source == "config" and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        p.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                 f"model.num_attention_heads={m.num_attention_heads}")
    if m.source == "config" and m.arch == "llama" and m.hidden_dropout:
        p.append(f"model.hidden_dropout={m.hidden_dropout}: a Llama-shaped model has no hidden "
                 f"dropout (only model.attention_dropout); set model.hidden_dropout=0")
    kv = m.num_key_value_heads
    if m.source == "config" and kv is not None and m.arch != "llama":
        p.append(f"model.num_key_value_heads={kv} with model.arch={m.arch}: only a Llama-shaped "
                 f"model has grouped-query attention here; drop the key or use model=llama_tiny "
                 f"/ llama_1b")
    if m.source == "config" and kv is not None and kv >= 1 and m.num_attention_heads % kv:
        p.append(f"model.num_key_value_heads={kv} does not divide "
                 f"model.num_attention_heads={m.num_attention_heads}: each key/value head serves "
                 f"a whole group of query heads; pick a divisor, e.g. "
                 f"model.num_key_value_heads={_divisor_below(m.num_attention_heads, kv)}")
    if cfg.task.name == "sft" and (m.arch.startswith("megatron") or
                                   (m.source == "config" and m.arch not in ("llama", "gpt2"))):
        p.append(f"task=sft fine-tunes a Hugging Face causal LM; model={m.name} (model.arch="
                 f"{m.arch}) is not one: use model=llama_tiny, model=gpt2_tiny, or a pretrained "
                 f"decoder with model=hf model.name_or_path=DIR")
    if d.packing and cfg.task.name != "sft":
        p.append(f"data.packing=true packs examples for task=sft; task={cfg.task.name} does not "
                 f"pack (BERT encoders train without padding with trainer.unpad=true)")
    if m.init_from_hf and m.arch != "megatron_gpt":
        p.append(f"model.init_from_hf={m.init_from_hf} with model.arch={m.arch}: only "
                 f"model=megatron_gpt starts from a Hugging Face GPT-2 checkpoint; use "
                 f"model=megatron_gpt, or load a Hugging Face model as it is with model=hf "
                 f"model.name_or_path={m.init_from_hf}")
    if m.source == "config" and d.max_seq_length > m.max_position_embeddings:
        p.append(f"data.max_seq_length={d.max_seq_length} is above "
                 f"model.max_position_embeddings={m.max_position_embeddings}; lower the first "
                 f"or raise the second")

    if d.source in ("local", "hub", "megatron") and not d.path:
        what = {"local": "a directory or file of local data", "hub": "a hub dataset name",
                "megatron": "the prefix rapidformer-preprocess-data printed (without .bin/.idx)"}
        p.append(f"data.path is empty but data.source={d.source}; set data.path to "
                 f"{what[d.source]}")
    p.extend(_best_problems(t))
    p.extend(_pretraining_problems(cfg))
    p.extend(_megatron_problems(cfg))
    p.extend(_task_problems(cfg))
    p.extend(_length_problems(cfg))
    p.extend(_fp8_problems(cfg))
    p.extend(_peft_problems(cfg))
    if cfg.kernels.name != "none" and (m.arch.startswith("megatron") or cfg.graph.name == "ort"):
        p.append(f"kernels={cfg.kernels.name} with "
                 f"{'model=' + m.name if m.arch.startswith('megatron') else 'graph=ort'}: its "
                 f"kernels patch Hugging Face models trained by torch; use kernels=none")
    steps = t.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        p.append(f"trainer.profile_steps={list(steps)}: give the first and the last training "
                 f"step to profile, 1 <= first <= last, e.g. trainer.profile_steps=[20,24] "
                 f"(after the compile and warm-up steps)")

    par = cfg.parallelism
    if par.sequence_parallel and (par.tensor_model_parallel_size < 2
                                  or not m.arch.startswith("megatron")):
        p.append(f"parallelism.sequence_parallel=true splits the sequence over tensor-parallel "
                 f"ranks: it needs a Megatron model with parallelism.tensor_model_parallel_size "
                 f">= 2 (this run: model={m.name}, {par.tensor_model_parallel_size})")
    if cfg.trainer.checkpoint_activations and cfg.trainer.recompute_granularity == "selective" \
            and not m.arch.startswith("megatron"):
        p.append(f"trainer.recompute_granularity=selective is megatron-core's; model={m.name} is a "
                 f"Hugging Face model, which recomputes whole layers: use "
                 f"trainer.recompute_granularity=full")
    if (par.tensor_model_parallel_size > 1 or par.pipeline_model_parallel_size > 1) \
            and not m.arch.startswith("megatron"):
        p.append(f"parallelism (tensor {par.tensor_model_parallel_size} x pipeline "
                 f"{par.pipeline_model_parallel_size}) needs a Megatron model, but model={m.name} "
                 f"is a Hugging Face model; use parallelism=dp or a Megatron model")
    if not 0 <= cfg.launcher.node_rank < max(cfg.launcher.nnodes, 1):
        p.append(f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, launcher.nnodes)")
    if par.tensor_model_parallel_size >= 1 and par.pipeline_model_parallel_size >= 1 and \
            world_size(cfg) % (par.tensor_model_parallel_size * par.pipeline_model_parallel_size):
        p.append(f"the world size ({world_size(cfg)}) is not divisible by tensor x pipeline "
                 f"parallel size ({par.tensor_model_parallel_size * par.pipeline_model_parallel_size})")
    if cfg.memory.name not in ("none", "auto") and cfg.graph.name == "compile" \
            and cfg.graph.scope == "model":
        p.append(f"graph.scope=model with memory={cfg.memory.name}: the whole-model compile "
                 f"wraps what {'FSDP2' if cfg.memory.name == 'fsdp' else 'DeepSpeed'} shards; "
                 f"use graph.scope=blocks (or auto, the default), which compiles each transformer block")
    if cfg.graph.mode and cfg.graph.mode not in COMPILE_MODES:
        modes = compile_modes()
        if cfg.graph.mode not in modes:
            hint = closest(cfg.graph.mode, modes)
            tip = f"did you mean graph.mode={hint}? " if hint else ""
            p.append(f"graph.mode={cfg.graph.mode} is not a torch.compile mode; {tip}choose one "
                     f"of {', '.join(modes)}, or graph.mode=null (torch's default)")
    if cfg.graph.mode and cfg.graph.options:
        p.append(f"graph.mode={cfg.graph.mode} with graph.options: torch.compile takes a mode or "
                 f"inductor options, not both; drop one (a mode is a named set of options)")
    if cfg.graph.name == "ort" and cfg.memory.name != "none":
        p.append(f"graph=ort with memory={cfg.memory.name}: not combined here. ORTModule exports "
                 f"the model once to one ONNX graph holding every full weight, while "
                 f"{'FSDP2' if cfg.memory.name == 'fsdp' else 'DeepSpeed ZeRO'} replaces the "
                 f"weights with shards gathered at each layer, which that graph never sees; "
                 f"onnxruntime-training 1.19.2 (its last release) trains on the CPU with torch "
                 f"2.4-2.6 only, where DDP (memory=none, several processes) is what runs. Use "
                 f"graph=ort with memory=none, or graph=compile with memory={cfg.memory.name} "
                 f"(docs/seed_flags.md)")
    if cfg.graph.name == "ort" and cfg.precision.name != "fp32":
        p.append(f"graph=ort with precision={cfg.precision.name}: not combined here. graph=ort "
                 f"runs on the CPU only (onnxruntime-training 1.19.2 with torch 2.4-2.6), whose "
                 f"ONNX Runtime training kernels are fp32, and the model's export to ONNX fails "
                 f"under autocast; use precision=fp32 with graph=ort, or graph=compile with "
                 f"precision={cfg.precision.name} (docs/seed_flags.md)")
    if not cfg.trainer.save_last and cfg.trainer.export_hf and cfg.memory.name in ("zero1", "zero2", "zero3") \
            and not m.arch.startswith("megatron"):
        p.append(f"trainer.save_last=false with trainer.export_hf=true and memory={cfg.memory.name}: "
                 f"the export reads DeepSpeed's final checkpoint; keep trainer.save_last=true or set "
                 f"trainer.export_hf=false")
    if cfg.memory.name == "fsdp" and (cfg.memory.offload_optimizer and not cfg.memory.offload_params):
        p.append("memory.offload_optimizer=true with memory=fsdp needs memory.offload_params=true "
                 "(FSDP offloads parameters and optimizer state together)")
    return p


PEFT_KEYS = ("r", "alpha", "dropout", "target_modules", "modules_to_save")
QLORA_KEYS = ("quant_type", "double_quant")


def _peft_problems(cfg: RunConfig) -> list[str]:
    """peft=lora/qlora: peft's adapters on Hugging Face models trained by torch, DeepSpeed or
    FSDP2; qlora's 4-bit base on one CUDA GPU per replica."""
    pe, m, p = cfg.peft, cfg.model, []
    what = f"peft={pe.name}"
    unread = [key for key in (PEFT_KEYS + QLORA_KEYS if pe.name == "none" else
                              QLORA_KEYS if pe.name == "lora" else ())
              if getattr(pe, key) != schema_default(f"peft.{key}")]
    for key in unread:
        used_by = "peft=qlora" if key in QLORA_KEYS else "peft=lora or qlora"
        p.append(f"peft.{key}={getattr(pe, key)} has no effect with {what}; it is used by "
                 f"{used_by}: choose it or drop the override")
    if pe.name == "none":
        return p
    if pe.target_modules is not None and not pe.target_modules:
        p.append("peft.target_modules=[] names no layer to adapt; name some (e.g. "
                 "peft.target_modules=[q_proj,v_proj]) or set it to null for the model family's "
                 "attention and MLP projections")
    if m.arch.startswith("megatron"):
        p.append(f"{what} with model={m.name}: peft's adapters wrap Hugging Face (torch.nn.Linear) "
                 f"layers, not megatron-core's tensor-parallel ones; use model=hf "
                 f"model.name_or_path=... (a Hugging Face checkpoint of the model), or peft=none")
    if cfg.graph.name == "ort":
        p.append(f"{what} with graph=ort: not combined here; onnxruntime-training runs in its own "
                 f"torch 2.4-2.6 environment, where peft's adapters and the adapter-only "
                 f"checkpoints are not built; use graph=eager or graph=compile with {what}")
    if cfg.precision.fp8_scaling is not None:
        p.append(f"{what} with precision=fp8: not combined here; torchao would convert the frozen "
                 f"base layers that peft wraps, a pairing not built or tested; use precision=bf16 "
                 f"with {what}")
    if cfg.kernels.name != "none":
        p.append(f"{what} with kernels={cfg.kernels.name}: not combined here; liger-kernel patches "
                 f"a Hugging Face model's own modules, and peft has wrapped them by then; use "
                 f"kernels=none with {what}")
    if cfg.trainer.unpad:
        p.append(f"{what} with trainer.unpad=true: not combined here; the unpadded path replaces "
                 f"BERT's forward, which peft's task wrappers do not pass its packed inputs to; "
                 f"set trainer.unpad=false")
    if pe.name == "qlora":
        p.extend(_qlora_problems(cfg))
    return p


def _qlora_problems(cfg: RunConfig) -> list[str]:
    """What bitsandbytes' 4-bit base weights rule out."""
    m, p = cfg.model, []
    if cfg.trainer.device == "cpu":
        p.append("peft=qlora with trainer.device=cpu: QLoRA is for CUDA GPUs, where bitsandbytes' "
                 "4-bit kernels keep the base in a quarter of its memory; on a CPU its 4-bit "
                 "matmul is a slow fallback computed in bf16 that saves no accelerator memory. "
                 "Use peft=lora on a CPU, or run on a CUDA GPU")
    if cfg.memory.name == "fsdp":
        p.append("peft=qlora with memory=fsdp: FSDP2's fully_shard turns each weight into a "
                 "plain sharded tensor, which drops the 4-bit quantization state "
                 "(bitsandbytes' Params4bit) that the 4-bit matmul reads; use peft=lora with "
                 "memory=fsdp, or peft=qlora with memory=none, zero1 or zero2")
    if cfg.memory.name == "zero3":
        p.append("peft=qlora with memory=zero3: ZeRO-3 partitions every weight, and bitsandbytes' "
                 "4-bit weights partition only when transformers quantizes them while DeepSpeed "
                 "builds the model (zero.Init inside from_pretrained), not when a built model is "
                 "quantized as here; use peft=lora with memory=zero3, or peft=qlora with "
                 "memory=none, zero1 or zero2")
    if m.source == "config" and m.arch == "gpt2":
        p.append(f"peft=qlora with model={m.name}: bitsandbytes quantizes torch.nn.Linear layers, "
                 f"and GPT-2's blocks are transformers' Conv1D layers; use peft=lora, or a "
                 f"Llama-shaped model (model=llama_tiny, llama_1b)")
    return p


def _fp8_problems(cfg: RunConfig) -> list[str]:
    """precision=fp8: torchao's float8 linear layers, in the torch strategies only."""
    pr, p = cfg.precision, []
    if pr.fp8_scaling is None:
        for key in ("fp8_all_gather", "fp8_emulate"):
            if getattr(pr, key):
                p.append(f"precision.{key}=true without precision=fp8 (precision="
                         f"{pr.name}): it applies to float8 training only; add precision=fp8 "
                         f"or drop it")
        return p
    if pr.dtype != "bf16":
        p.append(f"precision.fp8_scaling={pr.fp8_scaling} with precision.dtype={pr.dtype}: float8 "
                 f"linear layers run with bf16 autocast for the rest of the model; use "
                 f"precision=fp8 (dtype bf16)")
    if cfg.model.source == "config" and cfg.model.arch == "gpt2":
        p.append(f"precision=fp8 with model={cfg.model.name}: float8 converts torch.nn.Linear "
                 f"layers and GPT-2's blocks are transformers' Conv1D layers; use a Llama-shaped "
                 f"model (model=llama_tiny, llama_1b) or precision=bf16")
    if cfg.model.arch.startswith("megatron"):
        p.append(f"precision=fp8 with model={cfg.model.name}: megatron-core's float8 needs "
                 f"Transformer Engine, which is not part of this build; use precision=bf16 with "
                 f"Megatron models, or precision=fp8 with a Hugging Face model")
    elif cfg.memory.name in ("zero1", "zero2", "zero3"):
        p.append(f"precision=fp8 with memory={cfg.memory.name}: DeepSpeed keeps its own bf16 "
                 f"weight copies and casts, which torchao's float8 layers do not go through; use "
                 f"memory=fsdp (FSDP2 shards float8 layers, optionally gathering them in float8) "
                 f"or memory=none")
    if cfg.graph.name == "ort":
        p.append("precision=fp8 with graph=ort: ONNX Runtime training runs fp32 on the CPU here; "
                 "use graph=compile")
    pad_to = cfg.data.pad_to
    if cfg.task.name not in PRETRAINING_TASKS and (
            pad_to == "longest" or (isinstance(pad_to, int) and pad_to % 16)
            or (pad_to == "max" and cfg.data.max_seq_length % 16)
            or (isinstance(pad_to, list) and any(int(b) % 16 for b in pad_to))):
        p.append(f"data.pad_to={pad_to} with precision=fp8: float8 matmuls need the batch's "
                 f"token count to be a multiple of 16; use multiples of 16 (or data.pad_to=auto)")
    if cfg.task.name in PRETRAINING_TASKS and \
            (cfg.trainer.micro_batch_size * cfg.data.max_seq_length) % 16:
        p.append(f"precision=fp8 with trainer.micro_batch_size={cfg.trainer.micro_batch_size} x "
                 f"data.max_seq_length={cfg.data.max_seq_length} tokens: float8 matmuls need "
                 f"a multiple of 16 tokens a micro-batch; change either")
    if pr.fp8_all_gather and (cfg.memory.name != "fsdp" or pr.fp8_scaling != "tensorwise"):
        p.append(f"precision.fp8_all_gather=true needs memory=fsdp and "
                 f"precision.fp8_scaling=tensorwise (this run: memory={cfg.memory.name}, "
                 f"{pr.fp8_scaling}): it gathers FSDP2's weight shards with one scale a tensor")
    return p


def _best_problems(t) -> list[str]:
    """trainer.best_metric and the keys that need it."""
    p = []
    if t.best_metric is not None and not t.best_metric.startswith("validation/"):
        p.append(f"trainer.best_metric={t.best_metric} is not a metric of the validation "
                 f"evaluation: its key starts with validation/, e.g. "
                 f"trainer.best_metric=validation/accuracy or validation/loss")
    if t.best_metric is None:
        needing = [f"trainer.{key}={value}" for key, value in (
            ("best_mode", t.best_mode), ("early_stopping_patience", t.early_stopping_patience))
            if value is not None]
        for setting in needing:
            p.append(f"{setting} needs trainer.best_metric (the metric it applies to); set e.g. "
                     f"trainer.best_metric=validation/accuracy")
    if t.early_stopping_patience is None and t.early_stopping_min_delta:
        p.append(f"trainer.early_stopping_min_delta={t.early_stopping_min_delta} has no effect "
                 f"without trainer.early_stopping_patience; set e.g. "
                 f"trainer.early_stopping_patience=3, or drop the min_delta")
    return p


PRETRAINING_TASKS = ("bert_pretraining", "causal_lm")

# keys that only some options read: "group.key" -> (the key whose value decides, the values under
# which the key is read). An override of one of these that changes it while the options picked
# ignore it is refused (compose.ignored_override_problems): a setting that would be silently
# dropped. Every key not here is read whichever options are picked. A user_script may read any
# key, so nothing is refused with one. Model shape keys stay out: the seed's command lines give
# them with a pretrained model, which keeps its checkpoint's shape (docs/seed_flags.md).
FINE_TUNING_TASKS = ("sequence_classification", "token_classification", "question_answering",
                     "masked_lm", "seq2seq_lm")
USED_ONLY_WITH: dict[str, tuple[str, tuple[str, ...]]] = {
    # the planner and the export read num_labels for token classification too
    "task.num_labels": ("task.name", ("sequence_classification", "token_classification")),
    "task.label_all_tokens": ("task.name", ("token_classification",)),
    "task.doc_stride": ("task.name", ("question_answering",)),
    "task.max_answer_length": ("task.name", ("question_answering",)),
    "task.n_best_size": ("task.name", ("question_answering",)),
    "task.whole_word_masking": ("task.name", ("masked_lm",)),
    "task.max_target_length": ("task.name", ("seq2seq_lm",)),
    "task.num_beams": ("task.name", ("seq2seq_lm",)),
    "task.source_prefix": ("task.name", ("seq2seq_lm",)),
    "model.name_or_path": ("model.source", ("pretrained",)),
    "data.subset": ("data.source", ("hub",)),
    "data.format": ("data.source", ("local", "synthetic")),
    "data.train_file": ("data.source", ("local", "synthetic")),
    "data.validation_file": ("data.source", ("local", "synthetic")),
    "data.test_file": ("data.source", ("local", "synthetic")),
    "data.synthetic_train_size": ("data.source", ("synthetic",)),
    "data.synthetic_eval_size": ("data.source", ("synthetic",)),
    "data.synthetic_seed": ("data.source", ("synthetic",)),
    "data.impl": ("data.source", ("megatron",)),
    "data.split": ("data.source", ("megatron",)),
    "data.mmap_warmup": ("data.source", ("megatron",)),
    "data.text_a_column": ("task.name", ("sequence_classification",)),
    "data.text_b_column": ("task.name", ("sequence_classification",)),
    "data.label_column": ("task.name", ("sequence_classification",)),
    "data.tokens_column": ("task.name", ("token_classification",)),
    "data.tags_column": ("task.name", ("token_classification",)),
    "data.question_column": ("task.name", ("question_answering",)),
    "data.context_column": ("task.name", ("question_answering",)),
    "data.answers_column": ("task.name", ("question_answering",)),
    "data.text_column": ("task.name", ("masked_lm",)),
    "data.document_column": ("task.name", ("seq2seq_lm",)),
    "data.summary_column": ("task.name", ("seq2seq_lm",)),
    "data.group_by_length": ("task.name", FINE_TUNING_TASKS),
    "data.mask_prob": ("task.name", ("masked_lm", "bert_pretraining")),
    "data.short_seq_prob": ("task.name", ("bert_pretraining",)),
    "data.eod_mask_loss": ("task.name", ("causal_lm",)),
    "data.reset_position_ids": ("task.name", ("causal_lm",)),
    "precision.initial_scale": ("precision.dtype", ("fp16",)),
    "precision.growth_interval": ("precision.dtype", ("fp16",)),
    "precision.fp8_scaling": ("precision.dtype", ("bf16",)),
    "kernels.fused_linear_cross_entropy": ("kernels.name", ("liger",)),
    "kernels.rms_norm": ("kernels.name", ("liger",)),
    "kernels.swiglu": ("kernels.name", ("liger",)),
    "kernels.rope": ("kernels.name", ("liger",)),
    # memory=auto sets both from the mode it picks
    "memory.offload_optimizer": ("memory.name", ("zero1", "zero2", "zero3", "fsdp")),
    "memory.offload_params": ("memory.name", ("zero3", "fsdp")),
    "graph.scope": ("graph.name", ("compile",)),
    "graph.mode": ("graph.name", ("compile",)),
    "graph.fullgraph": ("graph.name", ("compile",)),
    "graph.dynamic": ("graph.name", ("compile",)),
    "graph.options": ("graph.name", ("compile",)),
    "scheduler.min_lr": ("scheduler.name", ("linear", "cosine")),
    "scheduler.decay_iters": ("scheduler.name", ("linear", "cosine")),
    "trainer.eval_iters": ("task.name", PRETRAINING_TASKS),
    "logger.project": ("logger.name", ("wandb", "mlflow")),
    "logger.run_name": ("logger.name", ("wandb", "mlflow")),
    "logger.mode": ("logger.name", ("wandb",)),
    "logger.tracking_uri": ("logger.name", ("mlflow",)),
}


# torch.compile's modes in every torch this project supports; another name is looked up in the
# installed torch (which may know more)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_modes() -> list[str]:
    try:
        from torch._inductor import list_mode_options
    except ImportError:
        return list(COMPILE_MODES)
    return list(list_mode_options())


ENCODER_DECODER_ARCHS = ("t5",)


UNPADDED_TASKS = ("sequence_classification", "token_classification", "masked_lm",
                  "bert_pretraining")


def _length_problems(cfg: RunConfig) -> list[str]:
    """data.pad_to's buckets and trainer.unpad's tasks, models, graph and precision."""
    t, m, d = cfg.trainer, cfg.model, cfg.data
    p: list[str] = []
    if isinstance(d.pad_to, list):
        bad = [b for b in d.pad_to if not MIN_SEQ_LENGTH <= b <= d.max_seq_length]
        if bad or not d.pad_to:
            p.append(f"data.pad_to={d.pad_to}: bucket lengths are between {MIN_SEQ_LENGTH} and "
                     f"data.max_seq_length={d.max_seq_length}"
                     + (f" ({', '.join(map(str, bad))} is not)" if bad else " (the list is empty)")
                     + f"; e.g. data.pad_to=[{d.max_seq_length // 4},{d.max_seq_length // 2}]")
        if t.unpad:
            p.append(f"data.pad_to={d.pad_to} lists row lengths, but trainer.unpad=true packs "
                     f"each batch into one row of real tokens, rounded up to a multiple: give "
                     f"data.pad_to an integer (e.g. 256) or auto")
    if not t.unpad:
        return p
    if cfg.task.name not in UNPADDED_TASKS:
        p.append(f"trainer.unpad=true with task={cfg.task.name}: not yet; unpadded training "
                 f"drives {', '.join(UNPADDED_TASKS)} (Hugging Face BERT models); set "
                 f"trainer.unpad=false" + ("; decoders pack examples with data.packing=true"
                                           if cfg.task.name == "sft" else ""))
    elif m.arch.startswith("megatron") or (m.source == "config" and m.arch != "bert"):
        p.append(f"trainer.unpad=true with model={m.name}: unpadded training drives Hugging "
                 f"Face BERT models (model=bert_tiny, bert_base, or model=hf with a BERT "
                 f"checkpoint); set trainer.unpad=false")
    if cfg.graph.name == "ort":
        p.append("trainer.unpad=true with graph=ort: the exported ONNX graph has no "
                 "variable-length attention; use graph=eager or graph=compile")
    return p


def _task_problems(cfg: RunConfig) -> list[str]:
    """What each fine-tuning task needs of its model and its own settings."""
    t, m, d = cfg.task, cfg.model, cfg.data
    p: list[str] = []
    if t.name in PRETRAINING_TASKS or m.arch.startswith("megatron"):
        return p
    config_built = m.source == "config"
    if t.name == "seq2seq_lm" and config_built and m.arch not in ENCODER_DECODER_ARCHS:
        p.append(f"task=seq2seq_lm needs an encoder-decoder model, but model={m.name} "
                 f"(arch {m.arch}) is an encoder; use model=t5_tiny, model=t5_small, or a "
                 f"pretrained T5/BART with model=hf model.name_or_path=...")
    if t.name != "seq2seq_lm" and config_built and m.arch in ENCODER_DECODER_ARCHS:
        p.append(f"model={m.name} is an encoder-decoder (for task=seq2seq_lm); task={t.name} "
                 f"needs an encoder such as model=bert_tiny")
    longest = d.max_seq_length - QA_WINDOW_EXTRA
    if t.name == "question_answering" and t.doc_stride >= 1 \
            and d.max_seq_length >= MIN_SEQ_LENGTH and t.doc_stride >= longest:
        p.append(f"task.doc_stride={t.doc_stride} must be positive and below "
                 f"data.max_seq_length={d.max_seq_length} - {QA_WINDOW_EXTRA} = {longest}: a window "
                 f"[CLS] question [SEP] context [SEP] holds 3 special tokens, the question, the "
                 f"doc_stride tokens it shares with the window before and new context (the "
                 f"tokenizer fails on a window with no room for them); set e.g. "
                 f"task.doc_stride={max(1, d.max_seq_length // 4)}")
    return p


def _pretraining_problems(cfg: RunConfig) -> list[str]:
    """Pretraining tasks read Megatron data with the tokenizer that made it, by iterations."""
    from rapidformer.config.splits import parse_split

    p: list[str] = []
    t, d, m, task = cfg.trainer, cfg.data, cfg.model, cfg.task.name
    if task not in PRETRAINING_TASKS:
        if d.source == "megatron" and not cfg.user_script:  # a white-box script reads it itself
            p.append(f"data.source=megatron is pretraining data, but task={task}; use "
                     f"task=bert_pretraining or task=causal_lm (or +recipe=bert_pretrain)")
        return p
    if not t.train_iters:
        p.append(f"task={task} counts iterations, not epochs: set trainer.train_iters (the "
                 f"seed's --train-iters)")
    if d.source != "megatron":
        p.append(f"task={task} reads Megatron mmap data, but data.source={d.source}; use "
                 f"data=megatron data.path=PREFIX (made by rapidformer-preprocess-data)")
    if not m.tokenizer_type:
        p.append("model.tokenizer_type is empty; name the tokenizer the data was made with, e.g. "
                 "model.tokenizer_type=BertWordPieceLowerCase")
    elif not m.tokenizer:
        what = "tokenizer directory" if m.tokenizer_type == "HuggingFaceTokenizer" else \
            "vocab file"
        p.append(f"model.tokenizer is empty; give the {what} the data was made with (the "
                 f"seed's --vocab-file)")
    if m.tokenizer_type == "GPT2BPETokenizer" and not m.merge_file:
        p.append("model.tokenizer_type=GPT2BPETokenizer needs model.merge_file (the seed's "
                 "--merge-file, e.g. gpt2-merges.txt)")
    if task == "bert_pretraining" and m.tokenizer_type == "GPT2BPETokenizer":
        p.append("task=bert_pretraining masks WordPiece tokens; use "
                 "model.tokenizer_type=BertWordPieceLowerCase or BertWordPieceCase")
    if d.impl not in ("mmap", "infer"):
        p.append(f"data.impl={d.impl}: megatron-core reads only mmap data (the legacy lazy/cached "
                 f"formats are gone); regenerate with rapidformer-preprocess-data and use "
                 f"data.impl=mmap")
    try:
        parse_split(d.split)
    except ConfigError as exc:
        p.extend(f"data.{problem}" for problem in exc.problems)
    return p


def _megatron_problems(cfg: RunConfig) -> list[str]:
    """megatron-core models: what their layout needs, and what is not built for them yet."""
    m, par = cfg.model, cfg.parallelism
    if not m.arch.startswith("megatron"):
        return []
    p: list[str] = []
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    tasks = {"megatron_gpt": ("causal_lm", "a GPT", "gpt_pretrain"),
             "megatron_bert": ("bert_pretraining", "a BERT", "bert_pretrain")}
    if m.arch not in tasks:
        p.append(f"model.arch={m.arch}: the Megatron models are {' and '.join(tasks)}")
    elif cfg.task.name != tasks[m.arch][0] and not cfg.user_script:
        task, what, recipe = tasks[m.arch]
        p.append(f"model={m.name} is {what}: use task={task} (or +recipe={recipe})")
    if m.arch == "megatron_bert" and par.sequence_parallel:
        p.append("parallelism.sequence_parallel=true is built for model=megatron_gpt; "
                 "megatron_bert runs without it")
    if tp >= 1 and m.num_attention_heads is not None and m.num_attention_heads % tp:
        p.append(f"model.num_attention_heads={m.num_attention_heads} does not divide by "
                 f"parallelism.tensor_model_parallel_size={tp}")
    if pp >= 1 and m.num_layers is not None and m.num_layers % pp:
        p.append(f"model.num_layers={m.num_layers} does not divide by "
                 f"parallelism.pipeline_model_parallel_size={pp}")
    if cfg.memory.name not in ("none", "zero1", "zero2", "auto"):
        p.append(f"memory={cfg.memory.name} with a Megatron model is not supported: tensor and "
                 f"pipeline parallelism shard the weights already, and megatron-core's own FSDP "
                 f"is not wired here; use memory=zero1 or zero2 (megatron-core's distributed "
                 f"optimizer) or memory=none")
    if cfg.memory.offload_optimizer or cfg.memory.offload_params:
        p.append("memory.offload_optimizer/offload_params with a Megatron model is not built yet; "
                 "set them to false")
    if cfg.graph.name == "ort" or (cfg.graph.name == "compile" and cfg.graph.scope == "model"):
        p.append(f"graph={cfg.graph.name}{' graph.scope=model' * (cfg.graph.name == 'compile')} "
                 f"with a Megatron model is not built; use graph=compile (each transformer layer "
                 f"compiled) or graph=eager")
    return p
