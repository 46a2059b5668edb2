"""Every command that README.md, docs/*.md and the recipes' headers show is run here, offline on
a CPU, and its exit code checked, or COMMANDS below says why it is not run.

The commands are read from the pages' shell blocks (```bash, ```sh, ```console and plain blocks'
`$ ` lines; `\\` continuations joined, trailing `# comments` dropped) and from the first comment
lines of recipes/*.yaml (the lines that start with a command). Each one must have an entry in
COMMANDS: `Run(...)` or `Skip(reason)`; a new documented command without one fails
test_every_documented_command_has_an_entry, and so does an entry no page shows any more.

A page (or a recipe file) is one session: its commands run in order, in a folder of their own,
so a later command reads what an earlier one on the same page made (the corpus, then its
preprocessing, then the pretraining run). A command that several pages show runs once, on the
first page in FIRST's order that shows it (a command whose block shows its output is checked
on every page). How a command runs:

- the console scripts and `python -m` modules are called in this process (`main(argv)`, its
  SystemExit read as the exit code), which saves their import time; other lines (`head`) run in
  a shell; `echo $?` is checked against the exit code of the command before it;
- placeholders in capitals (RUN_DIR, DIR, MODEL_DIR, ...) are replaced as the entry's `stand_in`
  says: a short run of the recipe the page is about, data the project generates, a tiny local
  model built from a config where the page has a hub model's name;
- a training run the page describes as lasting a minute or more is shortened by the overrides
  in its entry's `short` (fewer steps, less generated data), and by nothing else;
- where a block shows a command's output, `output` lines are looked for in what it printed.

Skipped, each with its reason: what needs the network (pip, the hub's models and datasets), a
GPU or several nodes, GPU-sized runs (hours on a CPU), patterns with `...`, and the benchmark
scripts (SKIPPED_FAMILIES). Commands in prose (`inline code`) are not read; the pages put the
ones to run in blocks. The whole file takes about 125 s on 2 cores.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL_BLOCKS = ("bash", "sh", "console", "shell", "")
# a recipe header's line that is a command (the others are prose)
COMMAND_START = re.compile(r"^(python3? |rapidformer|pip |torchrun |head |echo )")
# a trailing note: `  # comment` in a block, `   (a text column)` in a recipe header
NOTE = re.compile(r"\s{2,}(#|\().*$|\s+#\s.*$")


# -- what the pages show ---------------------------------------------------------------------

@dataclass(frozen=True)
class Shown:
    where: str           # page:line
    page: str
    command: str         # whitespace collapsed: the key of COMMANDS
    output: tuple        # the lines a block shows after a `$ ` command (up to the next one)
    context: str = ""    # what a reader sees with it: its note, the comments above it, the
                         # paragraph before the block (a recipe: its whole header)


def _joined(lines: list[str]):
    i = 0
    while i < len(lines):
        number, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        yield number, line


def _page_commands(page: Path) -> list[Shown]:
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(REPO))
    shown = []
    for block in FENCE.finditer(text):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        first = text[: block.start()].count("\n") + 2
        before = text[: block.start()].rstrip().rsplit("\n\n", 1)[-1]
        lines = block.group(2).rstrip("\n").split("\n")
        prompted = any(line.startswith("$ ") for line in lines)
        current, comments = None, []
        for number, line in _joined(lines):
            stripped = line.strip()
            if prompted and not stripped.startswith("$ "):
                if current is not None and stripped:
                    current[3].append(stripped)  # output of the command above
                continue
            if not stripped:
                comments = []  # a comment speaks for the lines up to the next blank one
                continue
            if stripped.startswith("#"):
                comments.append(stripped)
                continue
            if not block.group(1) and not prompted:
                continue
            note = NOTE.search(stripped)
            command = " ".join(NOTE.sub("", stripped.removeprefix("$ ")).split())
            context = " ".join([before, *comments, note.group(0) if note else ""])
            current = [f"{name}:{first + number}", name, command, [], context]
            shown.append(current)
    return [Shown(w, p, c, tuple(o), x) for w, p, c, o, x in shown]


def _recipe_commands(path: Path) -> list[Shown]:
    header = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.startswith("#"):
            break
        header.append(line[1:])
    name = str(path.relative_to(REPO))
    return [Shown(f"{name}:{number + 1}", name, " ".join(NOTE.sub("", line.strip()).split()), (),
                  " ".join(header))
            for number, line in _joined(header) if COMMAND_START.match(line.strip())]


def documented() -> list[Shown]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [*(s for page in pages for s in _page_commands(page)),
            *(s for recipe in sorted((REPO / "recipes").glob("*.yaml"))
              for s in _recipe_commands(recipe))]


# -- how each one runs -------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    code: int = 0                        # the exit code the page says (0 unless it shows another)
    short: tuple = ()                    # overrides added, or replacing the command's own value
    flags: tuple = ()                    # seed flags: (flag, value) pairs replaced or added
    stand_in: dict = field(default_factory=dict)  # placeholder -> a name Stage.resolve knows
    before: tuple = ()                   # shell lines the test runs first (stand-ins filled in)
    output: object = ()                  # lines the output holds; True: the block's own lines


@dataclass(frozen=True)
class Skip:
    why: str
    says: tuple = ()  # words one of which the page says with the command (a reader must know)


# A training run that lasts a minute or more on a CPU, shortened: a few steps on less generated
# data. Nothing else about the command changes.
FEW_STEPS = ("trainer.train_iters=3", "trainer.epochs=null")
SHORT_SYNTH = (*FEW_STEPS, "data.synthetic_train_size=128", "data.synthetic_eval_size=16")
SHORT_PRETRAIN = ("trainer.train_iters=4",)

HUB = "needs {} from the Hugging Face hub or its cache (the tests run offline)"
NEEDS_HUB = ("hub", "cache")  # what the page says beside a command that needs the hub
NEEDS_GPU = ("GPU", "GPUs")
PIP = "installs from PyPI (network); the test environment has it installed"
GPU_SIZED = "a GPU job: {}; hours on a CPU. A CPU-sized form runs from {}"
TEMPLATE = "a pattern (`...` or `NAME`), not a command; its filled-in forms are the page's others"
RUN_DIR_SFT = {"RUN_DIR": "sft_run"}


def hub(what: str) -> Skip:
    return Skip(HUB.format(what), NEEDS_HUB)


def gpu_sized(what: str, instead: str) -> Skip:
    return Skip(GPU_SIZED.format(what, instead), NEEDS_GPU)


COMMANDS: dict[str, Run | Skip] = {
    # ---- README.md
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install "
    "-e . && python -m rapidformer":
        Skip(PIP + "; `python -m rapidformer` runs from quickstart.md"),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q --no-compile torch==2.13.0 "
    "&& pip install -q --no-compile -e \".[test]\" && (python -m compileall -q -j 0 .venv/lib > "
    "/dev/null || true) && python -m pytest -q -n 2 --dist loadfile -m \"not serial\" && python "
    "-m pytest -q -m serial && python3 -m venv .venv-ort && .venv-ort/bin/pip install -q "
    "--no-compile torch==2.6.0 && .venv-ort/bin/pip install -q --no-compile -e \".[ort]\" pytest "
    "&& (.venv-ort/bin/python -m compileall -q -j 0 .venv-ort/lib > /dev/null || true) && "
    "RAPIDFORMER_REQUIRE_ORT=1 .venv-ort/bin/python -m pytest -q tests/test_ort.py":
        Skip("CI's own command: this test suite, after installs from PyPI"),
    "python3 -m venv .venv-ort && . .venv-ort/bin/activate && pip install torch==2.6.0 && pip "
    "install -e \".[ort]\" && python -m rapidformer graph=ort trainer.device=cpu":
        Skip("a second environment (torch 2.6, onnxruntime-training) from PyPI; tests/test_ort.py "
             "runs graph=ort there in CI"),
    "python -m rapidformer +recipe=quickstart precision=bf16": Run(short=SHORT_SYNTH),
    "python -m rapidformer precision=fp16 trainer.lr=5e-4": Run(short=SHORT_SYNTH),
    "python -m rapidformer graph=compile": Skip(
        "torch.compile: a 4-step quickstart took 45 s of CPU time on 2 cores, nearly all of it "
        "compiling (7 graphs), however short the run; "
        "tests/test_train.py::test_compile_gives_the_eager_losses compiles the quickstart's model "
        "on the CPU"),
    "python -m rapidformer +recipe=bert_mrpc --cfg job --resolve": Run(),
    "python -m rapidformer -m precision=fp32,bf16 trainer.lr=1e-3,5e-4": Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=bert_mrpc": hub("bert-base-cased and glue/mrpc"),
    "python -m rapidformer +recipe=bert_mrpc model=bert_tiny data=pairs_local data.path=DIR "
    "precision=bf16": Run(short=FEW_STEPS, stand_in={"DIR": "pairs"}),
    "python -m rapidformer trainer.lrr=1e-4 precision=fp17": Run(code=2, output=True),
    "rapidformer ls": Run(output=("recipe: bert_mlm Masked-LM training",)),
    "rapidformer show +recipe=bert_mrpc precision=bf16": Run(output=("precision:",)),
    "rapidformer validate +recipe=llama_lora precision=bf16": Run(
        output=("ok: recipe=llama_lora task=sft model=llama_tiny",)),
    "rapidformer plan +recipe=llama_sft model=llama_1b data.max_seq_length=2048 precision=bf16 "
    "memory.device_memory_gb=80": Run(output=("model: llama_1b (llama)", "memory=auto picks:")),
    "rapidformer env": Run(),
    "rapidformer export RUN_DIR --to DIR": Run(stand_in={"RUN_DIR": "quick_run",
                                                          "DIR": "new:exported"}),
    "rapidformer export RUN_DIR --to DIR --adapter-only": Run(
        stand_in={"RUN_DIR": "lora_run", "DIR": "new:adapters"},
        output=("adapter",)),
    "rapidformer plot RUN_A RUN_B": Run(stand_in={"RUN_A": "quick_run", "RUN_B": "lora_run"}),
    "rapidformer eval RUN_DIR": Run(stand_in={"RUN_DIR": "quick_run"},
                                    output=("validation/accuracy",)),
    "rapidformer predict RUN_DIR --input rows.jsonl --output predictions.jsonl": Run(
        stand_in={"RUN_DIR": "quick_run"},
        before=("head -5 RUN_DIR/data/test.jsonl > rows.jsonl",)),  # as docs/cli.md makes it
    "rapidformer generate RUN_DIR --prompt \"where does anna live ?\"": Run(stand_in=RUN_DIR_SFT),
    "rapidformer --task sequence_classification --pretrained-model-name-or-path bert-base-cased "
    "--data-path glue --data-name mrpc --epochs 3 --micro-batch-size 16 --global-batch-size 64 "
    "--lr 2e-5 --lr-decay-style linear --lr-warmup-iters 100 --weight-decay 1e-2 --clip-grad 1.0 "
    "--seed 42 --mixed-precision --print-hydra": Run(output=("python -m rapidformer",)),
    "python -m rapidformer user_script=my_finetuner.py model=hf model.name_or_path=DIR "
    "data=pairs_local data.path=DATA": Skip(
        "my_finetuner.py is the skeleton above it (`...` bodies); the complete script runs the "
        "same way from docs/white_box.md"),
    "pip install -e \".[megatron]\"": Skip(PIP),
    "python -m rapidformer.data.corpus corpus.json --docs 5000 --wordpiece-vocab wp "
    "--gpt2-bpe gpt2": Run(),
    "rapidformer-preprocess-data --input corpus.json --output-prefix data/corpus --vocab-file "
    "wp/vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences --workers 2": Run(),
    "rapidformer-preprocess-data --input corpus.json --output-prefix data/corpus --vocab-file "
    "gpt2/vocab.json --merge-file gpt2/merges.txt --tokenizer-type GPT2BPETokenizer --append-eod "
    "--workers 2": Run(),
    "python -m rapidformer +recipe=bert_pretrain data.path=data/corpus_text_sentence "
    "model.tokenizer=wp/vocab.txt model=bert_tiny data.max_seq_length=128 "
    "trainer.micro_batch_size=16 trainer.global_batch_size=32 trainer.train_iters=200":
        Run(short=SHORT_PRETRAIN),
    "python -m rapidformer +recipe=bert_pretrain data.path=data/corpus_text_sentence "
    "model.tokenizer=wp/vocab.txt": gpu_sized(
        "bert-base at sequence 512 and global batch 128", "docs/pretraining.md's CPU-sized line"),
    "rapidformer plan +recipe=gpt_pretrain data.path=data/corpus_text_document "
    "model.tokenizer=gpt2/vocab.json model.merge_file=gpt2/merges.txt "
    "memory.device_memory_gb=80": Run(output=("model: gpt2_small (gpt2)",)),
    "python -m rapidformer +recipe=gpt_pretrain model=megatron_gpt parallelism=tp2 "
    "launcher.nproc_per_node=2 data.path=data/corpus_text_document model.tokenizer=gpt2/vocab.json "
    "model.merge_file=gpt2/merges.txt": gpu_sized(
        "GPT-2 small at the recipe's global batch of 128 on 2 tensor-parallel ranks",
        "tests/test_parallel.py (TP=2, PP=2 with megatron_gpt_tiny on 2 CPU processes)"),
    "python -m rapidformer launcher.nproc_per_node=2": Run(short=SHORT_SYNTH),
    "python -m rapidformer launcher.nproc_per_node=2 memory=zero3 precision=bf16":
        Run(short=SHORT_SYNTH),

    # ---- docs/benchmarks.md (beside its benchmark scripts: SKIPPED_FAMILIES)
    "python -m rapidformer graph=eager trainer.device=cpu": Run(short=SHORT_SYNTH),
    "python -m rapidformer graph=ort trainer.device=cpu": Skip(
        "graph=ort runs in its own environment (torch 2.6, onnxruntime-training from PyPI); "
        "tests/test_ort.py runs it there in CI"),
    "python -m rapidformer data.group_by_length=true": Run(short=SHORT_SYNTH),

    # ---- docs/black_box.md
    "python -m rapidformer +recipe=NAME [group=option ...] [key=value ...]": Skip(TEMPLATE),
    "rapidformer +recipe=NAME ...": Skip(TEMPLATE),
    "rapidformer plot outputs/2026-12-01/10-00-00 outputs/2026-12-01/11-30-00 --out compare/": Run(
        before=("mkdir -p outputs/2026-12-01", "cp -r quick_run outputs/2026-12-01/10-00-00",
                "cp -r lora_run outputs/2026-12-01/11-30-00"),
        stand_in={"quick_run": "quick_run", "lora_run": "lora_run"}),
    "python -m rapidformer +recipe=llama_sft peft=lora trainer.lr=1e-2": Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=llama_pretrain data.path=data/corpus_text_document "
    "model.tokenizer=gpt2/vocab.json model.merge_file=gpt2/merges.txt precision=fp8 "
    "kernels=liger": gpu_sized(
        "Llama 1B; float8 and liger-kernel need a CUDA GPU",
        "tests/test_float8.py and tests/test_liger.py (GPU-marked)"),

    # ---- docs/cli.md
    "rapidformer cp bert_mrpc my_configs": Run(),
    "python -m rapidformer --config-dir my_configs +recipe=my_bert_mrpc": Skip(
        HUB.format("bert-base-cased and glue/mrpc (the copied recipe's)")),
    "rapidformer cp model/bert_tiny my_configs/model/bert_tiny_wide.yaml": Run(),
    "python -m rapidformer --config-dir my_configs model=bert_tiny_wide": Run(short=SHORT_SYNTH),
    "rapidformer validate trainer.lr=abc model.hiden_size=3 memory=zero5": Run(code=2,
                                                                              output=True),
    "echo $?": Run(output=True),
    "rapidformer validate +recipe=quickstart precision=bf16": Run(output=True),
    "rapidformer verify outputs/run": Run(
        # the page's run: checkpoints at steps 5 and 10, the second one's model.pt changed
        code=2, before=("python -m rapidformer trainer.output_dir=outputs/run "
                        "trainer.save_interval=5 trainer.train_iters=10 trainer.epochs=null "
                        "data.synthetic_train_size=48 data.synthetic_eval_size=16 "
                        "trainer.export_hf=false",
                        "printf X | dd of=outputs/run/checkpoints/step_00000010/model.pt bs=1 "
                        "seek=100 conv=notrunc status=none"),
        output=("ok outputs/run/checkpoints/step_00000005 (",  # then its size and time
                "DAMAGED outputs/run/checkpoints/step_00000010",
                "model.pt: its bytes changed since it was written (sha256 differs)",
                "rapidformer: error: 1 of 2 checkpoints are damaged; resume skips them")),
    "python -m rapidformer trainer.output_dir=outputs/quickstart": Run(short=SHORT_SYNTH),
    "rapidformer eval outputs/quickstart": Run(output=("validation/accuracy", "test/accuracy",
                                                       "wrote outputs/quickstart/eval/")),
    "rapidformer eval outputs/quickstart data.validation_file=test.jsonl --output "
    "test_scores.json": Run(),
    "head -5 outputs/quickstart/data/test.jsonl > rows.jsonl": Run(),
    "rapidformer predict outputs/quickstart --input rows.jsonl --output predictions.jsonl": Run(),
    "rapidformer predict outputs/quickstart --input rows.jsonl --output exported.jsonl "
    "--checkpoint outputs/quickstart/hf_model": Run(),

    # ---- docs/cluster.md
    "python -m rapidformer +recipe=bert_mrpc launcher.nnodes=2 launcher.node_rank=0 "
    "launcher.master_addr=HOST0 launcher.nproc_per_node=8 trainer.micro_batch_size=4":
        Skip("two nodes of 8 GPUs, and " + HUB.format("bert-base-cased and glue/mrpc"),
             NEEDS_HUB),
    "pip install -e \".[slurm]\"": Skip(PIP),
    "python -m rapidformer +recipe=bert_mrpc launcher=slurm launcher.nnodes=2 "
    "launcher.nproc_per_node=8 trainer.micro_batch_size=4 hydra.launcher.partition=gpu "
    "hydra.launcher.timeout_min=240 trainer.output_dir=runs/mrpc": Skip(
        "needs a Slurm cluster (tests/test_sweeps.py runs a job through submitit's local "
        "executor)"),
    "pip install -e \".[optuna]\"": Skip(PIP),
    # Optuna's trials are quickstart runs: two short ones
    "python -m rapidformer +recipe=quickstart_optuna -m": Run(
        short=(*SHORT_SYNTH, "hydra.sweeper.n_trials=2")),
    "python -m rapidformer +recipe=quickstart_optuna -m hydra.sweeper.n_trials=20": Run(
        short=(*SHORT_SYNTH, "hydra.sweeper.n_trials=2")),

    # ---- docs/configuration.md
    "python -m rapidformer -m +recipe=quickstart precision=fp32,bf16 memory=none,zero2":
        Run(short=SHORT_SYNTH),

    # ---- docs/data.md
    "rapidformer-train-vocab --input corpus.json --type gpt2-bpe --vocab-size 1000 --output-dir "
    "gpt2": Run(),
    "rapidformer-train-vocab --input corpus.json --type wordpiece --lowercase --vocab-size 1000 "
    "--output-dir wp": Run(),
    "python -m rapidformer.data.corpus corpus.json --docs 1000": Run(),
    "python -m rapidformer.data.preprocess_data --input corpus.json --output-prefix gpt_small "
    "--vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt --dataset-impl mmap "
    "--tokenizer-type GPT2BPETokenizer --append-eod --workers 2": Run(),
    "rapidformer-preprocess-data --input corpus.json --output-prefix bert_small --vocab "
    "wp/vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences": Run(),

    # ---- docs/distributed.md
    "python -m rapidformer launcher.nproc_per_node=2 memory=zero2": Run(short=SHORT_SYNTH),
    "torchrun --nproc_per_node 4 -m rapidformer ...": Skip(TEMPLATE),
    "python -m rapidformer launcher.nnodes=2 launcher.node_rank=0 launcher.master_addr=HOST "
    "launcher.master_port=6010": Skip("two nodes: it waits for the second one at HOST"),

    # ---- docs/index.md, docs/quickstart.md, docs/quickstart_data.md
    "pip install torch==2.13.0": Skip(PIP),
    "pip install -e .": Skip(PIP),
    "python3 -m venv .venv && . .venv/bin/activate": Skip(
        "makes the environment the tests run in"),
    "python -m rapidformer": Run(short=SHORT_SYNTH),
    "rapidformer show precision=bf16 trainer.lr=5e-4": Run(output=("lr: 0.0005",)),
    "python -m rapidformer precision=bf16 trainer.lr=5e-4": Run(short=SHORT_SYNTH),
    "rapidformer plot outputs/*/*": Run(),
    "python -m rapidformer -m precision=fp32,bf16": Run(short=SHORT_SYNTH),
    "rapidformer plan +recipe=bert_mrpc memory.device_memory_gb=24":
        hub("bert-base-cased's config.json"),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install "
    "-q -e \".[test]\" && python -m pytest -q": Skip(PIP + ", then this test suite"),
    "python -m rapidformer.data.synthetic DIR --train 4000 --eval 400 --seed 1234": Run(
        stand_in={"DIR": "new:pairs"}),
    "python -m rapidformer data=pairs_local data.path=DIR": Run(
        short=FEW_STEPS, stand_in={"DIR": "new:pairs"}),

    # ---- docs/memory_plan.md
    "rapidformer plan +recipe=gpt_pretrain ... launcher.nproc_per_node=8": Skip(TEMPLATE),
    "python -m rapidformer +recipe=gpt_pretrain ... trainer.dry_run=true": Skip(TEMPLATE),
    "python -m rapidformer +recipe=gpt_pretrain ... memory=auto": Skip(TEMPLATE),
    "rapidformer plan ... memory.device_memory_gb=24": Skip(TEMPLATE),
    # GPT-2's own vocab.json and merges.txt are a download: a vocabulary of GPT-2's size
    # (50,257 entries) stands in, so that the plan's numbers are the page's
    "rapidformer plan +recipe=gpt_pretrain data.path=gpt_text_document "
    "model.tokenizer=gpt2-vocab.json model.merge_file=gpt2-merges.txt launcher.nproc_per_node=2 "
    "trainer.micro_batch_size=8 trainer.global_batch_size=16 data.max_seq_length=1024 "
    "precision=bf16 memory.device_memory_gb=24": Run(
        before=("write_gpt2_sized_vocabulary",), output=True),

    # ---- docs/parallelism.md
    "python -m rapidformer +recipe=gpt_pretrain model=megatron_gpt parallelism=tp2 "
    "launcher.nproc_per_node=2 precision=bf16 data.path=data/corpus_text_document "
    "model.tokenizer=gpt2/vocab.json model.merge_file=gpt2/merges.txt": gpu_sized(
        "GPT-2 small in bf16 at the recipe's global batch of 128",
        "tests/test_parallel.py (TP=2, PP=2 with megatron_gpt_tiny on 2 CPU processes)"),
    "python -m rapidformer ... parallelism=pp2 launcher.nproc_per_node=2": Skip(TEMPLATE),
    "python -m rapidformer ... parallelism.tensor_model_parallel_size=2 "
    "parallelism.pipeline_model_parallel_size=2 launcher.nproc_per_node=8": Skip(TEMPLATE),

    # ---- docs/pretraining.md
    "rapidformer-train-vocab --input corpus.json --type wordpiece --lowercase --vocab-size 1000 "
    "--output-dir my_wp": Run(),
    "rapidformer-preprocess-data --input corpus.json --output-prefix data/mine --vocab-file "
    "my_wp/vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences --workers 2": Run(),
    "python -m rapidformer +recipe=bert_pretrain data.path=data/mine_text_sentence "
    "model.tokenizer=my_wp/vocab.txt model=bert_tiny data.max_seq_length=128 "
    "trainer.micro_batch_size=16 trainer.global_batch_size=32 trainer.train_iters=200":
        Run(short=SHORT_PRETRAIN),
    "python -m rapidformer +recipe=gpt_pretrain data.path=data/corpus_text_document "
    "model.tokenizer=gpt2/vocab.json model.merge_file=gpt2/merges.txt model=gpt2_tiny "
    "data.max_seq_length=128 trainer.micro_batch_size=8 trainer.global_batch_size=32 "
    "trainer.train_iters=200": Run(short=SHORT_PRETRAIN),
    "python -m rapidformer +recipe=llama_pretrain data.path=data/corpus_text_document "
    "model.tokenizer=gpt2/vocab.json model.merge_file=gpt2/merges.txt model=llama_tiny "
    "data.max_seq_length=128 trainer.micro_batch_size=8 trainer.train_iters=200 graph=eager "
    "precision=fp32 trainer.device=cpu": Run(short=SHORT_PRETRAIN),
    "python -m rapidformer +recipe=gpt_pretrain model=megatron_gpt model.init_from_hf=DIR "
    "parallelism=tp2 launcher.nproc_per_node=2 data.path=... model.tokenizer=DIR/vocab.json "
    "model.merge_file=DIR/merges.txt": Skip(TEMPLATE),
    "python -m rapidformer +recipe=gpt_pretrain model=megatron_llama model.init_from_hf=DIR "
    "model.tokenizer_type=HuggingFaceTokenizer model.tokenizer=DIR data.path=... parallelism=tp2 "
    "launcher.nproc_per_node=2": Skip(TEMPLATE),
    # a tiny BERT for pretraining, built from a config on the page's WordPiece vocabulary, stands
    # in for the pretrained MODEL_DIR
    "rapidformer --user-script examples/rapidformer_pretrain_huggingface_bert_trainer.py "
    "--pretrained-model-name-or-path MODEL_DIR --micro-batch-size 16 --global-batch-size 64 "
    "--seq-length 512 --tokenizer-type BertWordPieceLowerCase --train-iters 100 --data-path "
    "data/corpus_text_sentence --vocab-file wp/vocab.txt --data-impl mmap --split 980,20 --lr 1e-3 "
    "--lr-decay-style linear --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01": Run(
        stand_in={"MODEL_DIR": "tiny_bert_pretraining"},
        flags=(("--train-iters", "2"), ("--eval-iters", "1"))),

    # ---- docs/reliability.md (not this file's page: its commands are campaigns and patterns)
    "python -m rapidformer ... &": Skip(TEMPLATE),
    "kill -TERM %1": Skip("stops the job above (a pattern); tests/test_preemption.py sends "
                          "SIGTERM to real runs"),
    "python -m rapidformer ... trainer.resume=auto": Skip(TEMPLATE),
    "python tools/kill_campaign.py --kills 20 --out docs/reliability/kill_campaign.json": Skip(
        "a campaign of 20 kills (about half an hour); its record is "
        "docs/reliability/kill_campaign.json, tests/test_kill_resume.py runs kills in CI"),
    "python tools/fault_campaign.py --out docs/reliability/fault_campaign.json": Skip(
        "a campaign (minutes per fault); its record is docs/reliability/fault_campaign.json, "
        "tests/test_faults.py runs faults in CI"),

    # ---- docs/seed_flags.md
    "rapidformer --task sequence_classification --pretrained-model-name-or-path bert-base-cased "
    "--data-path glue --data-name mrpc --micro-batch-size 16 --mixed-precision --print-hydra":
        Run(output=("python -m rapidformer",)),

    # ---- docs/tasks.md (and the recipes' headers)
    "python -m rapidformer +recipe=bert_ner model=bert_tiny data=local data.path=DIR "
    "trainer.lr=1e-3": Run(short=FEW_STEPS, stand_in={"DIR": "data:ner"}),
    "python -m rapidformer +recipe=bert_ner": hub("bert-base-cased and CoNLL-2003"),
    "python -m rapidformer +recipe=bert_squad model=bert_tiny data=local data.path=DIR "
    "data.max_seq_length=128 task.doc_stride=32 trainer.lr=1e-3": Run(
        short=FEW_STEPS, stand_in={"DIR": "data:squad"}),
    "python -m rapidformer +recipe=bert_squad": hub("bert-base-cased and SQuAD"),
    "python -m rapidformer +recipe=bert_mlm model=bert_tiny data=local data.path=DIR "
    "trainer.lr=1e-3": Run(short=FEW_STEPS, stand_in={"DIR": "data:text"}),
    "python -m rapidformer +recipe=bert_mlm task.whole_word_masking=true":
        hub("bert-base-cased and WikiText-2"),
    "python -m rapidformer +recipe=t5_summarize model=t5_tiny data=local data.path=DIR "
    "task.source_prefix=\"\" trainer.lr=3e-3": Run(
        short=FEW_STEPS, stand_in={"DIR": "data:summaries"}),
    "python -m rapidformer +recipe=t5_summarize task.num_beams=4": hub("t5-small and XSum"),
    "python -m rapidformer +recipe=llama_sft": Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=llama_sft data.packing=true": Run(short=SHORT_SYNTH),
    # the sft run's export (a tokenizer with its chat template) stands in for a pretrained model
    "python -m rapidformer +recipe=llama_sft model=hf model.name_or_path=MODEL_DIR data=local "
    "data.path=DIR data.chat_template=null trainer.lr=2e-5": Run(
        short=FEW_STEPS, stand_in={"MODEL_DIR": "sft_model", "DIR": "data:chat"}),
    "rapidformer generate RUN_DIR --input prompts.jsonl --output answers.jsonl": Run(
        stand_in=RUN_DIR_SFT, before=("head -3 RUN_DIR/data/validation.jsonl > prompts.jsonl",)),
    "pip install -e \".[peft]\"": Skip(PIP),
    "python -m rapidformer +recipe=llama_lora": Run(short=SHORT_SYNTH),
    "rapidformer export RUN_DIR --to ADAPTER_DIR --adapter-only": Run(
        stand_in={"RUN_DIR": "lora_run", "ADAPTER_DIR": "new:adapters"}),
    "python -m rapidformer +recipe=bert_mrpc model=bert_tiny data=synthetic_pairs peft=lora "
    "trainer.lr=1e-3": Run(short=SHORT_SYNTH),

    # ---- docs/tuning.md: the search on the CPU, then a run that finds it in the cache
    "rapidformer tune data.synthetic_train_size=800 trainer.epochs=1 accelerate.max_candidates=1 "
    "accelerate.steps=5 accelerate.warmup_steps=2 accelerate.max_fraction=100 "
    "'accelerate.axes=[sequences,micro_batch_size]' accelerate.cache_dir=tuning_cache": Run(
        output=("choice:", "python -m rapidformer")),
    "python -m rapidformer accelerate=auto data.synthetic_train_size=800 trainer.epochs=1 "
    "accelerate.max_candidates=1 accelerate.steps=5 accelerate.warmup_steps=2 "
    "accelerate.max_fraction=100 'accelerate.axes=[sequences,micro_batch_size]' "
    "accelerate.cache_dir=tuning_cache": Run(),
    "python -m rapidformer +recipe=bert_mrpc accelerate=auto": hub("bert-base-cased and glue/mrpc"),
    "rapidformer tune +recipe=llama_sft model=llama_1b precision=bf16 accelerate.budget_s=300":
        gpu_sized("Llama 1B candidates measured at sequence 2048", "docs/tuning.md's CPU lines"),
    # ---- docs/white_box.md: a tiny local BERT stands in for MODEL_DIR (bert-base-cased)
    "python -m rapidformer.data.synthetic data/pairs": Run(),
    "python -m rapidformer user_script=examples/finetuner_user_script.py model=hf "
    "model.name_or_path=MODEL_DIR data=pairs_local data.path=data/pairs": Run(
        short=FEW_STEPS, stand_in={"MODEL_DIR": "tiny_bert"}),
    "rapidformer --user-script examples/finetuner_user_script.py --pretrained-model-name-or-path "
    "MODEL_DIR --data-path data/pairs --micro-batch-size 16 --global-batch-size 64 --epochs 3":
        Run(stand_in={"MODEL_DIR": "tiny_bert"}, flags=(("--epochs", "1"),
                                                        ("--train-iters", "3"))),

    # ---- recipes/*.yaml headers (those no page shows)
    "python -m rapidformer +recipe=bert_mlm": hub("bert-base-cased and WikiText-2"),
    "python -m rapidformer +recipe=bert_mlm model=bert_tiny data=synthetic trainer.lr=1e-3":
        Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=bert_mrpc precision=fp16 memory=zero3":
        hub("bert-base-cased and glue/mrpc"),
    "python -m rapidformer +recipe=bert_mrpc model=bert_tiny data=pairs_local data.path=DIR": Run(
        short=FEW_STEPS, stand_in={"DIR": "pairs"}),
    "python -m rapidformer +recipe=bert_ner precision=bf16 memory=zero2 launcher.nproc_per_node=2":
        hub("bert-base-cased and CoNLL-2003"),
    "python -m rapidformer +recipe=bert_ner model=bert_tiny data=synthetic trainer.lr=1e-3":
        Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=bert_pretrain data.path=PREFIX_text_sentence "
    "model.tokenizer=vocab.txt": gpu_sized(
        "bert-base at sequence 512 and global batch 128", "docs/pretraining.md's CPU-sized line"),
    "python -m rapidformer +recipe=bert_pretrain data.path=... model.tokenizer=... precision=fp16 "
    "memory=fsdp": Skip(TEMPLATE),
    # the header's data step on a generated corpus and a vocabulary trained on it
    "rapidformer-preprocess-data --input corpus.json --output-prefix PREFIX --vocab-file vocab.txt "
    "--tokenizer-type BertWordPieceLowerCase --split-sentences --workers 8": Run(
        stand_in={"PREFIX": "new:corpus"},
        before=("python -m rapidformer.data.corpus corpus.json --docs 200",
                "rapidformer-train-vocab --input corpus.json --type wordpiece --lowercase "
                "--vocab-size 500 --output-dir .",)),
    "python -m rapidformer +recipe=bert_squad precision=bf16 launcher.nproc_per_node=2":
        hub("bert-base-cased and SQuAD"),
    "python -m rapidformer +recipe=bert_squad model=bert_tiny data=synthetic "
    "data.max_seq_length=128 task.doc_stride=32 trainer.lr=1e-3": Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=gpt_pretrain data.path=PREFIX_text_document "
    "model.tokenizer=gpt2-vocab.json model.merge_file=gpt2-merges.txt": gpu_sized(
        "GPT-2 small at sequence 512 and global batch 128", "docs/pretraining.md's CPU-sized line"),
    "rapidformer-preprocess-data --input corpus.json --output-prefix PREFIX --vocab-file "
    "gpt2-vocab.json --merge-file gpt2-merges.txt --tokenizer-type GPT2BPETokenizer --append-eod "
    "--workers 8": Run(
        stand_in={"PREFIX": "new:corpus"},
        before=("python -m rapidformer.data.corpus corpus.json --docs 200",
                "rapidformer-train-vocab --input corpus.json --type gpt2-bpe --vocab-size 500 "
                "--output-dir bpe", "mv bpe/vocab.json gpt2-vocab.json",
                "mv bpe/merges.txt gpt2-merges.txt")),
    "python -m rapidformer +recipe=llama_lora data.packing=true": Run(short=SHORT_SYNTH),
    "python -m rapidformer +recipe=llama_lora model=hf model.name_or_path=MODEL_DIR data=local "
    "data.path=DATA_DIR data.chat_template=null peft.modules_to_save=null trainer.lr=2e-4 "
    "precision=bf16": Run(short=FEW_STEPS,
                          stand_in={"MODEL_DIR": "sft_model", "DATA_DIR": "data:chat"}),
    "python -m rapidformer +recipe=llama_pretrain data.path=PREFIX_text_document "
    "model.tokenizer=gpt2-vocab.json model.merge_file=gpt2-merges.txt": gpu_sized(
        "Llama 1B at sequence 2048 under torch.compile", "docs/pretraining.md's CPU-sized line"),
    "python -m rapidformer +recipe=llama_pretrain ... precision=fp8 kernels=liger": Skip(TEMPLATE),
    "python -m rapidformer +recipe=llama_pretrain ... model=llama_tiny data.max_seq_length=64 "
    "trainer.micro_batch_size=4 graph=eager precision=fp32 trainer.device=cpu": Skip(TEMPLATE),
    "python -m rapidformer +recipe=llama_sft model=hf model.name_or_path=MODEL_DIR data=local "
    "data.path=DATA_DIR data.chat_template=null trainer.lr=2e-5 precision=bf16": Run(
        short=FEW_STEPS, stand_in={"MODEL_DIR": "sft_model", "DATA_DIR": "data:chat"}),
    "python -m rapidformer +recipe=quickstart_optuna -m hydra.sweeper.n_trials=20 "
    "hydra.sweeper.n_jobs=1": Run(short=(*SHORT_SYNTH, "hydra.sweeper.n_trials=2")),
    "python -m rapidformer +recipe=t5_summarize": hub("t5-small and XSum"),
    "python -m rapidformer +recipe=t5_summarize task.num_beams=4 precision=bf16":
        hub("t5-small and XSum"),
    "python -m rapidformer +recipe=t5_summarize model=t5_tiny data=synthetic "
    "task.source_prefix=\"\" trainer.lr=3e-3": Run(short=SHORT_SYNTH),
}

# Whole families, by their first words: the benchmark scripts measure (for minutes to hours, most
# on an H200), and their results are the tables of docs/benchmarks.md
SKIPPED_FAMILIES = {
    "python benchmarks/": Skip(
        "a benchmark: it measures for minutes to hours, most on an H200 (its results are "
        "docs/benchmarks.md's tables); `python benchmarks/run.py --smoke`, the suite's CPU form, "
        "runs in tests/test_benchmarks.py"),
    "bash tools/gpu/": Skip(
        "the GPU machine's script: it installs the carried wheels and runs benchmark rows on an "
        "H200 (tools/gpu/README.md)"),
}


def how_to(command: str) -> Run | Skip | None:
    for head, skip in SKIPPED_FAMILIES.items():
        if command.startswith(head):
            return skip
    return COMMANDS.get(command)


# Pages are sessions; a command several pages show runs on the first of them in this order (the
# pages whose later commands build on it first).
FIRST = ["docs/pretraining.md", "docs/cli.md", "docs/quickstart.md", "docs/tasks.md",
         "docs/data.md", "docs/white_box.md"]


def sessions() -> dict[str, list[Shown]]:
    by_page: dict[str, list[Shown]] = {}
    for shown in documented():
        by_page.setdefault(shown.page, []).append(shown)
    return dict(sorted(by_page.items(),
                       key=lambda kv: (FIRST.index(kv[0]) if kv[0] in FIRST else len(FIRST),
                                       kv[0].startswith("recipes/"), kv[0])))


def runs_here() -> dict[str, list[tuple[Shown, Run]]]:
    """page -> the commands it runs, in order (a command shown earlier in SESSIONS' order
    runs there, unless its block shows its output)."""
    ran: set[str] = set()
    plan = {}
    for page, shown in sessions().items():
        steps = []
        for item in shown:
            how = how_to(item.command)
            if not isinstance(how, Run) or (item.command in ran and not how.output):
                continue
            ran.add(item.command)
            steps.append((item, how))
        if steps:
            plan[page] = steps
    return plan


def test_every_documented_command_has_an_entry():
    shown = documented()
    missing = sorted({f"{s.where}: {s.command}" for s in shown if how_to(s.command) is None})
    assert not missing, ("documented commands this test neither runs nor skips (add each to "
                         "COMMANDS: Run(...) or Skip(reason)):\n" + "\n".join(missing))
    stale = sorted(set(COMMANDS) - {s.command for s in shown})
    assert not stale, "COMMANDS entries no page shows any more:\n" + "\n".join(stale)
    for item in shown:  # a reader learns on the page what a command needs beyond a CPU
        how = how_to(item.command)
        if isinstance(how, Skip) and how.says:
            assert re.search(rf"\b({'|'.join(how.says)})\b", item.context), \
                f"{item.where}: `{item.command}` {how.why}: say so on the page"
    for command, how in COMMANDS.items():
        if isinstance(how, Skip):
            assert len(how.why) > 20, f"`{command}`: say why it is not run"
        else:
            placeholders = set(re.findall(r"\b[A-Z][A-Z0-9_]*[A-Z]\b", command)) - {"AND"}
            assert placeholders <= set(how.stand_in), \
                f"`{command}`: say what stands in for {placeholders - set(how.stand_in)}"


def test_a_new_command_without_an_entry_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "new.md"
    page.parent.mkdir()
    page.write_text("# New\n\n```bash\npython -m rapidformer +recipe=brand_new  # says\n```\n")
    (tmp_path / "README.md").write_text("# Project\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (shown,) = documented()
    assert shown.command == "python -m rapidformer +recipe=brand_new"
    assert shown.where == "docs/new.md:4" and how_to(shown.command) is None


# -- running them -----------------------------------------------------------------------------

ENTRY_POINTS = {  # how a command's first words are called in this process
    ("python", "-m", "rapidformer"): "rapidformer.__main__",
    ("python", "-m", "rapidformer.data.corpus"): "rapidformer.data.corpus",
    ("python", "-m", "rapidformer.data.synthetic"): "rapidformer.data.synthetic",
    ("python", "-m", "rapidformer.data.preprocess_data"): "rapidformer.data.preprocess_data",
    ("rapidformer",): "rapidformer.cli.console",
    ("rapidformer-preprocess-data",): "rapidformer.data.preprocess_data",
    ("rapidformer-train-vocab",): "rapidformer.data.train_vocab",
}


def _call(args: list[str]) -> int:
    for head, module in sorted(ENTRY_POINTS.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[:len(head)]) == head:
            main = importlib.import_module(module).main
            try:
                result = main(args[len(head):])
            except SystemExit as exc:
                return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            return result if isinstance(result, int) else 0
    raise AssertionError(f"no entry point for {' '.join(args)}")


def _shortened(args: list[str], how: Run) -> list[str]:
    args = list(args)
    for override in how.short:
        key = override.split("=", 1)[0]
        at = [i for i, a in enumerate(args) if a.lstrip("+").split("=", 1)[0] == key]
        if at:
            args[at[0]] = override
        else:
            args.append(override)
    for flag, value in how.flags:
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def _expanded(args: list[str]) -> list[str]:
    """The shell's globbing: a word with * ? [ that matches files is those files."""
    out = []
    for arg in args:
        matches = sorted(glob.glob(arg)) if glob.has_magic(arg) else []
        out += matches or [arg]
    return out


class Stage:
    """The things that stand in for a page's placeholders, made once per test module."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[str, Path] = {}

    def resolve(self, name: str, folder: Path) -> str:
        if name.startswith("new:"):
            return name[4:]  # a path the command makes, in the page's folder
        if name == "tiny_bert_pretraining":
            return str(self._tiny_bert_pretraining(folder))
        if name not in self.made:
            self.made[name] = self._make(name)
        return str(self.made[name])

    def _run(self, name: str, *args: str) -> Path:
        run = self.root / name
        assert _call(["python", "-m", "rapidformer", *args, *SHORT_SYNTH,
                      f"trainer.output_dir={run}"]) == 0, f"stand-in {name} did not train"
        return run

    def _make(self, name: str) -> Path:
        if name == "quick_run":
            return self._run(name)
        if name == "sft_run":
            return self._run(name, "+recipe=llama_sft")
        if name == "lora_run":
            return self._run(name, "+recipe=llama_lora")
        if name == "sft_model":
            return Path(self.resolve("sft_run", self.root)) / "hf_model"
        if name == "pairs":
            out = self.root / "pairs"
            assert _call(["python", "-m", "rapidformer.data.synthetic", str(out), "--train", "64",
                          "--eval", "32"]) == 0
            return out
        if name.startswith("data:"):  # the task's generated example data (docs/tasks.md)
            from rapidformer.data.synthetic_tasks import main as synthetic_tasks

            out = self.root / name.replace(":", "_")
            synthetic_tasks([name[5:], str(out), "--train", "64", "--eval", "16"])
            return out
        if name == "tiny_bert":  # a tiny BERT classifier and its WordPiece vocabulary
            from transformers import BertConfig, BertForSequenceClassification

            from rapidformer.data.synthetic import make_split
            from rapidformer.data.tokenizers import train_wordpiece

            out = self.root / "tiny_bert"
            texts = [r[k] for r in make_split(300, 1) for k in ("sentence1", "sentence2")]
            tokenizer = train_wordpiece(texts, out, vocab_size=300, lowercase=True,
                                        max_length=64)
            BertForSequenceClassification(BertConfig(
                vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128)).save_pretrained(out)
            return out
        raise AssertionError(f"no stand-in named {name}")

    @staticmethod
    def _tiny_bert_pretraining(folder: Path) -> Path:
        """A config-built BERT for pretraining with the page's own WordPiece vocabulary."""
        from transformers import BertConfig, BertForPreTraining

        out = folder / "tiny_bert_pretraining"
        if not out.exists():
            size = len((folder / "wp" / "vocab.txt").read_text(encoding="utf-8").splitlines())
            BertForPreTraining(BertConfig(
                vocab_size=size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=512)).save_pretrained(out)
        return out


def _gpt2_sized_vocabulary(folder: Path) -> None:
    """gpt2-vocab.json with GPT-2's 50,257 entries (the 256 byte symbols, made-up words,
    <|endoftext|> last) and a merges.txt with none: GPT-2's shape without its download."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(50256 - len(vocab)):
        vocab[f"\u0120w{i:x}"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "gpt2-vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "gpt2-merges.txt").write_text("#version: 0.2\n", encoding="utf-8")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    return Stage(tmp_path_factory.mktemp("stand_ins"))


@pytest.fixture
def same_environment():
    """What the runs leave in os.environ (DeepSpeed's LOCAL_RANK) goes with the page."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _filled(text: str, how: Run, stage: Stage, folder: Path) -> str:
    for placeholder, name in how.stand_in.items():
        text = re.sub(rf"(?<![\w-]){re.escape(placeholder)}(?![\w-])",
                      lambda _: stage.resolve(name, folder), text)
    return text


def _shell(line: str, folder: Path) -> None:
    if line == "write_gpt2_sized_vocabulary":
        _gpt2_sized_vocabulary(folder)
        return
    args = shlex.split(line)
    if tuple(args[:1]) in {h[:1] for h in ENTRY_POINTS} and (
            args[0] != "python" or args[2].startswith("rapidformer")):
        assert _call(args) == 0, f"`{line}` failed"
        return
    subprocess.run(line, shell=True, cwd=folder, check=True)


def _output_holds(expected, shown: Shown, printed: str) -> None:
    lines = shown.output if expected is True else expected
    flat = " ".join(printed.split())
    for line in lines:
        if "..." in line:
            continue
        assert " ".join(line.split()) in flat, \
            f"`{shown.command}` ({shown.where}) did not print:\n{line}\nit printed:\n" \
            f"{printed[-3000:]}"


def _next_second() -> None:
    """A run's default directory is outputs/DATE/TIME (a sweep's multirun/DATE_TIME), to the
    second: a short run in this
    process can end within the second the one before it started, and the next would find that
    directory taken (not so for a person typing the next command)."""
    if any(Path(time.strftime(pattern)).exists()
           for pattern in ("outputs/%Y-%m-%d/%H-%M-%S", "multirun/%Y-%m-%d_%H-%M-%S")):
        time.sleep(1.01 - time.time() % 1)


PLAN = runs_here()


# the pages whose commands take over 15 s together (README.md 33 s, tuning.md 25 s,
# pretraining.md 18 s on 2 cores; the whole file about 125 s)
SLOW_PAGES = {"README.md", "docs/pretraining.md", "docs/tuning.md"}


@pytest.mark.parametrize("page", [pytest.param(page, marks=pytest.mark.slow)
                                  if page in SLOW_PAGES else page for page in PLAN])
def test_documented_commands_run(page, stage, tmp_path, monkeypatch, capsys, same_environment):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "examples").symlink_to(REPO / "examples")  # what the commands name in the repository
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", ["rapidformer"])  # the entry points set it
    last_code, ran = None, []
    for shown, how in PLAN[page]:
        for line in how.before:
            _shell(_filled(line, how, stage, folder), folder)
        line = _filled(shown.command, how, stage, folder)
        capsys.readouterr()
        if line == "echo $?":
            code, printed = 0, f"{last_code}\n"
        elif line.split()[0] in ("head",):
            code = subprocess.run(line, shell=True, cwd=folder).returncode
            printed = ""
        else:
            args = _expanded(_shortened(shlex.split(line), how))
            line = shlex.join(args)
            _next_second()
            code = _call(args)
            captured = capsys.readouterr()
            printed = captured.out + captured.err
        ran.append(f"{shown.where}: exit {code}: {line}")
        assert code == how.code, (f"`{shown.command}` ({shown.where}) exited {code}, the page "
                                  f"says {how.code}:\n{printed[-3000:]}\nthe page's commands "
                                  f"that ran:\n" + "\n".join(ran))
        if how.output:
            _output_holds(how.output, shown, printed)
        last_code = code
