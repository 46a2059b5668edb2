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
        return " or ".join(parts) + " or null"
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
        problems.extend(check_values(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def world_size(cfg: RunConfig) -> int:
    return cfg.launcher.nproc_per_node * cfg.launcher.nnodes


def data_parallel_size(cfg: RunConfig) -> int:
    model_parallel = cfg.parallelism.tensor_model_parallel_size * cfg.parallelism.pipeline_model_parallel_size
    return max(world_size(cfg) // model_parallel, 1)


def check_values(cfg: RunConfig) -> list[str]:
    """Impossible values and incompatible settings; each message names the key(s) and a fix."""
    p: list[str] = []
    t, s, m, d = cfg.trainer, cfg.scheduler, cfg.model, cfg.data

    def positive(where: str, value, allow_none: bool = False):
        if value is None and allow_none:
            return
        if value is None or value < 1:
            p.append(f"{where}={value} must be a positive integer")

    positive("trainer.micro_batch_size", t.micro_batch_size)
    positive("trainer.global_batch_size", t.global_batch_size)
    positive("trainer.log_interval", t.log_interval)
    positive("trainer.keep_last", t.keep_last)
    positive("trainer.max_nonfinite_steps", t.max_nonfinite_steps, allow_none=True)
    positive("parallelism.ddp_bucket_cap_mb", cfg.parallelism.ddp_bucket_cap_mb)
    if cfg.launcher.max_restarts < 0:
        p.append(f"launcher.max_restarts={cfg.launcher.max_restarts} must not be negative "
                 f"(0: a failed worker ends the job)")
    for name in ("rendezvous_timeout", "collective_timeout"):
        positive(f"launcher.{name}", getattr(cfg.launcher, name))
    if t.grad_norm_spike_factor is not None and t.grad_norm_spike_factor <= 1:
        p.append(f"trainer.grad_norm_spike_factor={t.grad_norm_spike_factor} must be above 1 "
                 f"(a window max this many times the recent median), or null to turn it off")
    for name in ("eval_interval", "save_interval", "exit_interval", "train_iters", "epochs"):
        positive(f"trainer.{name}", getattr(t, name), allow_none=True)
    if t.epochs is None and t.train_iters is None:
        p.append("trainer.epochs and trainer.train_iters are both null; set one of them, "
                 "e.g. trainer.epochs=3")
    if t.lr < 0:
        p.append(f"trainer.lr={t.lr} must not be negative; a typical fine-tuning lr is 2e-5")
    if t.weight_decay < 0:
        p.append(f"trainer.weight_decay={t.weight_decay} must not be negative")
    if t.clip_grad < 0:
        p.append(f"trainer.clip_grad={t.clip_grad} must not be negative (0 disables clipping)")
    if t.micro_batch_size >= 1 and t.global_batch_size >= 1:
        step = t.micro_batch_size * data_parallel_size(cfg)
        if t.global_batch_size % step:
            dp = data_parallel_size(cfg)
            suggestion = max(step, round(t.global_batch_size / step) * step)
            p.append(
                f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
                f"trainer.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp}) = "
                f"{step}; set it to a multiple, e.g. trainer.global_batch_size={suggestion}")

    if s.warmup_iters < 0:
        p.append(f"scheduler.warmup_iters={s.warmup_iters} must not be negative")
    if s.warmup_fraction is not None and not 0 <= s.warmup_fraction < 1:
        p.append(f"scheduler.warmup_fraction={s.warmup_fraction} must be in [0, 1)")
    if s.min_lr < 0:
        p.append(f"scheduler.min_lr={s.min_lr} must not be negative")
    elif t.lr >= 0 and s.min_lr > t.lr:
        p.append(f"scheduler.min_lr={s.min_lr} is above trainer.lr={t.lr}; lower min_lr")
    positive("scheduler.decay_iters", s.decay_iters, allow_none=True)

    if m.source == "pretrained" and not m.name_or_path:
        p.append("model.name_or_path is empty but model.source=pretrained; give a hub name or a "
                 "local directory, e.g. model.name_or_path=bert-base-cased")
    for name in ("hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings", "vocab_size"):
        positive(f"model.{name}", getattr(m, name))
    if m.source == "config" and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        p.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                 f"model.num_attention_heads={m.num_attention_heads}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(m, name) < 1:
            p.append(f"model.{name}={getattr(m, name)} must be in [0, 1)")
    if m.source == "config" and d.max_seq_length > m.max_position_embeddings:
        p.append(f"data.max_seq_length={d.max_seq_length} is above "
                 f"model.max_position_embeddings={m.max_position_embeddings}; lower the first "
                 f"or raise the second")

    positive("data.max_seq_length", d.max_seq_length)
    if d.num_workers < 0:
        p.append(f"data.num_workers={d.num_workers} must not be negative")
    if d.source in ("local", "hub", "megatron") and not d.path:
        what = {"local": "a directory or file of local data", "hub": "a hub dataset name",
                "megatron": "the prefix rapidformer-preprocess-data printed (without .bin/.idx)"}
        p.append(f"data.path is empty but data.source={d.source}; set data.path to "
                 f"{what[d.source]}")
    p.extend(_pretraining_problems(cfg))
    p.extend(_megatron_problems(cfg))
    p.extend(_task_problems(cfg))
    if d.source == "synthetic":
        positive("data.synthetic_train_size", d.synthetic_train_size)
        positive("data.synthetic_eval_size", d.synthetic_eval_size)
    if cfg.task.num_labels is not None and cfg.task.num_labels < 2:
        p.append(f"task.num_labels={cfg.task.num_labels} must be at least 2 (or null to infer)")

    if cfg.precision.initial_scale <= 0:
        p.append(f"precision.initial_scale={cfg.precision.initial_scale} must be positive")
    positive("precision.growth_interval", cfg.precision.growth_interval)

    par = cfg.parallelism
    positive("parallelism.tensor_model_parallel_size", par.tensor_model_parallel_size)
    positive("parallelism.pipeline_model_parallel_size", par.pipeline_model_parallel_size)
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
    positive("launcher.nproc_per_node", cfg.launcher.nproc_per_node)
    positive("launcher.nnodes", cfg.launcher.nnodes)
    positive("launcher.rendezvous_timeout", cfg.launcher.rendezvous_timeout)
    positive("launcher.collective_timeout", cfg.launcher.collective_timeout)
    if not 0 <= cfg.launcher.node_rank < max(cfg.launcher.nnodes, 1):
        p.append(f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, launcher.nnodes)")
    if world_size(cfg) % (par.tensor_model_parallel_size * par.pipeline_model_parallel_size or 1):
        p.append(f"the world size ({world_size(cfg)}) is not divisible by tensor x pipeline "
                 f"parallel size ({par.tensor_model_parallel_size * par.pipeline_model_parallel_size})")
    if cfg.memory.name not in ("none", "auto") and cfg.graph.name == "compile" \
            and cfg.graph.scope == "model":
        p.append(f"graph.scope=model with memory={cfg.memory.name}: the whole-model compile "
                 f"wraps what {'FSDP2' if cfg.memory.name == 'fsdp' else 'DeepSpeed'} shards; "
                 f"use graph.scope=blocks (or auto, the default), which compiles each transformer block")
    if cfg.graph.mode and cfg.graph.options:
        p.append(f"graph.mode={cfg.graph.mode} with graph.options: torch.compile takes a mode or "
                 f"inductor options, not both; drop one (a mode is a named set of options)")
    if cfg.graph.name == "ort" and cfg.memory.name != "none":
        p.append(f"graph=ort with memory={cfg.memory.name}: ORTModule is run here with DDP only "
                 f"(memory=none); use graph=eager or graph=compile with memory={cfg.memory.name}")
    if cfg.graph.name == "ort" and cfg.precision.name != "fp32":
        p.append(f"graph=ort with precision={cfg.precision.name}: ONNX Runtime's CPU training "
                 f"kernels are fp32 only (its export fails under autocast); use precision=fp32")
    if not cfg.trainer.save_last and cfg.trainer.export_hf and cfg.memory.name in ("zero1", "zero2", "zero3") \
            and not m.arch.startswith("megatron"):
        p.append(f"trainer.save_last=false with trainer.export_hf=true and memory={cfg.memory.name}: "
                 f"the export reads DeepSpeed's final checkpoint; keep trainer.save_last=true or set "
                 f"trainer.export_hf=false")
    if cfg.memory.name == "fsdp" and (cfg.memory.offload_optimizer and not cfg.memory.offload_params):
        p.append("memory.offload_optimizer=true with memory=fsdp needs memory.offload_params=true "
                 "(FSDP offloads parameters and optimizer state together)")
    return p


PRETRAINING_TASKS = ("bert_pretraining", "causal_lm")
ENCODER_DECODER_ARCHS = ("t5",)


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
    if t.name == "question_answering":
        if not 0 < t.doc_stride < d.max_seq_length:
            p.append(f"task.doc_stride={t.doc_stride} must be positive and below "
                     f"data.max_seq_length={d.max_seq_length} (windows overlap by it); set e.g. "
                     f"task.doc_stride={max(1, d.max_seq_length // 4)}")
        for key in ("max_answer_length", "n_best_size"):
            if getattr(t, key) < 1:
                p.append(f"task.{key}={getattr(t, key)} must be at least 1")
    if t.name == "masked_lm" and not 0 < d.mask_prob < 1:
        p.append(f"data.mask_prob={d.mask_prob} must be in (0, 1), e.g. 0.15")
    if t.name == "seq2seq_lm":
        for key in ("max_target_length", "num_beams"):
            if getattr(t, key) < 1:
                p.append(f"task.{key}={getattr(t, key)} must be at least 1")
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
    if t.eval_iters < 0:
        p.append(f"trainer.eval_iters={t.eval_iters} must not be negative (0: no evaluation)")
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
    if not 0 < d.mask_prob < 1:
        p.append(f"data.mask_prob={d.mask_prob} must be in (0, 1), e.g. 0.15")
    if not 0 <= d.short_seq_prob <= 1:
        p.append(f"data.short_seq_prob={d.short_seq_prob} must be in [0, 1], e.g. 0.1")
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
    if tp >= 1 and m.num_attention_heads % tp:
        p.append(f"model.num_attention_heads={m.num_attention_heads} does not divide by "
                 f"parallelism.tensor_model_parallel_size={tp}")
    if pp >= 1 and m.num_layers % pp:
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
    if cfg.graph.name != "eager":
        p.append(f"graph={cfg.graph.name} with a Megatron model is not built yet; use graph=eager")
    return p
