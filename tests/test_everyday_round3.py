"""Everyday use, round 3: the commands rapidformer prints run as printed, from any folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, OFFLINE_ENV, assert_ok, run_cli


def _printed(stderr: str, row: str) -> str:
    line = next(line for line in stderr.splitlines() if line.startswith(f"  {row} "))
    return line[len(row) + 2:].strip()


def _as_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` through a shell, as a user pastes it: `python` and `rapidformer` are this
    environment's (its bin folder first on PATH)."""
    env = {**os.environ, **OFFLINE_ENV,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAPIDFORMER_DEBUG", None)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_printed_commands_run_from_another_folder(tmp_path):
    """A run started with --config-dir and relative paths prints resume, export and plot lines
    (and `rapidformer cp` its run line) that run from another folder as printed."""
    start, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    copied = assert_ok(run_cli(["cp", "quickstart", "my configs"], cwd=start,
                               module="rapidformer.cli"))
    cp_line = next(line.strip() for line in copied.stdout.splitlines()
                   if line.strip().startswith("python -m rapidformer"))
    assert_ok(run_cli(["--train", "64", "--eval", "32", "--seed", "3", "data"], cwd=start,
                      module="rapidformer.data.synthetic"))
    first = assert_ok(run_cli(["--config-dir", "my configs", "+recipe=my_quickstart",
                               "data=pairs_local", "data.path=data", "trainer.output_dir=runs/a",
                               *[o for o in FAST if "synthetic" not in o], "trainer.epochs=null",
                               "trainer.train_iters=4"],
                              cwd=start))
    resume, export, plot = (_printed(first.stderr, row) for row in ("resume", "export", "curves"))
    assert "--config-dir" in resume and str(start / "data") in resume, resume

    # resumed from elsewhere to a later step: the config folder and the data are found
    more = assert_ok(_as_printed(f"{resume} trainer.train_iters=6", elsewhere))
    assert "resum" in more.stderr and "run finished" in more.stderr, more.stderr[-2000:]
    steps = [line for line in (start / "runs" / "a" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(steps) == 6, steps
    assert_ok(_as_printed(export.replace(" DIR", " exported"), elsewhere))
    assert (elsewhere / "exported" / "config.json").is_file()
    assert_ok(_as_printed(plot, elsewhere))
    # the command `rapidformer cp` printed, from elsewhere, as a dry run
    shown = assert_ok(_as_printed(f"{cp_line} trainer.dry_run=true", elsewhere))
    assert "no such option" not in shown.stderr


def test_a_recipes_own_peft_settings_stay_quiet_when_the_command_picks_peft_none():
    """`+recipe=llama_lora peft=none` trains the whole model: the recipe's peft.r is its own
    choice for peft=lora, not a key the command typed; a typed one is still refused."""
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError
    from rapidformer.preflight import settle

    _, cfg = settle(compose(["+recipe=llama_lora", "peft=none", "trainer.device=cpu"]), "out")
    assert cfg.peft.name == "none"
    with pytest.raises(ConfigError, match="peft.r=8 has no effect with peft=none"):
        settle(compose(["+recipe=llama_lora", "peft=none", "peft.r=8"]), "out")


@pytest.mark.parametrize("argv, code, out, err", [
    (["lst"], 2, None, "no verb 'lst'; did you mean 'ls'?"),
    (["exprot", "RUN"], 2, None, "no verb 'exprot'; did you mean 'export'?"),
    (["quickstart"], 2, None, "no verb 'quickstart'; did you mean '+recipe=quickstart'?"),
    (["ls", "peft"], 0, "\npeft:\n  lora ", None),
    (["ls", "nosuch"], 2, None, "no config group 'nosuch'; the groups are recipe, task"),
    (["ls", "--help"], 0, "usage: rapidformer ls [-h] [GROUP ...]", None),
    (["run", "ls"], 2, None, "'ls' after 'run' is a verb, not an override"),
    (["train", "validate"], 2, None, "'validate' after 'train' is a verb, not an override"),
    (["train", "--help"], 0, "python -m rapidformer", None),
])
def test_verbs_mistyped_listed_and_run(argv, code, out, err, capsys):
    """A mistyped verb is named with the closest verb (or the recipe it names); `ls GROUP` lists
    that group; `run` / `train` is the explicit training verb, and takes no verb after it."""
    from tests.test_verbs import cli

    got_code, got_out, got_err = cli(argv, capsys)
    assert got_code == code, (got_out, got_err)
    if out is not None:
        assert out in got_out
    if err is not None:
        assert err in got_err
    if argv == ["ls", "peft"]:
        assert "\nmemory:" not in got_out  # that group only


def test_a_plan_says_which_vocabulary_it_counts_when_the_tokenizer_is_not_here(capsys):
    """A plan for another machine: the tokenizer named is not here, so model.vocab_size is what
    the embeddings are counted with, and the plan says so (it said nothing)."""
    from tests.test_verbs import cli

    code, out, _ = cli(["plan", "+recipe=gpt_pretrain", "data.path=x",
                        "model.tokenizer=nothere.json", "model.merge_file=nothere.txt",
                        "model.vocab_size=50257", "memory.device_memory_gb=80"], capsys)
    assert code == 0
    assert "vocabulary: model.tokenizer=nothere.json is not on this machine; the plan counts " \
           "model.vocab_size=50,257 entries" in out
