"""Review of issue 35 (everyday use, round 3), held-out cases: the paths a run's config took
from a recipe (not the command line) and a Megatron data prefix, anchored in the folder the run
started in for the printed resume line and for eval and export run elsewhere; a local model=hf
folder given relatively, exported from elsewhere; -h/--help of the verbs that take a training
command's arguments; no library progress bars in a run with trainer.progress_bar=false."""
from __future__ import annotations

import shlex
import shutil

import pytest
import yaml

from tests.conftest import FAST, assert_ok, run_cli
from tests.test_everyday_round3 import _as_printed, _printed

RECIPE = """# @package _global_
defaults:
  - override /data: pairs_local
recipe: my_pairs
data:
  path: data
"""


def test_a_recipes_relative_data_path_is_found_by_the_printed_lines(tmp_path, pairs_dir):
    """A recipe of one's own (--config-dir) names data.path relatively; the run started in its
    project folder prints a resume line that trains on from another folder, and eval there reads
    the same data; the run shows no library progress bar (trainer.progress_bar=false)."""
    start, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (start / "my_configs" / "recipe").mkdir(parents=True)
    elsewhere.mkdir()
    (start / "my_configs" / "recipe" / "my_pairs.yaml").write_text(RECIPE)
    shutil.copytree(pairs_dir, start / "data")
    first = assert_ok(run_cli(["--config-dir", "my_configs", "+recipe=my_pairs",
                               "trainer.output_dir=runs/a",
                               *[o for o in FAST if "synthetic" not in o and "epochs" not in o],
                               "trainer.epochs=null", "trainer.train_iters=2"], cwd=start))
    for bar in ("Map:", "Writing model shards", "Loading weights"):
        assert bar not in first.stderr, first.stderr[-2000:]
    resume = _printed(first.stderr, "resume")
    assert f"++data.path={start / 'data'}" in shlex.split(resume), resume

    more = assert_ok(_as_printed(f"{resume} trainer.train_iters=3", elsewhere))
    assert "run finished" in more.stderr, more.stderr[-2000:]
    scored = assert_ok(_as_printed(f"rapidformer eval {start / 'runs' / 'a'}", elsewhere))
    assert "validation/accuracy" in scored.stdout, scored.stdout + scored.stderr
    assert "Loading weights" not in scored.stderr


def test_a_megatron_prefix_is_made_absolute_in_the_resume_line(tmp_path):
    """data.path of Megatron data is a prefix (DIR/corpus_text_document): no file of that name,
    its .bin and .idx beside; the resume line names it absolutely, and a recipe's prefix too."""
    from rapidformer.cli.summary import resume_command

    start, run = tmp_path / "project", tmp_path / "project" / "runs" / "gpt"
    (start / "pt").mkdir(parents=True)
    for ext in (".bin", ".idx"):
        (start / "pt" / f"gpt_text_document{ext}").write_bytes(b"")
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
        {"hydra": {"runtime": {"cwd": str(start)}}}))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
        ["task=causal_lm", "data=megatron", "data.path=pt/gpt_text_document",
         "model.name_or_path=pt/nothing_here"]))
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"task": {"name": "causal_lm"}, "data": {"path": "pt/gpt_text_document"}}))
    line = shlex.split(resume_command(run))
    assert f"data.path={start / 'pt' / 'gpt_text_document'}" in line, line
    # a value naming nothing there stays as given
    assert "model.name_or_path=pt/nothing_here" in line, line

    # the same prefix from a recipe: added as an override of its own
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+recipe=gpt_pretrain"]))
    line = shlex.split(resume_command(run))
    assert f"++data.path={start / 'pt' / 'gpt_text_document'}" in line, line


def test_export_of_a_relative_local_model_from_elsewhere(tmp_path, tiny_pretrained, monkeypatch,
                                                         capsys):
    """model=hf model.name_or_path=RELATIVE: `rapidformer export RUN --to DIR` from another
    folder builds the model from the folder the run started in (a traceback, exit 1, before)."""
    from rapidformer.cli.hydra_main import main
    from rapidformer.cli.verbs import run_verb

    start, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    shutil.copytree(tiny_pretrained, start / "local_bert")
    monkeypatch.chdir(start)
    main(["model=hf", "model.name_or_path=local_bert", "trainer.output_dir=runs/a",
          "trainer.export_hf=false", *[o for o in FAST if "epochs" not in o],
          "trainer.epochs=null", "trainer.train_iters=1", "data.num_workers=0"])
    capsys.readouterr()
    monkeypatch.chdir(elsewhere)
    assert run_verb("export", [str(start / "runs" / "a"), "--to", "exported"]) == 0, \
        capsys.readouterr()
    assert (elsewhere / "exported" / "config.json").is_file()


@pytest.mark.parametrize("verb", ["show", "validate", "plan", "env"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_verbs_of_a_training_commands_arguments_have_help(verb, flag, capsys):
    """`rapidformer plan --help` printed a plan (validate: ok, show: the config): the flag was
    taken for a seed flag and dropped. Now each prints its usage and exits 0."""
    from rapidformer.cli.verbs import run_verb

    assert run_verb(verb, [flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rapidformer {verb}"), out
    assert "ok:" not in out and "task:" not in out and "versions:" not in out
