"""Every config group option and every recipe composes and validates (lightning-hydra-template's
habit), and the default command is the quickstart recipe."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from rapidformer.config.compose import compose, group_options, option_folder, resolve
from rapidformer.preflight import settle
from rapidformer.config.schema import GROUPS, RunConfig
from rapidformer.errors import ConfigError

# options that need a value the user must give (??? in their file)
REQUIRED = {("model", "hf"): ["model.name_or_path=some/local/dir"],
            ("data", "pairs_local"): ["data.path=some/dir"],
            ("data", "hub"): ["data.path=glue", "data.subset=qqp"],
            ("data", "local"): ["data.path=some/dir"],
            ("task", "seq2seq_lm"): ["model=t5_tiny"], ("model", "t5_tiny"): ["task=seq2seq_lm"],
            ("task", "sft"): ["model=llama_tiny"]}
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
    ("model", "megatron_llama"): [*MEGATRON_GPT, "model=megatron_llama"],
    ("model", "megatron_llama_tiny"): [*MEGATRON_GPT, "model=megatron_llama_tiny"],
    ("model", "megatron_bert"): ["task=bert_pretraining", *BERT_PRETRAINING, "model=megatron_bert"],
    ("model", "megatron_bert_tiny"): ["task=bert_pretraining", *BERT_PRETRAINING,
                                      "model=megatron_bert_tiny"],
    ("parallelism", "tp2"): [*MEGATRON_GPT, "model=megatron_gpt_tiny", "launcher.nproc_per_node=2"],
    ("parallelism", "pp2"): [*MEGATRON_GPT, "model=megatron_gpt_tiny", "launcher.nproc_per_node=2"],
})
# recipes whose data the user gives: the mmap prefix and the vocabulary it was made with
RECIPE_REQUIRED = {"bert_pretrain": ["data.path=corpus_text_sentence", "model.tokenizer=vocab.txt"],
                   "gpt_pretrain": ["data.path=corpus_text_document", "model.tokenizer=vocab.json",
                                    "model.merge_file=merges.txt"],
                   "llama_pretrain": ["data.path=corpus_text_document",
                                      "model.tokenizer=vocab.json", "model.merge_file=merges.txt"]}


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
    if (group, option) == ("memory", "auto"):  # config is data: the planning step decides
        assert resolve(compose(overrides), output_dir="out")[1].memory.name == "auto"
    plain, cfg = settle(compose(overrides), output_dir="out")
    section = getattr(cfg, group)
    if (group, option) == ("memory", "auto"):  # resolved to the mode it picks
        assert section.name in ("none", "zero1", "zero2", "zero3", "fsdp")
    elif hasattr(section, "name") and group != "trainer":
        assert section.name == option
    assert plain["trainer"]["output_dir"] == "out"


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_every_recipe_composes_and_validates(recipe):
    _, cfg = settle(compose([f"+recipe={recipe}", *RECIPE_REQUIRED.get(recipe, [])]), "out")
    assert cfg.recipe == recipe
    from rapidformer.config.bounds import schema_default, value_at
    from rapidformer.config.read_keys import USED_ONLY_WITH

    # what the recipe sets is read by the options it picks (a recipe's keys are never refused,
    # so nothing else would notice one that is dropped)
    text = yaml.safe_load(option_folder("recipe").joinpath(f"{recipe}.yaml").read_text())
    for group, section in text.items():
        for key, value in (section.items() if group in GROUPS else ()):
            if f"{group}.{key}" in USED_ONLY_WITH and value != schema_default(f"{group}.{key}"):
                selector, values = USED_ONLY_WITH[f"{group}.{key}"]
                assert value_at(cfg, selector) in values, (recipe, group, key)


def test_bert_pretrain_mirrors_the_seed_example():
    _, cfg = settle(compose(["+recipe=bert_pretrain", *RECIPE_REQUIRED["bert_pretrain"]]), "out")
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
        settle(compose(["+recipe=gpt_pretrain"]), "out")
    text = str(info.value)
    assert "data.path is empty" in text and "model.tokenizer is empty" in text
    assert "model.merge_file" in text


def test_megatron_split_needs_no_quoting():
    # Hydra reads a bare comma as a sweep; a split is one value
    _, cfg = settle(compose(["+recipe=bert_pretrain", *RECIPE_REQUIRED["bert_pretrain"],
                              "data.split=969,30,1"]), "out")
    assert cfg.data.split == "969,30,1"


def test_no_arguments_means_the_quickstart_recipe():
    _, default = settle(compose([]), output_dir="out")
    _, explicit = settle(compose(["+recipe=quickstart"]), output_dir="out")
    assert default == explicit
    assert default.recipe == "quickstart"
    assert default.model.source == "config" and default.data.source == "synthetic"


def test_bert_mrpc_mirrors_the_seed_example():
    _, cfg = settle(compose(["+recipe=bert_mrpc"]), output_dir="out")
    t = cfg.trainer
    assert (t.epochs, t.micro_batch_size, t.global_batch_size, t.lr) == (3, 16, 64, 2e-5)
    assert (t.weight_decay, t.clip_grad, t.seed) == (0.01, 1.0, 42)
    assert cfg.scheduler.name == "linear" and cfg.scheduler.warmup_iters == 100
    assert cfg.model.name_or_path == "bert-base-cased"
    assert (cfg.data.path, cfg.data.subset) == ("glue", "mrpc")


def test_design_card_command_composes():
    _, cfg = settle(compose(["+recipe=bert_mrpc", "precision=fp16", "memory=zero3"]), "out")
    assert cfg.precision.dtype == "fp16" and cfg.memory.name == "zero3"


def test_launcher_defaults_follow_the_seed_environment(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "7001")
    _, cfg = settle(compose([]), output_dir="out")
    assert cfg.launcher.master_addr == "10.1.2.3" and cfg.launcher.master_port == 7001


@pytest.mark.parametrize("recipe", ["bert_ner", "bert_squad", "bert_mlm", "t5_summarize"])
def test_a_task_recipe_on_generated_data_keeps_no_hub_path(recipe):
    """`data=synthetic` replaces the recipe's hub dataset whole: the generated data goes to the
    run directory, never to a folder named after the hub dataset in the working directory."""
    extra = {"t5_summarize": ["model=t5_tiny"],
             "bert_squad": ["model=bert_tiny", "data.max_seq_length=64", "task.doc_stride=16"]
             }.get(recipe, ["model=bert_tiny"])
    _, cfg = settle(compose([f"+recipe={recipe}", *extra, "data=synthetic"]), "out")
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
    _, cfg = settle(compose([a.replace("DIR", str(tmp_path)) for a in args]), "out")
    assert cfg.recipe and cfg.data.source in ("synthetic", "local")


# --- overrides the picked options would drop ---------------------------------------------------

IGNORED = [
    (["memory.offload_optimizer=true"],
     "memory.offload_optimizer=true has no effect with memory=none; it is used by memory=zero1, "
     "zero2, zero3 or fsdp: choose one of those or drop the override"),
    (["task.doc_stride=64"],
     "task.doc_stride=64 has no effect with task=sequence_classification; it is used by "
     "task=question_answering: choose it or drop the override"),
    (["memory=zero2", "memory.offload_params=true"],
     "memory.offload_params=true has no effect with memory=zero2; it is used by memory=zero3 or "
     "fsdp: choose one of those or drop the override"),
    (["memory=auto", "memory.offload_optimizer=true"],
     "memory.offload_optimizer=true has no effect with memory=auto;"),
    (["data.subset=qqp"],
     "data.subset=qqp has no effect with data.source=synthetic (data=synthetic_pairs); it is used "
     "by data.source=hub (data=conll2003, glue_mrpc, hub, squad, wikitext2, xsum): choose it or "
     "drop the override"),
    (["precision=bf16", "precision.initial_scale=1024"],
     "precision.initial_scale=1024 has no effect with precision.dtype=bf16 (precision=bf16); it "
     "is used by precision.dtype=fp16 (precision=fp16)"),
    (["graph.options.coordinate_descent_tuning=true"],
     "graph.options.coordinate_descent_tuning=true has no effect with graph=eager; it is used by "
     "graph=compile"),
    (["logger=wandb", "logger.tracking_uri=http://host:5000"],
     "logger.tracking_uri=http://host:5000 has no effect with logger=wandb; it is used by "
     "logger=mlflow"),
    (["scheduler=constant", "scheduler.min_lr=1e-6"],
     "scheduler.min_lr=1e-6 has no effect with scheduler=constant; it is used by "
     "scheduler=linear or cosine"),
    (["data.question_column=q"],
     "data.question_column=q has no effect with task=sequence_classification; it is used by "
     "task=question_answering"),
    (["model.name_or_path=bert-base-cased"],
     "model.name_or_path=bert-base-cased has no effect with model.source=config (model=bert_tiny); "
     "it is used by model.source=pretrained (model=bert_base_cased, hf, t5_small)"),
    # the default's value too: the override is still dropped without a word
    (["peft.r=8"], "peft.r=8 has no effect with peft=none; it is used by peft=lora or qlora"),
    (["peft=lora", "peft.quant_type=nf4"],
     "peft.quant_type=nf4 has no effect with peft=lora; it is used by peft=qlora"),
    (["task.doc_stride=32"], "task.doc_stride=32 has no effect with task=sequence_classification"),
    (["data.subset=null"], "data.subset=null has no effect with data.source=synthetic"),
]


@pytest.mark.parametrize("overrides,expected", IGNORED, ids=[" ".join(o) for o, _ in IGNORED])
def test_an_override_the_picked_option_does_not_read_is_refused(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert len(info.value.problems) == 1 and expected in info.value.problems[0]


def test_ignored_overrides_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        compose(["memory.offload_optimizer=true", "task.doc_stride=64", "graph.fullgraph=true"])
    assert len(info.value.problems) == 3


@pytest.mark.parametrize("overrides", [
    ["+recipe=bert_squad", "model=bert_tiny", "data=synthetic", "task.doc_stride=16"],
    ["memory=zero3", "memory.offload_optimizer=true", "memory.offload_params=true"],
    # what `rapidformer plan` prints for a mode: the defaults, which every option runs with
    ["memory=none", "memory.offload_optimizer=false", "memory.offload_params=false"],
    # a white-box script may read any key
    ["user_script=my_script.py", "task.doc_stride=64"],
], ids=lambda o: " ".join(o))
def test_overrides_the_picked_options_read_or_that_keep_the_default_pass(overrides):
    compose(overrides)


def test_the_option_keys_table_names_schema_keys_and_real_choices():
    from rapidformer.config.read_keys import USED_ONLY_WITH

    for key, (selector, values) in USED_ONLY_WITH.items():
        group, name = key.split(".")
        assert name in typing.get_type_hints(typing.get_type_hints(RunConfig)[group]), key
        sel_group, sel_name = selector.split(".")
        choices = typing.get_args(typing.get_type_hints(
            typing.get_type_hints(RunConfig)[sel_group])[sel_name])
        assert values and set(values) <= set(choices), (key, selector, values)


@pytest.mark.parametrize("group", GROUPS)
def test_no_option_file_sets_a_key_its_own_option_does_not_read(group):
    """An option file's keys are the option's own and never refused: they must be read."""
    from rapidformer.config.bounds import schema_default
    from rapidformer.config.read_keys import USED_ONLY_WITH

    for option in group_options(group):
        text = yaml.safe_load(option_folder(group).joinpath(f"{option}.yaml").read_text()) or {}
        for key, value in text.items():
            used = USED_ONLY_WITH.get(f"{group}.{key}")
            if used is None or value == schema_default(f"{group}.{key}") or \
                    not used[0].startswith(f"{group}."):
                continue
            field = used[0].split(".")[1]
            picked = option if field == "name" else text.get(field)
            assert picked in used[1], (group, option, key)


# --- '+' on a key that is there ------------------------------------------------------------------

def test_a_plus_on_an_existing_key_says_to_drop_the_plus():
    with pytest.raises(ConfigError) as info:
        compose(["+trainer.lr=1e-4", "+trainer.seed=3"])
    assert info.value.problems == [
        "trainer.lr already exists in the config: write trainer.lr=1e-4 (no '+'); '+' adds a key "
        "that is not there",
        "trainer.seed already exists in the config: write trainer.seed=3 (no '+'); '+' adds a key "
        "that is not there"]


def test_plus_plus_sets_and_plus_adds_a_key_the_files_leave_out():
    _, cfg = settle(compose(["++trainer.lr=1e-4", "+trainer.max_nonfinite_steps=3"]), "out")
    assert cfg.trainer.lr == 1e-4 and cfg.trainer.max_nonfinite_steps == 3
