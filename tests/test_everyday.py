"""Everyday use: the sizes left to the machine, which recipe a command runs, configs from the
user's folders, the seed's launch and shape flags, the hub out of reach, and a refused run that
leaves the disk as it was. In-process and without training: each test takes about a second."""
from __future__ import annotations

import os
import shutil

import pytest

from rapidformer.config import search, sizes
from rapidformer.config.compose import compose, recipe_line, with_default_recipe
from rapidformer.preflight import settle
from rapidformer.errors import ConfigError, InputError

from tests.test_bad_input import call


@pytest.fixture(autouse=True)
def _no_user_folders():
    yield
    search.use([])


def resolved(overrides):
    return settle(compose(overrides), "run")


# --- sizes ---------------------------------------------------------------------------------
def test_global_batch_null_is_micro_times_data_parallel():
    plain, cfg = resolved(["launcher.nproc_per_node=2", "memory=zero3", "precision=bf16"])
    assert (cfg.launcher.nproc_per_node, cfg.trainer.global_batch_size) == (2, 64)
    # the record says what ran, in numbers
    assert plain["trainer"]["global_batch_size"] == 64 and plain["launcher"]["nproc_per_node"] == 2
    _, cfg = resolved(["trainer.micro_batch_size=8", "trainer.global_batch_size=32"])
    assert cfg.trainer.global_batch_size == 32
    with pytest.raises(ConfigError, match="global_batch_size=30 is not a multiple"):
        resolved(["launcher.nproc_per_node=2", "trainer.micro_batch_size=8",
                  "trainer.global_batch_size=30"])


def test_nproc_auto_counts_visible_gpus(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _, cfg = resolved([])
    assert cfg.launcher.nproc_per_node == (sizes.visible_gpus() or 1)
    monkeypatch.setattr(sizes, "visible_gpus", lambda: 4)  # CUDA_VISIBLE_DEVICES=4,5,6,7
    _, cfg = resolved(["trainer.micro_batch_size=16"])
    assert (cfg.launcher.nproc_per_node, cfg.trainer.global_batch_size) == (4, 64)
    _, cfg = resolved(["trainer.device=cpu"])
    assert cfg.launcher.nproc_per_node == 1  # CPU processes are asked for, never a default
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # started by torchrun: its count
    _, cfg = resolved([])
    assert cfg.launcher.nproc_per_node == 3
    with pytest.raises(ConfigError, match="launcher=slurm needs launcher.nproc_per_node"):
        from rapidformer.config.schema import LauncherConfig

        sizes.processes_per_node(LauncherConfig(name="slurm", nproc_per_node="auto"), "auto")


def test_seed_launcher_flags():
    from rapidformer.cli.console import translate

    _, overrides, _ = translate(["--nproc-per-node", "2", "--nnodes", "1", "--master-port",
                                 "29501", "--micro-batch-size", "8"])
    assert {"launcher.nproc_per_node=2", "launcher.nnodes=1", "launcher.master_port=29501"} \
        <= set(overrides)
    _, cfg = resolved(overrides)
    assert (cfg.launcher.nproc_per_node, cfg.trainer.global_batch_size) == (2, 16)


# --- which recipe ------------------------------------------------------------------------------
def test_quickstart_only_when_nothing_chooses_the_run():
    assert with_default_recipe(["model=bert_tiny"])[0] == "+recipe=quickstart"
    for chooser in (["user_script=mine.py"], ["task=masked_lm"], ["+recipe=bert_mrpc"]):
        assert "+recipe=quickstart" not in with_default_recipe(chooser)
    # a white-box script gets the documented trainer defaults, not the quickstart's 4 epochs
    _, cfg = resolved(["user_script=mine.py"])
    assert (cfg.trainer.epochs, cfg.recipe) == (3, None)
    assert recipe_line(with_default_recipe([])).startswith("recipe: quickstart (the default")
    assert recipe_line(with_default_recipe(["+recipe=bert_ner"])) == "recipe: bert_ner"
    assert recipe_line(with_default_recipe(["task=masked_lm"])).startswith("recipe: none")


def test_every_run_prints_its_recipe_first(capsys, tmp_path):
    code, err = call("rapidformer", ["trainer.lr=-1"], capsys)  # refused, and said first
    assert code == 2 and err.splitlines()[0].startswith("rapidformer: recipe: quickstart")
    code, err = call("rapidformer", ["+recipe=bert_ner", "trainer.lr=-1"], capsys)
    assert err.splitlines()[0] == "rapidformer: recipe: bert_ner"


# --- configs from the user's folders ------------------------------------------------------------
def test_cp_then_config_dir(capsys, tmp_path):
    code, err = call("cli", ["cp", "quickstart", str(tmp_path / "mine")], capsys)
    assert code == 0, err
    copy = tmp_path / "mine" / "recipe" / "my_quickstart.yaml"
    text = copy.read_text()
    assert "recipe: my_quickstart" in text
    assert f"python -m rapidformer --config-dir {tmp_path / 'mine'} +recipe=my_quickstart" in text
    copy.write_text(text.replace("epochs: 4", "epochs: 7"))
    flags, overrides = search.take_config_dirs(["--config-dir", str(tmp_path / "mine")],
                                               ["+recipe=my_quickstart"])
    assert flags == [] and overrides[0].startswith("hydra.searchpath=")
    _, cfg = settle(compose(overrides), "run")
    assert (cfg.recipe, cfg.trainer.epochs) == ("my_quickstart", 7)
    # never over a file, never a shipped name
    code, err = call("cli", ["cp", "quickstart", str(tmp_path / "mine")], capsys)
    assert code == 2 and "exists" in err
    code, err = call("cli", ["cp", "bert_mrpc", str(tmp_path / "mine/recipe/quickstart.yaml")],
                     capsys)
    assert code == 2 and "name of a shipped recipe" in err


def test_own_recipe_errors(capsys, tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        search.take_config_dirs(["--config-dir", str(tmp_path / "absent")], [])
    with pytest.raises(ConfigError, match=r"--config-dir DIR with DIR/recipe/NAME.yaml"):
        compose(["+recipe=mine"])
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "quickstart.yaml").write_text("# @package _global_\n")
    search.take_config_dirs([f"--config-dir={tmp_path}"], [])
    with pytest.raises(ConfigError, match="name of rapidformer's recipe option 'quickstart'"):
        compose([])


# --- a pretrained model's shape -----------------------------------------------------------------
def test_seed_shape_flags_beside_a_pretrained_model(tiny_pretrained):
    from rapidformer.cli.console import translate
    from rapidformer.models.pretrained_shape import check_local_shape

    def shape_check(flags):
        _, overrides, _ = translate(["--pretrained-model-name-or-path", str(tiny_pretrained),
                                     *flags])
        _, cfg = resolved(overrides)
        check_local_shape(cfg.model)
        return cfg

    cfg = shape_check([])  # the model's own shape: nothing to compare
    assert cfg.model.num_layers is None
    shape_check(["--num-layers", "1", "--hidden-size", "32"])  # equal: accepted
    with pytest.raises(ConfigError, match=r"model.num_layers=12, but the pretrained model .* has 1"):
        shape_check(["--num-layers", "12", "--hidden-size", "32"])


# --- the hub -----------------------------------------------------------------------------------
def test_unreachable_hub_means_offline_at_once(monkeypatch):
    from rapidformer.runtime import hub

    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT: False)
    _, cfg = resolved(["model=hf", "model.name_or_path=someone/absent-model"])
    with pytest.raises(InputError, match="cannot load the model 'someone/absent-model'"):
        hub.prepare(cfg)
    assert all(os.environ[name] == "1" for name in hub.OFFLINE_VARIABLES)

    def no_probe(timeout=None):
        raise AssertionError("asked the hub while offline was requested")

    monkeypatch.setattr(hub, "hub_reachable", no_probe)
    with pytest.raises(InputError):
        hub.prepare(cfg)
    _, local = resolved([])  # a config-built model and generated data need no hub
    assert not hub.needs_hub(local)


# --- a refused run ------------------------------------------------------------------------------
def test_refused_run_leaves_no_directory(capsys, tmp_path):
    script = tmp_path / "refuses.py"
    script.write_text("from rapidformer.errors import InputError\n"
                      "raise InputError('data/train.csv has no label column')\n")
    run_dir = tmp_path / "runs" / "a"
    code, err = call("rapidformer", [f"user_script={script}", f"trainer.output_dir={run_dir}"],
                     capsys)
    assert code == 2 and "no label column" in err
    assert not (tmp_path / "runs").exists()
    # a directory that was there before is never removed
    run_dir.mkdir(parents=True)
    code, _ = call("rapidformer", [f"user_script={script}", f"trainer.output_dir={run_dir}"],
                   capsys)
    assert code == 2 and run_dir.is_dir()


def test_a_run_that_trained_keeps_its_directory(tmp_path):
    from rapidformer.checkpoint.run_start import RunStart

    run_dir = tmp_path / "x" / "y"
    start = RunStart(run_dir)
    assert start.created == [run_dir.absolute(), (tmp_path / "x").absolute()]
    (run_dir / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000001" / "COMPLETE.json").write_text("{}")
    assert start.trained() and run_dir.is_dir()
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "config.yaml").write_text("{}")
    assert not start.trained()
    start.put_back()
    assert not (tmp_path / "x").exists()
