"""The config's own checks, every problem at once: each number in its range
(config/bounds.py), and the settings that contradict each other within the config's groups
(batch sizes, the model's shape, what each task and its data need). What a backend or a model
transform refuses is theirs to say (rapidformer/accelerators/, rapidformer/transforms/); the
one refusal pass (rapidformer/preflight.py) gathers all of them with these.

Nothing here touches the disk, a device or the network.
"""
from __future__ import annotations

from rapidformer.config.bounds import (BOUNDS, MIN_SEQ_LENGTH, QA_WINDOW_EXTRA, SHAPE_KEYS,
                                       range_problems)
from rapidformer.config.schema import ENCODER_DECODER_ARCHS, PRETRAINING_TASKS, RunConfig
from rapidformer.config.typed import closest, typed_config
from rapidformer.errors import ConfigError
from rapidformer.config.sizes import data_parallel_size


def build_run_config(raw: dict, check: bool = True) -> RunConfig:
    """Typed config from a resolved plain dict, its sizes made concrete (config/sizes.py);
    raises ConfigError listing every problem (typing first; with `check`, then every value
    problem of `check_values`)."""
    from rapidformer.config.sizes import fill

    cfg = typed_config(raw)
    fill(cfg)  # nproc_per_node=auto and global_batch_size=null become numbers
    if check and (problems := check_values(cfg)):
        raise ConfigError(problems)
    return cfg


def _divisor_below(n: int, k: int) -> int:
    return max((d for d in range(1, min(n, k) + 1) if n % d == 0), default=1)


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

    if m.is_megatron and m.embedding_rows is not None:
        p.append(f"model.embedding_rows with model={m.name}: megatron-core models pad their "
                 f"vocabulary themselves (to a multiple of 128 x tensor-parallel size); drop the "
                 f"override")
    if t.epochs is None and t.train_iters is None:
        p.append("trainer.epochs and trainer.train_iters are both null; set one of them, "
                 "e.g. trainer.epochs=3")
    if t.micro_batch_size >= 1 and t.global_batch_size is not None and t.global_batch_size >= 1:
        dp = data_parallel_size(cfg)
        step = t.micro_batch_size * dp
        if t.global_batch_size % step:
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
    if m.source == "config" and kv is not None and m.arch not in ("llama", "megatron_llama"):
        p.append(f"model.num_key_value_heads={kv} with model.arch={m.arch}: only a Llama-shaped "
                 f"model has grouped-query attention here; drop the key or use model=llama_tiny "
                 f"/ llama_1b")
    if m.source == "config" and kv is not None and kv >= 1 and m.num_attention_heads % kv:
        p.append(f"model.num_key_value_heads={kv} does not divide "
                 f"model.num_attention_heads={m.num_attention_heads}: each key/value head serves "
                 f"a whole group of query heads; pick a divisor, e.g. "
                 f"model.num_key_value_heads={_divisor_below(m.num_attention_heads, kv)}")
    if cfg.task.name == "sft" and (m.is_megatron or
                                   (m.source == "config" and m.arch not in CAUSAL_LM_ARCHS)):
        p.append(f"task=sft fine-tunes a Hugging Face causal LM; model={m.name} (model.arch="
                 f"{m.arch}) is not one: use model=llama_tiny, model=gpt2_tiny, or a pretrained "
                 f"decoder with model=hf model.name_or_path=DIR")
    if m.init_dtype != "fp32" and m.is_megatron:
        p.append(f"model.init_dtype={m.init_dtype} with model={m.name}: megatron-core models "
                 f"start from their own fp32 initialization here (not built for them); leave "
                 f"model.init_dtype=fp32, or start from a bf16 checkpoint with model.init_from_hf")
    if m.init_from_hf and m.arch not in ("megatron_gpt", "megatron_llama"):
        p.append(f"model.init_from_hf={m.init_from_hf} with model.arch={m.arch}: only "
                 f"model=megatron_gpt starts from a Hugging Face GPT-2 checkpoint; use "
                 f"model=megatron_gpt (model=megatron_llama for a Llama, Mistral or Qwen2 "
                 f"checkpoint), or load a Hugging Face model as it is with model=hf "
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
    p.extend(_task_problems(cfg))
    p.extend(_pad_to_problems(cfg))
    steps = t.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        p.append(f"trainer.profile_steps={list(steps)}: give the first and the last training "
                 f"step to profile, 1 <= first <= last, e.g. trainer.profile_steps=[20,24] "
                 f"(after the compile and warm-up steps)")
    if not 0 <= cfg.launcher.node_rank < max(cfg.launcher.nnodes, 1):
        p.append(f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, launcher.nnodes)")
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
    p.extend(_accelerate_problems(cfg.accelerate))
    return p


def _accelerate_problems(a) -> list[str]:
    """accelerate=auto's own settings (rapidformer/tuning/: what it searches)."""
    from rapidformer.config.schema import TUNING_AXES

    if a.name != "auto":
        return []
    p = [f"accelerate.axes: no axis '{axis}'"
         + (f" (did you mean '{hint}'?)" if (hint := closest(axis, TUNING_AXES)) else "")
         + f"; the axes are {', '.join(TUNING_AXES)}" for axis in a.axes if axis not in TUNING_AXES]
    if a.warmup_steps >= a.steps:
        p.append(f"accelerate.warmup_steps={a.warmup_steps} leaves no step of "
                 f"accelerate.steps={a.steps} to time; make steps larger than warmup_steps")
    for text in a.extra_candidates:  # before any measurement, whatever the run's length
        try:
            extra_candidate_overrides(str(text))
        except ConfigError as exc:
            p.extend(exc.problems)
    return p


def extra_candidate_overrides(text: str) -> tuple[tuple[str, str], ...]:
    """One accelerate.extra_candidates string as its (key, value) overrides."""
    pairs = []
    for word in text.split():
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise ConfigError([f"accelerate.extra_candidates: '{word}' in '{text}' is not an "
                               f"override key=value (spaces separate a candidate's overrides: "
                               f"a value cannot hold one)"])
        pairs.append((key, value))
    if not pairs:
        raise ConfigError(["accelerate.extra_candidates: an empty candidate; give overrides "
                           "such as 'precision=bf16 graph=compile'"])
    return tuple(pairs)


def _pad_to_problems(cfg: RunConfig) -> list[str]:
    """data.pad_to's bucket lengths."""
    d = cfg.data
    if not isinstance(d.pad_to, list):
        return []
    bad = [b for b in d.pad_to if not MIN_SEQ_LENGTH <= b <= d.max_seq_length]
    if not bad and d.pad_to:
        return []
    return [f"data.pad_to={d.pad_to}: bucket lengths are between {MIN_SEQ_LENGTH} and "
            f"data.max_seq_length={d.max_seq_length}"
            + (f" ({', '.join(map(str, bad))} is not)" if bad else " (the list is empty)")
            + f"; e.g. data.pad_to=[{d.max_seq_length // 4},{d.max_seq_length // 2}]"]


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


# torch.compile's modes in every torch this project supports; another name is looked up in the
# installed torch (which may know more)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_modes() -> list[str]:
    try:
        from torch._inductor import list_mode_options
    except ImportError:
        return list(COMPILE_MODES)
    return list(list_mode_options())


def _task_problems(cfg: RunConfig) -> list[str]:
    """What each fine-tuning task needs of its model and its own settings."""
    t, m, d = cfg.task, cfg.model, cfg.data
    p: list[str] = []
    if t.name in PRETRAINING_TASKS or m.is_megatron:
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


# the Hugging Face architectures a config-built causal LM (task=causal_lm, sft) may have
CAUSAL_LM_ARCHS = ("gpt2", "llama")


def pretraining_model_problem(task: str, m) -> str | None:
    """Whether the pretraining task can build model `m` from its config: a BERT for
    bert_pretraining, a GPT-2- or Llama-shaped decoder (or a Megatron decoder) for causal_lm.
    A pretrained model is its checkpoint's; its own loading says what it is."""
    if m.source != "config":
        return None
    if task == "bert_pretraining" and m.arch not in ("bert", "megatron_bert"):
        return (f"task=bert_pretraining builds a BERT; model.arch={m.arch} is not one (use "
                f"model=bert_tiny, bert_base or megatron_bert)")
    if task == "causal_lm" and (m.arch == "megatron_bert" or not m.is_megatron
                                and m.arch not in CAUSAL_LM_ARCHS):
        return (f"task=causal_lm builds a GPT-2- or Llama-shaped model from the config; "
                f"model.arch={m.arch} is neither (use model=gpt2_tiny, gpt2_small, llama_tiny "
                f"or llama_1b, megatron_gpt, or a pretrained causal LM with model=hf)")
    return None


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
    if (problem := pretraining_model_problem(task, m)) is not None:
        p.append(problem)
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
        shares = parse_split(d.split)
    except ConfigError as exc:
        p.extend(f"data.{problem}" for problem in exc.problems)
        return p
    if t.best_metric and (t.eval_iters == 0 or shares[1] == 0):
        why = ("trainer.eval_iters=0" if t.eval_iters == 0 else
               f"data.split={d.split} gives validation no share")
        p.append(best_without_evaluations(t.best_metric, why, pretraining=True))
    return p


def best_without_evaluations(metric: str, why: str, pretraining: bool) -> str:
    """trainer.best_metric where nothing is evaluated, `why`: the refusal the config's checks,
    the refusal pass (run_inputs.py) and the templates share."""
    fix = ("give validation a share of data.split and trainer.eval_iters >= 1" if pretraining
           else "give a validation split (or a data.split with a validation share)")
    return (f"trainer.best_metric={metric} needs evaluations, but {why}; {fix}, or set "
            f"trainer.best_metric=null")


