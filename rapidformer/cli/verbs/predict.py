"""`rapidformer predict RUN_DIR --input FILE --output FILE [--checkpoint last|best|PATH]`: one
prediction per row of a jsonl, csv or tsv file, written in the same format with the input's
columns and the prediction's (rapidformer/inference/predictors.py says which, per task).

The model is a checkpoint of the run (any memory mode: its weights are consolidated in this
process, as `rapidformer export` does; default the newest complete one, every byte verified) or
a Hugging Face directory the run exported (`--checkpoint RUN_DIR/hf_model`, or one from
`rapidformer export`). The input's columns are the ones the run's data config names
(data.text_a_column, data.question_column, ...).

The output is written whole or not at all (a temporary file in its folder, renamed). An --output
that exists is refused unless --overwrite is given; the input file (by any path or link), the
run's data files (under its data.path) and the run's own records and outputs are refused even
then.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from rapidformer.errors import EXIT_WRITE_FAILED, InputError
from rapidformer.inference import predictors, restore, rows as row_files
from rapidformer.inference.served import require_served

CLASSIFIERS = ("sequence_classification", "token_classification")


def label_names_of(config) -> list:
    """id -> label name as the model's config holds them; empty when they are transformers'
    placeholders (LABEL_0, ...), which is what a run whose labels were ids leaves."""
    id2label = getattr(config, "id2label", None) or {}
    names = [id2label[i] for i in sorted(id2label, key=int)]
    return [] if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names


def _auto_class(task: str):
    import transformers

    from rapidformer.models.hf import AUTO_CLASSES

    return getattr(transformers, AUTO_CLASSES[task])


def from_export(directory: Path, task: str):
    """(model, tokenizer, what it is) from a Hugging Face save_pretrained directory."""
    from transformers import AutoTokenizer

    if not (directory / "tokenizer_config.json").is_file():
        raise InputError(f"--checkpoint {directory}: a Hugging Face model without its tokenizer "
                         f"(no tokenizer_config.json); use the run's hf_model/ or a "
                         f"`rapidformer export` directory, which hold both")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the one line predict prints is the result
    try:
        model = _auto_class(task).from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise InputError(f"--checkpoint {directory}: not a {task} model this run could have "
                         f"written ({str(exc).splitlines()[0]})") from exc
    return model, AutoTokenizer.from_pretrained(str(directory)), f"{directory} (exported)"


def _tokenizer(ckpt: Path, cfg, run_dir: Path):
    """The tokenizer saved with the checkpoint, else the one the run's config names."""
    from transformers import AutoTokenizer

    from rapidformer.data.tokenizers import load_tokenizer, unreachable_model_message

    from rapidformer.checkpoint import reading

    reading.require_present(ckpt, "rapidformer predict")
    m = cfg.model
    for saved in (ckpt / "tokenizer", run_dir / "tokenizer"):
        if (saved / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(saved))
    if m.tokenizer:
        return load_tokenizer(m.tokenizer, m.lowercase, cfg.data.max_seq_length)
    if m.source == "pretrained":
        try:
            return AutoTokenizer.from_pretrained(m.name_or_path)
        except (OSError, ValueError) as exc:
            raise InputError(unreachable_model_message(m.name_or_path, "tokenizer")) from exc
    raise InputError(f"checkpoint {ckpt} has no tokenizer/ and {run_dir}/tokenizer is missing: "
                     f"the vocabulary the model learned is gone; use the run's hf_model/ "
                     f"(--checkpoint {run_dir}/hf_model)")


def _training_label_names(cfg, run_dir: Path) -> list:
    """The label (tag) names as training numbered them, from the run's training data."""
    from rapidformer.models.head_labels import head_labels

    if cfg.task.name == "sequence_classification":
        from rapidformer.data.text_classification import load_classification_data

        return load_classification_data(cfg.data, run_dir, cfg.task.num_labels,
                                        head_labels(cfg.model)).label_names
    from rapidformer.data.token_labels import load_token_data

    return load_token_data(cfg.data, run_dir, cfg.task.num_labels,
                           head=head_labels(cfg.model)).names


def from_checkpoint(ckpt: Path, cfg, run_dir: Path):
    """(model, tokenizer, what it is): the run's model class and shape with the checkpoint's
    weights. The class, shape and label names come from the run's hf_model/config.json when it
    has one, else from its config (and the label names from its training data)."""
    import transformers

    from rapidformer.data.tokenizers import unreachable_model_message
    from rapidformer.models.hf import build_task_model

    task = cfg.task.name
    state, saved = restore.checkpoint_weights(ckpt)
    tokenizer = _tokenizer(ckpt, cfg, run_dir)
    exported = run_dir / "hf_model" / "config.json"
    labels = {}
    if task in CLASSIFIERS and not exported.is_file():
        names = _training_label_names(cfg, run_dir)
        heads = [v.shape[0] for k, v in state.items()
                 if k.endswith(("classifier.weight", "score.weight"))]
        labels = {"num_labels": heads[0] if heads else len(names)}
        if names:
            labels.update(id2label=dict(enumerate(names)),
                          label2id={n: i for i, n in enumerate(names)})
    if exported.is_file():
        model = _auto_class(task).from_config(
            transformers.AutoConfig.from_pretrained(str(exported.parent)))
    elif cfg.model.source == "pretrained":
        try:
            config = transformers.AutoConfig.from_pretrained(cfg.model.name_or_path, **labels)
        except (OSError, ValueError) as exc:
            raise InputError(unreachable_model_message(cfg.model.name_or_path)) from exc
        model = _auto_class(task).from_config(config)
    else:
        model = build_task_model(cfg.model, task, tokenizer, **labels)
    restore.load_weights(model, state, ckpt)
    if task in CLASSIFIERS:  # as training made them: a decoder pads with its EOS (data/tokenizers)
        from rapidformer.data.tokenizers import pad_id_into, ready_to_pad

        pad_id_into(model.config, ready_to_pad(tokenizer))
    return model, tokenizer, f"{ckpt} (step {saved.step})"


# what a run keeps at the top of its directory: predict never writes over them
RUN_RECORDS = ("config.yaml", "environment.json", ".hydra", "checkpoints", "data", ".lock",
               "rapidformer.log")


def _same_file(a: Path, b: Path) -> bool:
    """`a` and `b` are one file, by any path or link (or would be: one does not exist yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _within(path: Path, place: Path) -> bool:
    return _same_file(path, place) or place.resolve() in path.resolve().parents


def _run_start_folder(run_dir: Path) -> Path | None:
    """The folder the run was started in (Hydra's record): its relative paths are from there."""
    try:
        hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text()) or {}
        return Path(hydra["hydra"]["runtime"]["cwd"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def run_file_problem(output_path: Path, run_dir: Path, cfg) -> str | None:
    """Why `output_path` is a file of the run's that predict must never replace, even with
    --overwrite: its data (under data.path, from the folder the run started in or this one;
    generated data under RUN_DIR/data) or a record or output of the run (config.yaml,
    checkpoints/, hf_model/, metrics.jsonl, ...); or None."""
    from rapidformer.checkpoint.run_dir import RUN_MARKER, RUN_OUTPUTS

    given = cfg.data.path
    if not given and cfg.data.source == "synthetic":
        given = str(run_dir.absolute() / "data")  # generated there
    if given:
        folders = [f for f in (_run_start_folder(run_dir), Path.cwd()) if f is not None]
        places = [Path(given)] if Path(given).is_absolute() else [f / given for f in folders]
        for place in places:
            if place.exists() and _within(output_path, place):
                named = given if Path(given) == place else f"{given}, {place}"
                return (f"--output {output_path} is one of the run's data files (data.path="
                        f"{named}): predict never writes over the data a run read, not even "
                        f"with --overwrite")
    for name in (*RUN_RECORDS, *RUN_OUTPUTS, RUN_MARKER):
        if (run_dir / name).exists() and _within(output_path, run_dir / name):
            what = name if _same_file(output_path, run_dir / name) else f"inside {name}/"
            return (f"--output {output_path} is {what} of the run {run_dir}, which the run "
                    f"keeps: predict never writes there, not even with --overwrite")
    return None


def output_problem(input_path: Path, output_path: Path, run_dir: Path, cfg,
                   overwrite: bool) -> str | None:
    """Why predict must not write `output_path`, or None: the input (by any path or link), a
    file of the run's (`run_file_problem`), or, without --overwrite, any file that exists."""
    if _same_file(output_path, input_path):
        return (f"--output {output_path} is the input file; nothing was written: give --output "
                f"another path (the input is never overwritten, not even with --overwrite)")
    problem = run_file_problem(output_path, run_dir, cfg)
    if problem:
        return f"{problem}; nothing was written: give --output another path"
    if not overwrite and (output_path.exists() or output_path.is_symlink()):
        return (f"--output {output_path} exists; nothing was written: give --output another "
                f"path, or add --overwrite to replace it")
    return None


def predict(run_dir: Path, input_path: Path, output_path: Path, choice: str | None = None,
            batch_size: int | None = None, device: str | None = None, top_k: int = 5,
            max_new_tokens: int | None = None, num_beams: int | None = None,
            overwrite: bool = False) -> tuple[int, str]:
    """(rows written, the model used). The output is written whole or not at all (a temporary
    file in its folder, renamed), never over the input or a file of the run's, and over any
    other existing file only with `overwrite`."""
    import torch

    from rapidformer.planning.run_plan import pick_device

    cfg = restore.one_process_config(restore.run_config(run_dir), run_dir)
    require_served("predict", cfg.task.name, run_dir)
    wanted = predictors.input_columns(cfg)
    fmt = row_files.format_of(input_path, "--input")
    if row_files.format_of(output_path, "--output") != fmt:
        raise InputError(f"--output {output_path}: predictions are written in the input's "
                         f"format ({fmt}); give --output a .{fmt} name")
    problem = output_problem(input_path, output_path, run_dir, cfg, overwrite)
    if problem:
        raise InputError(problem)
    rows, lines, columns = row_files.read_rows(input_path, cfg.data.quoting)
    row_files.require(input_path, rows, lines, columns, wanted)
    clashes = [c for c in predictors.OUTPUT_COLUMNS[cfg.task.name] if c in columns]
    if clashes:
        raise InputError(f"{input_path} has the column(s) {', '.join(clashes)}, which predict "
                         f"writes for task={cfg.task.name}; rename them in the input")
    chosen = Path(choice) if choice not in (None, restore.LAST, restore.BEST) else None
    if chosen is not None and (chosen / "config.json").is_file():
        model, tokenizer, used = from_export(chosen, cfg.task.name)
    else:
        model, tokenizer, used = from_checkpoint(restore.choose_checkpoint(run_dir, choice),
                                                 cfg, run_dir)
    target = pick_device(device or cfg.trainer.device)
    model.to(target).eval()
    job = predictors.Predicting(model, tokenizer, cfg, target,
                                batch_size or cfg.trainer.eval_micro_batch_size or
                                cfg.trainer.micro_batch_size,
                                label_names_of(model.config), top_k, max_new_tokens, num_beams)
    task = cfg.task.name
    with torch.inference_mode():
        if task == "token_classification":
            places = [f"{input_path}:{line}" for line in lines]
            predicted = predictors.token_classification(job, rows, places)
        else:
            predicted = getattr(predictors, task)(job, rows)
    row_files.write_rows(output_path, fmt, [{**row, **new} for row, new in zip(rows, predicted)])
    return len(rows), used


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def predict_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer predict",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run's directory")
    parser.add_argument("--input", type=Path, required=True, help="a .jsonl, .csv or .tsv file")
    parser.add_argument("--output", type=Path, required=True,
                        help="where the rows go (the input's format)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --output when it exists (never the input, nor a data "
                             "file or record of the run)")
    parser.add_argument("--checkpoint", default=restore.LAST,
                        help="last (default), best, a step_NNNNNNNN directory, or a Hugging Face "
                             "directory the run exported (RUN_DIR/hf_model)")
    parser.add_argument("--batch-size", type=_positive,
                        help="rows per forward pass (default trainer.eval_micro_batch_size, "
                             "else trainer.micro_batch_size)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="default: the run's trainer.device")
    parser.add_argument("--top-k", type=_positive, default=5,
                        help="masked_lm: tokens shown for each mask (default 5)")
    parser.add_argument("--max-new-tokens", type=_positive,
                        help="seq2seq_lm: new tokens at most (default task.max_target_length)")
    parser.add_argument("--num-beams", type=_positive,
                        help="seq2seq_lm: beam search width (default task.num_beams)")
    args = parser.parse_args(argv)
    try:
        count, used = predict(args.run_dir, args.input, args.output, args.checkpoint,
                              args.batch_size, args.device, args.top_k, args.max_new_tokens,
                              args.num_beams, args.overwrite)
    except OSError as exc:  # a RapidformerError is reported by run_verb
        print(f"rapidformer: error: cannot write {exc.filename or args.output}: "
              f"{exc.strerror or exc}; give --output a path in a writable directory",
              file=sys.stderr)
        return EXIT_WRITE_FAILED
    print(f"wrote {count} predictions to {args.output} (model: {used})")
    return 0
