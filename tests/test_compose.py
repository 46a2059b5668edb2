"""Every config group option and every recipe composes and validates (lightning-hydra-template's
habit), and the default command is the quickstart recipe."""
from __future__ import annotations

import pytest

from rapidformer.config.compose import compose, group_options, resolve
from rapidformer.config.schema import GROUPS

# options that need a value the user must give (??? in their file)
REQUIRED = {("model", "hf"): ["model.name_or_path=some/local/dir"],
            ("data", "pairs_local"): ["data.path=some/dir"],
            ("data", "hub"): ["data.path=glue", "data.subset=qqp"]}


def test_every_group_has_options():
    for group in GROUPS:
        assert group_options(group), group


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    plain, cfg = resolve(compose(overrides), output_dir="out")
    section = getattr(cfg, group)
    if hasattr(section, "name") and group != "trainer":
        assert section.name == option
    assert plain["trainer"]["output_dir"] == "out"


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_every_recipe_composes_and_validates(recipe):
    _, cfg = resolve(compose([f"+recipe={recipe}"]), output_dir="out")
    assert cfg.recipe == recipe


def test_no_arguments_means_the_quickstart_recipe():
    _, default = resolve(compose([]), output_dir="out")
    _, explicit = resolve(compose(["+recipe=quickstart"]), output_dir="out")
    assert default == explicit
    assert default.recipe == "quickstart"
    assert default.model.source == "config" and default.data.source == "synthetic"


def test_bert_mrpc_mirrors_the_seed_example():
    _, cfg = resolve(compose(["+recipe=bert_mrpc"]), output_dir="out")
    t = cfg.trainer
    assert (t.epochs, t.micro_batch_size, t.global_batch_size, t.lr) == (3, 16, 64, 2e-5)
    assert (t.weight_decay, t.clip_grad, t.seed) == (0.01, 1.0, 42)
    assert cfg.scheduler.name == "linear" and cfg.scheduler.warmup_iters == 100
    assert cfg.model.name_or_path == "bert-base-cased"
    assert (cfg.data.path, cfg.data.subset) == ("glue", "mrpc")


def test_design_card_command_composes():
    _, cfg = resolve(compose(["+recipe=bert_mrpc", "precision=fp16", "memory=zero3"]), "out")
    assert cfg.precision.dtype == "fp16" and cfg.memory.name == "zero3"


def test_launcher_defaults_follow_the_seed_environment(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "7001")
    _, cfg = resolve(compose([]), output_dir="out")
    assert cfg.launcher.master_addr == "10.1.2.3" and cfg.launcher.master_port == 7001
