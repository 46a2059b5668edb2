"""What a run reads, checked before it starts: the local data's files, the tokenizer's, and
pretraining data against its tokenizer and task. The refusal pass asks it
(rapidformer/preflight.py), so that `rapidformer validate` refuses what the run would refuse
later, and the run refuses it before it builds anything.

The checks are the readers' own (the same functions, the same messages): a local data
directory, its split files and their formats (data/text_classification.py), and a validation
split where trainer.best_metric needs one; offline, a hub dataset in the cache; a tokenizer path;
for pretraining, the tokenizer's files and what the task needs of it, each Megatron prefix's
files whole and of that vocabulary, sentences to pair for next-sentence prediction, and a
data.split that leaves training (and each evaluated split) a whole document
(data/megatron.py). Only what is cheap is asked: names, headers, sizes, the index's document
counts, the first tokens of each .bin (read once per file version). Reading every row of a
local file, or building Megatron's sample indexes, is the run's own work.
"""
from __future__ import annotations

from pathlib import Path

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError, Problem, RapidformerError, caught


def input_problems(cfg: RunConfig) -> list[Problem]:
    """Every reason the run's data or tokenizer cannot be read as the config asks."""
    if cfg.user_script:
        return []  # a white-box script reads its own data
    d, m = cfg.data, cfg.model
    if cfg.task.is_pretraining:
        if d.source == "megatron" and d.path:
            return pretraining_problems(cfg)
        return []
    problems = []
    if d.source == "local" and d.path:
        from rapidformer.config.validate import best_without_evaluations
        from rapidformer.data.text_classification import local_split_files

        try:
            files = local_split_files(d, Path(d.path))
        except RapidformerError as exc:
            problems.append(Problem(str(exc), exc.exit_code))
        else:
            if cfg.trainer.best_metric and "validation" not in files:
                problems.append(Problem(best_without_evaluations(
                    cfg.trainer.best_metric, f"data.path={d.path} has no validation split",
                    pretraining=False)))
    if d.source == "hub" and d.path:
        from rapidformer.data.text_classification import check_hub_dataset_offline

        problems += caught(check_hub_dataset_offline, d)
    if m.tokenizer:
        from rapidformer.data.tokenizers import check_tokenizer_path

        problems += caught(check_tokenizer_path, m.tokenizer)
    return problems


def pretraining_problems(cfg: RunConfig) -> list[Problem]:
    """The pretraining tokenizer, the Megatron files of data.path and data.split, as the task's
    dataset builder checks them (without building an index)."""
    from rapidformer.data import megatron
    from rapidformer.data.pretraining_tokenizer import (check_pretrained_vocabulary,
                                                        load_pretraining_tokenizer)

    d, m = cfg.data, cfg.model
    if not m.tokenizer_type or not m.tokenizer or caught(megatron.require_megatron_core):
        return []  # the config's checks, or the environment's, say what is missing
    bert = cfg.task.name == "bert_pretraining"
    try:
        tokenizer = load_pretraining_tokenizer(m, d.path)
        if m.source == "pretrained":
            check_pretrained_vocabulary(m, tokenizer)
        _, indexed = megatron.checked_data(d.path, tokenizer, bert=bert,
                                           binary_head=cfg.task.binary_head)
    except ConfigError as exc:
        return [Problem(text) for text in exc.problems]
    except RapidformerError as exc:
        return [Problem(str(exc), exc.exit_code)]
    try:
        return [Problem(text) for text in megatron.split_problems(
            d.split, megatron.documents_of(indexed, bert), cfg.trainer.eval_iters)]
    except ConfigError:
        return []  # a data.split the config's checks refuse
