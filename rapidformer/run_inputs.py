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
            problems += column_problems(cfg, files)
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


# --- the columns the task reads, from each split file's names ---------------------------------
def task_columns(cfg: RunConfig) -> dict[str, str]:
    """{config key: column} the task requires of every split (the tasks' own lists)."""
    d, task = cfg.data, cfg.task.name
    if task == "sequence_classification":
        wanted = {"data.text_a_column": d.text_a_column, "data.label_column": d.label_column}
        if d.text_b_column:
            wanted["data.text_b_column"] = d.text_b_column
        return wanted
    if task == "sft":
        return {}
    from rapidformer.tasks import task_class

    return {f"data.{key}": getattr(d, key) for key in getattr(task_class(task), "columns", ())}


def column_problems(cfg: RunConfig, files: dict) -> list[Problem]:
    """The run's refusal of a split file without a column the task reads (the same message),
    asked of the files' column names alone: a csv/tsv header, parquet's schema, the keys of a
    JSON file's objects (read until every wanted column is found). A file whose names cannot
    be read so is left to the run's reader, which says what is wrong with it."""
    from types import SimpleNamespace

    from rapidformer.data.text_classification import require_columns

    d = cfg.data
    wanted = task_columns(cfg)
    if cfg.task.name == "sft":  # a conversation column, or prompt and response columns
        def enough(names):
            return d.messages_column in names or {d.prompt_column, d.response_column} <= names
    else:
        def enough(names):
            return set(wanted.values()) <= names
    for split, path in files.items():
        try:
            names = column_names(Path(path), d.format, d.quoting, enough)
        except (OSError, ValueError):
            continue
        if names is None:
            continue
        try:
            if cfg.task.name == "sft":
                from rapidformer.data.chat import row_form

                row_form(names, d)
            else:
                # a test split without labels loads unscored (data/text_classification.py)
                needed = {k: v for k, v in wanted.items()
                          if not (split == "test" and k == "data.label_column")}
                require_columns({split: SimpleNamespace(column_names=names)}, needed, files)
        except RapidformerError as exc:
            return [Problem(str(exc), exc.exit_code)]
    return []


def column_names(path: Path, fmt: str, quoting: str, enough) -> list[str] | None:
    """The column names of a split file as the run's reader finds them (None: not read here);
    JSON lines are read until `enough(the names so far)`."""
    import csv
    import json

    from rapidformer.data.file_rows import dialect_of
    from rapidformer.data.local_files import format_of

    fmt = format_of(path, fmt)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if fmt in ("csv", "tsv"):
        dialect = dialect_of(fmt, quoting)
        with open(path, encoding="utf-8-sig", newline="") as f:
            for line in f:
                if line.strip():
                    if dialect.quoted and line.count('"') % 2:
                        return None  # a header field spanning lines: the reader's to say
                    return next(csv.reader([line.rstrip("\r\n")], delimiter=dialect.delimiter,
                                           quoting=csv.QUOTE_MINIMAL if dialect.quoted
                                           else csv.QUOTE_NONE))
        return None
    if fmt not in ("json", "jsonl"):
        return None
    names: dict = {}
    with open(path, encoding="utf-8-sig") as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
        if first != "{":
            return None  # a JSON array (or no object): the reader's to read
        f.seek(0)
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                return None
            names.update(dict.fromkeys(row))
            if enough(names.keys()):
                break
    return list(names) or None
