"""Every config group option and every recipe composes and validates (lightning-hydra-template's
habit), and the default command is the quickstart recipe."""
from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer.config.compose import compose, group_options, option_folder, resolve
from rapidformer.config.schema import GROUPS
from rapidformer.errors import ConfigError
from rapidformer.factory import settle

# options that need a value the user must give (??? in their file)
REQUIRED = {("model", "hf"): ["model.name_or_path=some/local/dir"],
            ("data", "pairs_local"): ["data.path=some/dir"],
            ("data", "hub"): ["data.path=glue", "data.subset=qqp"],
            ("data", "local"): ["data.path=some/dir"],
            ("task", "seq2seq_lm"): ["model=t5_tiny"], ("model", "t5_tiny"): ["task=seq2seq_lm"]}
BERT_PRETRAINING = ["data=megatron", "data.path=corpus_text_sentence", "trainer.train_iters=10",
                    "model.tokenizer_type=BertWordPieceLowerCase", "model.tokenizer=vocab.txt"]
GPT_PRETRAINING = ["model=gpt2_tiny", "model.tokenizer_type=GPT2BPETokenizer",
                   "model.tokenizer=vocab.json", "model.merge_file=merges.txt"]
REQUIRED.update({
    ("task", "bert_pretraining"): BERT_PRETRAINING,
    ("task", "causal_lm"): [*BERT_PRETRAINING, *GPT_PRETRAINING],
    ("data", "megatron"): ["task=bert_pretraining", *BERT_PRETRAINING],
})
MEGATRON_GPT = ["task=causal_lm", *BERT_PRETRAINING, *GPT_PRETRAINING[1:], "trainer.export_hf=false"]
REQUIRED.update({
    ("model", "megatron_gpt"): [*MEGATRON_GPT, "model=megatron_gpt"],
    ("model", "megatron_gpt_tiny"): [*MEGATRON_GPT, "model=megatron_gpt_tiny"],
    ("model", "megatron_bert"): ["task=bert_pretraining", *BERT_PRETRAINING, "model=megatron_bert"],
    ("model", "megatron_bert_tiny"): ["task=bert_pretraining", *BERT_PRETRAINING,
                                      "model=megatron_bert_tiny"],
    ("parallelism", "tp2"): [*MEGATRON_GPT, "model=megatron_gpt_tiny", "launcher.nproc_per_node=2"],
    ("parallelism", "pp2"): [*MEGATRON_GPT, "model=megatron_gpt_tiny", "launcher.nproc_per_node=2"],
})
# recipes whose data the user gives: the mmap prefix and the vocabulary it was made with
RECIPE_REQUIRED = {"bert_pretrain": ["data.path=corpus_text_sentence", "model.tokenizer=vocab.txt"],
                   "gpt_pretrain": ["data.path=corpus_text_document", "model.tokenizer=vocab.json",
                                    "model.merge_file=merges.txt"]}


def test_every_group_has_options():
    for group in GROUPS:
        assert group_options(group), group


def test_the_tests_below_cover_every_file_of_conf_and_recipes():
    """Every folder of the repository's conf/ is a group, and the options composed below are its
    files; the recipes are the files of recipes/."""
    repo = Path(__file__).resolve().parents[1]
    folders = [p for p in (repo / "conf").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert sorted(p.name for p in folders) == sorted(GROUPS)
    for folder in folders:
        assert group_options(folder.name) == sorted(p.stem for p in folder.glob("*.yaml"))
    assert group_options("recipe") == sorted(p.stem for p in (repo / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    plain, cfg = resolve(compose(overrides), output_dir="out")
    if (group, option) == ("memory", "auto"):  # config is data: the planning step decides
        assert cfg.memory.name == "auto"
        plain, cfg = settle(plain, cfg)
    section = getattr(cfg, group)
    if (group, option) == ("memory", "auto"):  # resolved to the mode it picks
        assert section.name in ("none", "zero1", "zero2", "zero3", "fsdp")
    elif hasattr(section, "name") and group != "trainer":
        assert section.name == option
    assert plain["trainer"]["output_dir"] == "out"


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_every_recipe_composes_and_validates(recipe):
    _, cfg = resolve(compose([f"+recipe={recipe}", *RECIPE_REQUIRED.get(recipe, [])]), "out")
    assert cfg.recipe == recipe


def test_bert_pretrain_mirrors_the_seed_example():
    _, cfg = resolve(compose(["+recipe=bert_pretrain", *RECIPE_REQUIRED["bert_pretrain"]]), "out")
    t, s, d, m = cfg.trainer, cfg.scheduler, cfg.data, cfg.model
    assert cfg.task.name == "bert_pretraining" and t.train_iters == 100
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.max_position_embeddings) == \
        (768, 12, 12, 512)
    assert (d.max_seq_length, d.split, d.impl, d.mask_prob) == (512, "980,20", "mmap", 0.15)
    assert (t.micro_batch_size, t.global_batch_size, t.lr, t.weight_decay, t.clip_grad) == \
        (16, 128, 1e-3, 0.01, 1.0)
    assert (s.name, s.min_lr, s.decay_iters, s.warmup_fraction) == ("linear", 0.0, 2000, 0.01)
    assert m.tokenizer_type == "BertWordPieceLowerCase"


def test_pretraining_recipes_name_what_the_user_must_give():
    with pytest.raises(ConfigError) as info:
        resolve(compose(["+recipe=gpt_pretrain"]), "out")
    text = str(info.value)
    assert "data.path is empty" in text and "model.tokenizer is empty" in text
    assert "model.merge_file" in text


def test_megatron_split_needs_no_quoting():
    # Hydra reads a bare comma as a sweep; a split is one value
    _, cfg = resolve(compose(["+recipe=bert_pretrain", *RECIPE_REQUIRED["bert_pretrain"],
                              "data.split=969,30,1"]), "out")
    assert cfg.data.split == "969,30,1"


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


@pytest.mark.parametrize("recipe", ["bert_ner", "bert_squad", "bert_mlm", "t5_summarize"])
def test_a_task_recipe_on_generated_data_keeps_no_hub_path(recipe):
    """`data=synthetic` replaces the recipe's hub dataset whole: the generated data goes to the
    run directory, never to a folder named after the hub dataset in the working directory."""
    extra = {"t5_summarize": ["model=t5_tiny"],
             "bert_squad": ["model=bert_tiny", "data.max_seq_length=64", "task.doc_stride=16"]
             }.get(recipe, ["model=bert_tiny"])
    _, cfg = resolve(compose([f"+recipe={recipe}", *extra, "data=synthetic"]), "out")
    assert (cfg.data.source, cfg.data.path, cfg.data.subset) == ("synthetic", None, None)


def documented_offline_commands():
    """The `python -m rapidformer ...` lines in recipe headers that need no hub: a config-built
    model (bert_tiny, t5_tiny) on generated or local data."""
    import shlex

    recipes = option_folder("recipe")
    for recipe in sorted(group_options("recipe")):
        for line in recipes.joinpath(f"{recipe}.yaml").read_text().splitlines():
            if not line.startswith("#") or "python -m rapidformer +recipe=" not in line:
                continue
            command = line.split("python -m rapidformer", 1)[1].split("  (")[0]
            if command.rstrip().endswith("\\"):
                continue  # continued on the next line: not a complete command
            args = shlex.split(command)
            if any(a in args for a in ("model=bert_tiny", "model=t5_tiny")):
                yield pytest.param(args, id=" ".join(args))


@pytest.mark.parametrize("args", list(documented_offline_commands()))
def test_documented_offline_commands_validate(args, tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    _, cfg = resolve(compose([a.replace("DIR", str(tmp_path)) for a in args]), "out")
    assert cfg.recipe and cfg.data.source in ("synthetic", "local")
