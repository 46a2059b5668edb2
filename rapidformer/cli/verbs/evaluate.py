"""`rapidformer eval RUN_DIR [--checkpoint last|best|PATH] [--output FILE] [overrides ...]`: the
metrics of a checkpoint on the run's validation split (and its test split, when labelled), or on
other data that overrides name (`data.path=DIR`, `data.validation_file=FILE`, ...).

The run's resolved config.yaml, with the overrides checked as a training command's, builds the
task's data and model as training does; the checkpoint's weights (any memory mode, consolidated
in this process) are loaded and the task's own `run_compute_metrics` scores them, so the numbers
are the training log's for the same checkpoint. Nothing is trained, claimed or checkpointed; the
metrics are printed and written as JSON (default RUN_DIR/eval/step_NNNNNNNN.json).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from rapidformer.errors import EXIT_WRITE_FAILED, InputError
from rapidformer.observability.format import format_value
from rapidformer.file_modes import honour_umask
from rapidformer.inference import restore
from rapidformer.inference.served import require_served


def plain_number(value):
    """A metric as JSON shows it: ints stay ints (counts), everything else a float."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    return float(value)


def evaluate(run_dir: Path, choice: str | None = None, overrides: list[str] = ()) -> dict:
    """{"checkpoint", "step", "overrides", "metrics": {split/metric: value}}."""
    import datasets
    import torch

    from rapidformer.engine import RapidformerEngine
    from rapidformer.observability.quiet import library_bars
    from rapidformer.planning.run_plan import RunPlan
    from rapidformer.tasks import task_class

    plain = restore.with_overrides(restore.run_config(run_dir), list(overrides), "eval")
    cfg = restore.one_process_config(plain, run_dir)
    require_served("eval", cfg.task.name, run_dir)
    ckpt = restore.choose_checkpoint(run_dir, choice)
    state, saved = restore.checkpoint_weights(ckpt)
    datasets.disable_progress_bars()
    library_bars(False)  # the metrics are the verb's output
    engine = RapidformerEngine(cfg, run_dir, plan=RunPlan.for_process(cfg))
    # the tokenizer saved with the checkpoint, as a resumed run uses it (a trained vocabulary
    # must be the one the weights learned)
    engine.resume_checkpoint = ckpt
    finetuner = task_class(cfg.task.name)(engine=engine)
    _, valid_ds, test_ds, collate_fn = finetuner.train_valid_test_datasets_provider()
    from rapidformer.checkpoint import reading

    reading.require_present(ckpt, "rapidformer eval")  # the tokenizer read was its own
    model, _, _ = finetuner.model_optimizer_lr_scheduler_provider()
    restore.load_weights(model, state, ckpt)
    model, _, _ = engine.compose(model, total_iters=1)
    splits = [("validation", valid_ds)]
    if test_ds is not None and len(test_ds) and finetuner.test_is_labelled(test_ds):
        splits.append(("test", test_ds))
    metrics = {}
    model.eval()
    for name, ds in splits:
        if ds is None or not len(ds):
            continue
        loader = finetuner.build_data_loader(ds, collate_fn=collate_fn)
        # what Finetuner.evaluate does in the loop, keeping the metrics' own number types
        with torch.no_grad(), engine.autocast():
            scores = finetuner.run_compute_metrics([model], loader)
        metrics.update({f"{name}/{k}": plain_number(v) for k, v in dict(scores).items()})
    if not metrics:
        raise InputError(f"the data of {run_dir}'s config (with these overrides) has no "
                         f"validation split and no labelled test split to score; name one, "
                         f"e.g. data.validation_file=FILE")
    return {"checkpoint": str(ckpt), "step": saved.step, "overrides": list(overrides),
            "metrics": metrics}


def default_output(run_dir: Path, ckpt: Path, overrides: list[str]) -> Path:
    """RUN_DIR/eval/step_NNNNNNNN.json; other data (overrides) gets a name of its own, so that
    scoring it does not replace the run's own scores."""
    name = ckpt.name
    if overrides:
        name += "-" + hashlib.sha1("\0".join(overrides).encode()).hexdigest()[:8]
    return run_dir / "eval" / f"{name}.json"


def write_json(path: Path, record: dict) -> None:
    """Written whole or not at all (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        honour_umask(Path(tmp))  # mkstemp's file is 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def eval_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run's directory")
    parser.add_argument("--checkpoint", default=restore.LAST,
                        help="last (default: the newest complete checkpoint), best (the one "
                             "checkpoints/best.json names) or a step_NNNNNNNN directory")
    parser.add_argument("--output", type=Path,
                        help="JSON file for the metrics (default RUN_DIR/eval/step_NNNNNNNN.json)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run's config")
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.run_dir, args.checkpoint, args.overrides)
        output = args.output or default_output(args.run_dir, Path(result["checkpoint"]),
                                               args.overrides)
        write_json(output, result)
    except OSError as exc:  # a RapidformerError is reported by run_verb
        print(f"rapidformer: error: cannot write {exc.filename or args.output}: "
              f"{exc.strerror or exc}; give --output FILE in a writable directory",
              file=sys.stderr)
        return EXIT_WRITE_FAILED
    print(f"checkpoint {result['checkpoint']} (step {result['step']})")
    width = max(len(k) for k in result["metrics"])
    for key, value in result["metrics"].items():
        print(f"  {key:<{width}}  {format_value(value)}")
    print(f"wrote {output}")
    return 0
