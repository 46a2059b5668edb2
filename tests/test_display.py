"""What a user sees: log lines above the progress bar, the compile lines, the end-of-run
summary, integer metrics, plot labels, file modes, one parameter count, `rapidformer --help`.
In-process and small: one tiny training run, the rest unit-level."""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.conftest import FAST


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cfg(*overrides: str):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    return settle(compose(list(overrides)))[1]


# --- one real run: the summary, the modes of what it wrote, its parameter count ----------------

RUN = [*FAST, "data.synthetic_train_size=64", "data.synthetic_eval_size=32",
       "trainer.train_iters=2", "trainer.eval_interval=1", "trainer.save_interval=1",
       "trainer.keep_last=1", "trainer.best_metric=validation/loss"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The quickstart for 2 steps, evaluating and saving after each: (run dir, stderr, log)."""
    from rapidformer import __main__ as module_main

    run_dir = tmp_path_factory.mktemp("display") / "run"
    previous = os.umask(0o022)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep(level=logging.INFO)
    logging.getLogger("rapidformer").addHandler(keep)
    stderr, captured = sys.stderr, _Tee(sys.stderr)
    sys.stderr = captured
    try:
        module_main.main([*RUN, f"trainer.output_dir={run_dir}"])
    finally:
        sys.stderr = stderr
        os.umask(previous)
        logging.getLogger("rapidformer").removeHandler(keep)
    return run_dir, captured.text(), records


class _Tee:
    """stderr as it was, and a copy (capsys cannot span a module-scoped fixture)."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.parts)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _summary(stderr: str, run_dir: Path) -> dict[str, str]:
    """The summary's rows by name (the lines after `rapidformer: run finished: RUN_DIR`)."""
    lines = stderr.splitlines()
    start = lines.index(f"rapidformer: run finished: {run_dir}")
    rows = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        name, value = re.match(r"  (\S+(?: best)?)\s{2,}(.*)", line).groups()
        rows[name] = value
    return rows


def test_a_megatron_run_s_summary_offers_no_export_command_it_would_refuse(finished_run,
                                                                          tmp_path):
    import shutil

    from rapidformer.cli.summary import summary_lines

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run[0], run_dir)
    assert any(line.split()[0] == "export" for line in summary_lines(run_dir))
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    ran["model"]["arch"] = "megatron_llama"  # its checkpoints export only at the run's end
    (run_dir / "config.yaml").write_text(yaml.safe_dump(ran))
    names = [line.split()[0] for line in summary_lines(run_dir)[1:]]
    assert "export" not in names and "resume" in names


def test_the_summary_names_the_checkpoints_and_a_resume_command_that_composes(finished_run):
    from rapidformer.checkpoint import store as checkpoint
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    run_dir, stderr, _ = finished_run
    rows = _summary(stderr, run_dir)
    assert 8 <= len(rows) + 1 <= 12
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in records if "validation/loss" in r][-1]
    assert rows["final"].startswith("step 2: loss ")
    assert f"validation/loss={last_eval['validation/loss']:.4f}" in rows["final"]
    losses = {r["step"]: r["validation/loss"] for r in records if "validation/loss" in r}
    best_step = min(losses, key=losses.get)
    assert f"validation/loss={losses[best_step]:.4f} (step {best_step})" in rows["best"]

    newest = checkpoint.newest_complete(run_dir / "checkpoints")
    assert newest.name == "step_00000002" and rows["newest"] == str(newest)
    marker = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    kept = run_dir / "checkpoints" / f"step_{marker['step']:08d}"
    assert rows["kept best"].endswith(f"at step {marker['step']}: {kept}") and kept.is_dir()
    assert rows["exported"] == str(run_dir / "hf_model")
    assert rows["export"] == f"rapidformer export {run_dir} --to DIR"

    command = shlex.split(rows["resume"])
    assert command[:3] == ["python", "-m", "rapidformer"]
    assert command[-2:] == [f"trainer.output_dir={run_dir}", "trainer.resume=auto"]
    overrides = command[3:]
    assert not any("output_dir" in o for o in overrides[:-2])  # the run's own one replaced
    resolved, _ = settle(compose(overrides, default_recipe=False), str(run_dir))
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["trainer"]["resume"] == "auto"
    assert resolved["trainer"]["output_dir"] == str(run_dir)
    for key in ("train_iters", "micro_batch_size", "best_metric", "eval_interval"):
        assert resolved["trainer"][key] == ran["trainer"][key], key
    assert resolved["data"] == ran["data"] and resolved["model"] == ran["model"]


def test_written_files_have_the_modes_of_a_plain_open_under_umask_022(finished_run):
    run_dir = finished_run[0]
    exported = sorted((run_dir / "hf_model").iterdir())
    assert "model.safetensors" in [p.name for p in exported]
    checkpoints = [p for p in (run_dir / "checkpoints").rglob("*")]
    assert checkpoints
    for path in [*exported, *checkpoints]:
        assert _mode(path) == (0o755 if path.is_dir() else 0o644), path
    assert _mode(run_dir / "hf_model") == 0o755


def test_the_run_logs_the_count_the_plan_gives_and_integer_metrics_as_integers(finished_run):
    from rapidformer.planning.model_shape import model_shape

    run_dir, _, log_lines = finished_run
    logged = [line for line in log_lines if line.startswith("model parameters: ")]
    assert len(logged) == 1
    count = int(logged[0].split()[2].replace(",", ""))
    assert count == model_shape(_cfg(*RUN)).parameters
    evals = [line for line in log_lines if line.startswith("eval at step ")]
    assert len(evals) == 2 and "validation/loss=" in evals[0]
    assert not re.search(r"=\d+\.0000\b", " ".join(evals))


def test_export_verb_writes_0644_files_under_umask_022(finished_run, tmp_path, umask_022):
    from rapidformer.cli.verbs.export import export

    out = export(finished_run[0], tmp_path / "exported")
    assert _mode(out) == 0o755
    for path in out.iterdir():
        assert _mode(path) == 0o644, path


# --- file modes, unit-level ---------------------------------------------------------------------

def test_a_checkpoint_of_private_temp_files_is_sealed_with_the_umask_modes(tmp_path):
    from safetensors.torch import save_file

    from rapidformer.checkpoint import store as checkpoint

    def extra(directory: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(directory / "adapter.safetensors"))
        assert _mode(directory / "adapter.safetensors") == 0o600  # what safetensors does

    previous = os.umask(0o027)
    try:
        final = checkpoint.save(tmp_path / "checkpoints", 1, {"model.pt": {"w": torch.ones(1)}},
                                {"step": 1}, extra)
    finally:
        os.umask(previous)
    assert _mode(final) == 0o750
    for name in ("adapter.safetensors", "model.pt", "state.json", checkpoint.MANIFEST):
        assert _mode(final / name) == 0o640, name
    assert checkpoint.verify(final) == []  # the modes are set before the files are hashed


def test_eval_and_predict_outputs_follow_the_umask(tmp_path):
    from rapidformer.cli.verbs.evaluate import write_json
    from rapidformer.inference.rows import write_rows

    previous = os.umask(0o027)
    try:
        write_json(tmp_path / "scores.json", {"validation/accuracy": 1.0})
        write_rows(tmp_path / "predictions.jsonl", "jsonl", [{"label": 1}])
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "scores.json") == _mode(tmp_path / "predictions.jsonl") == 0o640


def test_the_umask_is_read_without_being_changed():
    from rapidformer.file_modes import current_umask

    previous = os.umask(0o037)
    try:
        assert current_umask() == 0o037
        assert os.umask(0o037) == 0o037
    finally:
        os.umask(previous)


# --- one parameter count ------------------------------------------------------------------------

def _built_like_training(cfg, run_dir: Path) -> torch.nn.Module:
    """The model a run of `cfg` builds: the task's own providers, on an engine's attributes."""
    from rapidformer.config.schema import PRETRAINING_TASKS
    from rapidformer.tasks import task_class

    from rapidformer.transforms import Transforms

    engine = SimpleNamespace(cfg=cfg, run_dir=run_dir, resume_checkpoint=None, rank=0,
                             world_size=1, device=torch.device("cpu"), is_main_process=True,
                             transforms=Transforms(cfg))
    task = task_class(cfg.task.name)(engine=engine)
    if cfg.task.name not in PRETRAINING_TASKS:  # a fine-tuning task's vocabulary: its texts
        task.train_valid_test_datasets_provider()
    return task.model_optimizer_lr_scheduler_provider()[0]


@pytest.mark.parametrize("overrides", [
    ["model=bert_tiny", "data.synthetic_train_size=200"],
    ["+recipe=t5_summarize", "model=t5_tiny", "data=synthetic", "data.synthetic_train_size=64",
     "data.synthetic_eval_size=16"],
    ["model=bert_tiny", "model.tokenizer=VOCAB", "data.synthetic_train_size=64"],
], ids=["bert_tiny", "t5_tiny", "given_vocab"])
def test_the_plan_counts_what_training_builds(overrides, tmp_path):
    from rapidformer.data.tokenizers import SPECIAL_TOKENS
    from rapidformer.planning.model_shape import model_shape

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL_TOKENS, *"abcdefghij"]) + "\n")
    cfg = _cfg(*(o.replace("VOCAB", str(vocab)) for o in overrides))
    model = _built_like_training(cfg, tmp_path / "run")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # what a run logs
    assert model_shape(cfg).parameters == trained == sum(p.numel() for p in model.parameters())
    assert model_shape(cfg).vocab < cfg.model.vocab_size  # the texts' words, not the setting


def test_the_plan_counts_gpt2_tiny_with_its_tied_head_once(tmp_path):
    from rapidformer.data.corpus import iter_documents, write_gpt2_bpe
    from rapidformer.planning.model_shape import model_shape

    vocab, merges = write_gpt2_bpe(list(iter_documents(60, seed=3)), tmp_path / "gpt2",
                                   vocab_size=300)
    cfg = _cfg("+recipe=gpt_pretrain", "model=gpt2_tiny", f"data.path={tmp_path / 'none'}",
               "model.tokenizer_type=GPT2BPETokenizer", f"model.tokenizer={vocab}",
               f"model.merge_file={merges}", "data.max_seq_length=128")
    model = _built_like_training(cfg, tmp_path / "run")
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding  # tied: one tensor, counted once
    assert model_shape(cfg).parameters == sum(p.numel() for p in model.parameters())


# --- formatting, plots, help --------------------------------------------------------------------

def test_counts_print_as_integers_and_other_values_with_four_decimals():
    from rapidformer.observability.format import format_metrics, format_value

    assert format_metrics({"validation/seen": 400.0, "validation/loss": 0.693147,
                           "validation/correct": 7}) == \
        "validation/seen=400, validation/loss=0.6931, validation/correct=7"
    assert format_value(float("nan")) == "nan" and format_value(2.5) == "2.5000"


def test_the_sweep_table_prints_a_count_metric_as_an_integer():
    from rapidformer.cli.multirun import summary_table

    row = {"job": 0, "overrides": "a=1", "status": "ok", "error": None, "final_loss": 0.5,
           "metric": "validation/seen", "value": 400.0, "samples_per_s": 3.0}
    assert summary_table([row]).splitlines()[-1] == \
        "| 0 | a=1 | ok | 0.5000 | validation/seen=400 | 3.0 |"


def test_every_plot_names_its_metric(tmp_path, monkeypatch):
    import matplotlib.figure

    from rapidformer.cli.verbs.plot import plot_runs

    for name, metric in (("a", "validation/accuracy"), ("b", "validation/loss")):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "tokens_per_s": 100.0 * s}
                for s in (1, 2)] + [{"step": 2, metric: 0.5}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = {}

    def savefig(fig, path, **kwargs):
        ax = fig.axes[0]
        labels[Path(path).name] = (ax.get_ylabel(), ax.get_title())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "plots")
    assert labels["eval.png"][0] == "validation/accuracy, validation/loss"
    assert labels["loss.png"][0] == "training loss (loss)"
    assert labels["throughput.png"][0] == "throughput (tokens_per_s)"
    assert labels["lr.png"][0] == "learning rate (lr)"
    for ylabel, title in labels.values():
        assert title == f"{ylabel} by step"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_verb_the_seed_flags_and_the_override_syntax(flag, capsys):
    from rapidformer.cli.console import SWITCHES, VALUE_FLAGS, main
    from rapidformer.cli.verbs import VERBS

    main([flag])  # returns: exit code 0
    out = capsys.readouterr().out
    for name, (_, line) in VERBS.items():
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(line)}$", out, re.MULTILINE), name
    assert f"--micro-batch-size 16             -> {VALUE_FLAGS['--micro-batch-size']}=16" in out
    assert f"-> {SWITCHES['--mixed-precision']}" in out
    for text in ("docs/seed_flags.md", "group=option", "key=value", "+recipe=NAME", "-m ",
                 "--cfg job", "--hydra-help", "python -m rapidformer --help", "rapidformer ls",
                 "docs/"):
        assert text in out, text


# --- the console while a bar is drawn, and the compile lines ------------------------------------

def test_log_lines_are_written_above_the_bar_and_the_handlers_come_back(capsys):
    from tqdm import tqdm

    from rapidformer.observability.console import logs_through

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # capsys's stderr: a console stream
    console.setFormatter(logging.Formatter("[fmt] %(message)s"))
    before, level = list(root.handlers), root.level
    root.addHandler(console)
    root.setLevel(logging.INFO)
    try:
        bar = tqdm(total=3, file=sys.stderr, desc="train", mininterval=0)
        with logs_through(bar):
            bar.update(1)
            logging.getLogger("rapidformer").info("one line")
            assert console not in root.handlers
        bar.close()
        assert root.handlers == [*before, console]
    finally:
        root.removeHandler(console)
        root.setLevel(level)
    err = capsys.readouterr().err
    line = next(part for part in err.split("\n") if "one line" in part)
    # the bar was cleared (carriage return, blanks, carriage return) before the line was written
    assert re.fullmatch(r".*\r *\r\[fmt\] one line", line), repr(line)
    assert "train:" not in line.rsplit("\r", 1)[-1]


def test_a_disabled_bar_leaves_the_handlers_alone():
    from tqdm import tqdm

    from rapidformer.observability.console import logs_through

    root = logging.getLogger()
    before = list(root.handlers)
    with logs_through(tqdm(total=1, disable=True)):
        assert root.handlers == before


def test_compile_lines_time_the_first_step_and_evaluation_and_count_recompiles(caplog):
    from rapidformer.observability.compile_log import CompileLog

    torch._dynamo.reset()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)),
                          backend="eager", dynamic=False)
    log = CompileLog.attach(model, enabled=True)
    with caplog.at_level(logging.INFO, logger="rapidformer"):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            log.step_done()
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
        model.train()
        model(torch.randn(3, 4)).sum().backward()  # a new shape: a recompile
        log.step_done()
        log.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "graph=compile: compiling (first step)..."
    assert re.fullmatch(r"graph=compile: first step compiled and ran in \d+\.\d s", lines[1])
    assert lines[2] == "graph=compile: compiling (first evaluation)..."
    assert re.fullmatch(r"graph=compile: first evaluation batch compiled and ran in \d+\.\d s",
                        lines[3])
    assert re.fullmatch(r"graph=compile: (\d+) graphs compiled, 1 of them after the first step "
                        r"and evaluation \(recompiles; TORCH_LOGS=recompiles says why\)", lines[4])
    assert len(lines) == 5
    assert not log.handles  # both phases seen: the hooks are gone


def test_no_compile_lines_without_graph_compile(caplog):
    from rapidformer.observability.compile_log import CompileLog

    model = torch.nn.Linear(2, 1)
    log = CompileLog.attach(model, enabled=False)
    with caplog.at_level(logging.INFO, logger="rapidformer"):
        model(torch.randn(1, 2))
        log.step_done()
        log.finish()
    assert not caplog.records and not model._forward_pre_hooks
