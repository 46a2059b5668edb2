"""`rapidformer export RUN_DIR --to DIR [--step N] [--adapter-only]`: a Hugging Face
`save_pretrained` directory (fp32 weights, config, tokenizer) from a run's checkpoint, whatever
memory mode wrote it.

A run with peft=lora/qlora: the base model (read again from model.name_or_path) with the
adapters merged in, a plain Hugging Face model; or, with --adapter-only, peft's adapter
directory (adapter_config.json, adapter_model.safetensors), which
`peft.PeftModel.from_pretrained(base, DIR)` loads.

RUN_DIR is a run directory (its newest complete checkpoint, or --step N) or one
`checkpoints/step_NNNNNNNN` directory. Runs on one CPU process: ZeRO shards are consolidated
with DeepSpeed's zero_to_fp32, FSDP2's sharded checkpoint is read with torch's DCP converter.
DIR must not exist yet; it appears complete or not at all.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from rapidformer.checkpoint import reading, store
from rapidformer.checkpoint.state import CheckpointState, read_state
from rapidformer.accelerators.table import checkpoint_weights as weights
from rapidformer.config.schema import PRETRAINING_TASKS
from rapidformer.errors import InputError, RapidformerError
from rapidformer.file_modes import honour_umask

def locate(path: Path, step: int | None) -> tuple[Path, Path]:
    """(checkpoint directory, run directory)."""
    if store.NAME.match(path.name):
        ckpt, run_dir = path, path.parent.parent
        problems = store.verify(ckpt)
    else:
        run_dir = path
        if step is None:
            ckpt, problems = reading.newest_verified(path / "checkpoints")
        else:
            ckpt = path / "checkpoints" / f"step_{step:08d}"
            ckpt, problems = (ckpt, store.verify(ckpt)) if store.is_complete(ckpt) else (None, [])
        if ckpt is None:
            which = f"step {step}" if step is not None else "any step"
            raise InputError(f"{path}: no complete checkpoint of {which} under {path}/checkpoints; "
                             f"give a run directory (trainer.output_dir) or a step_NNNNNNNN "
                             f"directory")
    reading.require_intact(ckpt, problems, "rapidformer export")
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}/config.yaml is missing: export needs the run's resolved "
                         f"config next to its checkpoints")
    return ckpt, run_dir


def _rows(state: dict, *suffixes: str) -> int | None:
    return next((v.shape[0] for k, v in state.items() if k.endswith(suffixes)), None)


def _as_trained(config, cfg, state: dict, tokenizer, run_dir: Path) -> None:
    """A pretrained config as the run's classifier had it: its head's rows and label names, and
    a decoder's padding id (data/tokenizers.ready_to_pad)."""
    if cfg.task.name not in ("sequence_classification", "token_classification"):
        return
    rows = _rows(state, "classifier.weight", "score.weight")
    if rows is not None and rows != config.num_labels:
        config.num_labels = rows
    from rapidformer.cli.verbs.predict import _training_label_names
    from rapidformer.data.tokenizers import pad_id_into

    try:
        names = _training_label_names(cfg, run_dir)
    except RapidformerError:  # the training data is gone: the names stay the config's
        names = []
    if len(names) == config.num_labels:
        config.id2label = dict(enumerate(names))
        config.label2id = {name: i for i, name in enumerate(names)}
    pad_id_into(config, tokenizer)


def skeleton(cfg, state: dict, tokenizer, run_dir: Path):
    """The run's Hugging Face model class and shape, on the CPU, to load the weights into."""
    from rapidformer.planning.model_shape import _VocabOnly
    from rapidformer.models import hf

    exported = run_dir / "hf_model" / "config.json"
    if exported.is_file() or cfg.model.source == "pretrained":
        import transformers

        config = transformers.AutoConfig.from_pretrained(
            str(exported.parent) if exported.is_file() else cfg.model.name_or_path)
        if not exported.is_file() and cfg.task.name in hf.AUTO_CLASSES:
            # the task's class on the checkpoint of a base model (a GPT-2 LM fine-tuned as a
            # classifier), its head as the run made it (a head of another size starts anew)
            _as_trained(config, cfg, state, tokenizer, run_dir)
            return getattr(transformers, hf.AUTO_CLASSES[cfg.task.name]).from_config(config)
        architecture = (config.architectures or [None])[0]
        if architecture is None or not hasattr(transformers, architecture):
            raise InputError(f"{exported}: no model class in its 'architectures'")
        return getattr(transformers, architecture)(config)
    vocab = _rows(state, "word_embeddings.weight", "wte.weight", "shared.weight",
                  "embed_tokens.weight")
    if vocab is None:
        raise InputError("the checkpoint has no word-embedding table: it is not a model this "
                         "export knows")
    fake = _VocabOnly(vocab)
    if tokenizer is not None:
        fake.pad_token_id = fake.hf_pad = tokenizer.pad_token_id or 0
        fake.eod = fake.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id \
            is not None else vocab - 1
    if cfg.task.name in PRETRAINING_TASKS:
        return hf.build_pretraining_model(cfg.model, cfg.task.name, fake)
    if cfg.task.name in ("sequence_classification", "token_classification"):
        labels = _rows(state, "classifier.weight", "score.weight") or cfg.task.num_labels or 2
        return hf.build_task_model(cfg.model, cfg.task.name, fake, num_labels=labels)
    return hf.build_task_model(cfg.model, cfg.task.name, fake)


def export(path: Path, out: Path, step: int | None = None, adapter_only: bool = False) -> Path:
    from transformers import AutoTokenizer

    from rapidformer.config.validate import build_run_config

    problem = out_problem(out)
    if problem:
        raise InputError(problem)
    ckpt, run_dir = locate(path, step)
    from rapidformer.config.run_paths import with_anchored_paths
    from rapidformer.observability.quiet import library_bars

    library_bars(False)  # the line naming the export is the verb's output

    # its relative paths (a local model=hf folder) are the folder's the run started in
    cfg = build_run_config(with_anchored_paths(
        yaml.safe_load((run_dir / "config.yaml").read_text()), run_dir))
    with reading.named_if_pruned(ckpt, "rapidformer export"):
        saved = read_state(ckpt)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt / "tokenizer")) \
            if (ckpt / "tokenizer").is_dir() else None
        if adapter_only:
            return _write(out, ckpt, saved, tokenizer,
                          _adapter_writer(ckpt, saved, adapter_base(cfg, run_dir)))
        state = weights(ckpt, saved)
    model = skeleton(cfg, state, tokenizer, run_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if missing or unexpected:
        raise InputError(f"{ckpt} does not match the run's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return _write(out, ckpt, saved, tokenizer, lambda tmp: model.save_pretrained(str(tmp)))


def out_problem(out: Path) -> str | None:
    """Why `--to out` cannot be the new directory an export writes, or None: it exists (a link
    too, one leading nowhere included), a folder above it is a file, or it is a place a run
    manages (its checkpoints/ directory, or an output it writes such as hf_model), where a
    resume, pruning or trainer.overwrite=true would take it for the run's and remove it."""
    from rapidformer.checkpoint.run_dir import RUN_OUTPUTS, is_run_directory

    if out.is_symlink():
        return (f"--to {out} is a symbolic link (to {os.readlink(out)}); give a new directory "
                f"(nothing is overwritten)")
    if out.exists():
        return f"--to {out} exists already; give a new directory (nothing is overwritten)"
    above = out.absolute().parent
    while not above.exists() and not above.is_symlink() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return (f"--to {out} cannot be created: {above} is "
                f"{'a symbolic link that leads nowhere' if above.is_symlink() else 'a file'}, "
                f"not a directory; give a new directory")
    resolved = out.absolute().parent.resolve() / out.name
    for folder in [resolved.parent, *resolved.parent.parents]:
        inside = resolved.relative_to(folder).parts
        if is_run_directory(folder) and (inside[0] == "checkpoints" or
                                         (len(inside) == 1 and inside[0] in RUN_OUTPUTS)):
            return (f"--to {out} is inside the run directory {folder}, at "
                    f"{'/'.join(inside)}, which the run manages (a resume, pruning or "
                    f"trainer.overwrite=true would take it for the run's own and remove it); "
                    f"give a directory outside {folder}/checkpoints and not named like the "
                    f"run's outputs")
    return None


def adapter_base(cfg, run_dir: Path) -> str:
    """Where the adapters' base is read from, for adapter_config.json's base_model_name_or_path
    (peft's AutoPeftModel* load it from there): the run's pretrained model (a local folder as an
    absolute path, a hub name as it is), or the copy a run keeps of a config-built base."""
    from rapidformer.transforms.lora import BASE_COPY

    if cfg.model.source == "pretrained":
        local = Path(cfg.model.name_or_path)
        return str(local.absolute()) if local.exists() else cfg.model.name_or_path
    return str((run_dir / BASE_COPY).absolute())


def _adapter_writer(ckpt: Path, saved: CheckpointState, base_name_or_path: str):
    record = saved.transforms.get("lora")
    if record is None:
        raise InputError(f"--adapter-only: {ckpt} holds a whole model (its run used peft=none), "
                         f"not adapters; export it without --adapter-only")
    from rapidformer.accelerators.table import stored_weights
    from rapidformer.transforms.lora_weights import write_adapter_dir

    adapter_state = stored_weights(ckpt, saved)
    return lambda tmp: write_adapter_dir(ckpt, record, adapter_state, tmp, base_name_or_path)


def _write(out: Path, ckpt: Path, saved: CheckpointState, tokenizer, write_model) -> Path:
    """`write_model(tmp)`, the tokenizer and a note of the source into a new directory that
    appears complete under `out` or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        write_model(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "rapidformer_export.json").write_text(json.dumps(
            {"checkpoint": str(ckpt.absolute()), "memory": saved.memory,
             "step": saved.step}, indent=1))
        honour_umask(tmp)  # mkdtemp's directory is 0700, safetensors' files 0600
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="run directory or step_NNNNNNNN directory")
    parser.add_argument("--to", type=Path, required=True, help="new output directory")
    parser.add_argument("--step", type=int, help="this step's checkpoint (default: newest)")
    parser.add_argument("--adapter-only", action="store_true",
                        help="peft runs: peft's adapter directory instead of the merged model")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.to, args.step, args.adapter_only)
    except RapidformerError as exc:
        print(f"rapidformer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"exported {out} (" + ("peft's adapter directory; load it with "
          "peft.PeftModel.from_pretrained(BASE_MODEL, DIR)" if args.adapter_only else
          "Hugging Face save_pretrained; load it with AutoModel*.from_pretrained") + ")")
    return 0
