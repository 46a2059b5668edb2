"""The original Rapidformer's command-line flags, each with the Hydra override it stands for
(docs/seed_flags.md has the table), and their translation (`translate`): what the console
script runs, what the verbs read (validate, show, plan) and what `rapidformer --help` shows."""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from rapidformer.cli.hydra_args import HYDRA_FLAGS, HYDRA_FLAGS_WITH_VALUE
from rapidformer.config.schema import PRETRAINING_TASKS
from rapidformer.errors import EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE

# seed flag -> override key, for flags that take one value and map one to one
VALUE_FLAGS = {
    "--epochs": "trainer.epochs",
    "--train-iters": "trainer.train_iters",
    "--micro-batch-size": "trainer.micro_batch_size",
    "--global-batch-size": "trainer.global_batch_size",
    "--lr": "trainer.lr",
    "--weight-decay": "trainer.weight_decay",
    "--clip-grad": "trainer.clip_grad",
    "--seed": "trainer.seed",
    "--log-interval": "trainer.log_interval",
    "--eval-interval": "trainer.eval_interval",
    "--save-interval": "trainer.save_interval",
    "--exit-interval": "trainer.exit_interval",
    "--save": "trainer.output_dir",
    "--lr-warmup-iters": "scheduler.warmup_iters",
    "--lr-warmup-fraction": "scheduler.warmup_fraction",
    "--min-lr": "scheduler.min_lr",
    "--lr-decay-iters": "scheduler.decay_iters",
    "--seq-length": "data.max_seq_length",
    "--num-labels": "task.num_labels",
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--max-position-embeddings": "model.max_position_embeddings",
    # Megatron-LM's; left out, 4 x --hidden-size as there (rapidformer/cli/console.py)
    "--ffn-hidden-size": "model.intermediate_size",
    "--tensor-model-parallel-size": "parallelism.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallelism.pipeline_model_parallel_size",
    "--user-script": "user_script",
    "--eval-iters": "trainer.eval_iters",
    "--data-impl": "data.impl",
    "--split": "data.split",
    "--mask-prob": "data.mask_prob",
    "--short-seq-prob": "data.short_seq_prob",
    "--merge-file": "model.merge_file",
    # torchrun's names; the seed's scripts set these through the environment instead
    # (CUDA_VISIBLE_DEVICES, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), which works too
    "--nproc-per-node": "launcher.nproc_per_node",
    "--nnodes": "launcher.nnodes",
    "--node-rank": "launcher.node_rank",
    "--master-addr": "launcher.master_addr",
    "--master-port": "launcher.master_port",
}
# seed switch -> the override it stands for
SWITCHES = {
    "--mixed-precision": "precision=fp16",
    "--fp16": "precision=fp16",
    "--bf16": "precision=bf16",
    "--onnx-runtime-training": "graph=ort",
    "--zero-1-memory-optimization": "memory=zero1",
    "--zero-2-memory-optimization": "memory=zero2",
    "--zero-3-memory-optimization": "memory=zero3",
    "--fsdp-memory-optimization": "memory=fsdp",
    "--mmap-warmup": "data.mmap_warmup=true",
    "--eod-mask-loss": "data.eod_mask_loss=true",
    "--reset-position-ids": "data.reset_position_ids=true",
    "--checkpoint-activations": "trainer.checkpoint_activations=true",
    "--sequence-parallel": "parallelism.sequence_parallel=true",
    # Megatron-LM's name for its distributed optimizer (memory=zero1 on Megatron models)
    "--use-distributed-optimizer": "memory=zero1",
    # Megatron-LM's: BERT pretraining without next-sentence prediction (document-level data)
    "--bert-no-binary-head": "task.binary_head=false",
}
# seed flags whose feature arrives later: refused by name, with what it needs
NOT_YET: dict[str, str] = {}
# the seed's task names -> task options; `pretraining` is the seed's BERT pretraining, and its
# docs spell causal LM both ways
TASKS = {"sequence_classification": "sequence_classification",
         "token_classification": "token_classification",
         "question_answering": "question_answering", "masked_lm": "masked_lm",
         "seq2seq_lm": "seq2seq_lm",
         "pretraining": "bert_pretraining", "bert_pretraining": "bert_pretraining",
         "causal_lm": "causal_lm", "casual_lm": "causal_lm"}
# the model a seed line builds when it names no pretrained one, as Megatron-LM's pretraining
# scripts do from --num-layers, --hidden-size, ...: by family (the task's, else the tokenizer
# type's), and megatron-core's model when tensor or pipeline parallelism is asked for
SEED_MODELS = {("gpt", False): "gpt2_small", ("gpt", True): "megatron_gpt",
               ("bert", False): "bert_base", ("bert", True): "megatron_bert"}
TASK_FAMILIES = {"causal_lm": "gpt", "bert_pretraining": "bert"}
TOKENIZER_FAMILIES = {"GPT2BPETokenizer": "gpt", "BertWordPieceLowerCase": "bert",
                      "BertWordPieceCase": "bert"}
# tokenizer type -> lowercasing (None: the tokenizer's own)
TOKENIZER_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False,
                   "GPT2BPETokenizer": None, "HuggingFaceTokenizer": None}
ALL_FLAGS = sorted({*VALUE_FLAGS, *SWITCHES, *NOT_YET, "--task", "--pretrained-model-name-or-path",
                    "--data-path", "--dataset-path", "--data-name", "--dataset-name",
                    "--lr-decay-style", "--tokenizer-type", "--vocab-file", "--vocab",
                    "--print-hydra"})


class SeedFlagError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rapidformer", add_help=False, allow_abbrev=False)
    for flag in VALUE_FLAGS:
        parser.add_argument(flag)
    for flag in SWITCHES:
        parser.add_argument(flag, action="store_true")
    for flag in ("--task", "--pretrained-model-name-or-path", "--lr-decay-style",
                 "--tokenizer-type", "--data-name"):
        parser.add_argument(flag)
    parser.add_argument("--data-path", "--dataset-path", dest="data_path")
    parser.add_argument("--dataset-name", dest="data_name")
    parser.add_argument("--vocab-file", "--vocab", dest="vocab_file")
    parser.add_argument("--print-hydra", action="store_true")
    return parser


def translate(argv: list[str]) -> tuple[list[str], list[str], bool]:
    """(Hydra flags, overrides, print_only) for a command line of seed flags and overrides."""
    parser = _parser()
    hydra_flags, seed_args, overrides = [], [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in HYDRA_FLAGS:
            hydra_flags.append(arg)
            if name in HYDRA_FLAGS_WITH_VALUE and i + 1 < len(argv):
                hydra_flags.append(argv[i + 1])
                i += 1
        elif arg.startswith("-"):
            seed_args.append(arg)
            if (name in VALUE_FLAGS or name not in {*SWITCHES, "--print-hydra"}) \
                    and "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                seed_args.append(argv[i + 1])
                i += 1
        else:
            overrides.append(arg)
        i += 1
    unknown = [a for a in seed_args if a.startswith("--") and a.split("=", 1)[0] not in ALL_FLAGS]
    if unknown:
        lines = []
        for flag in unknown:
            hint = difflib.get_close_matches(flag.split("=", 1)[0], ALL_FLAGS, n=1)
            lines.append(f"{flag} (did you mean {hint[0]}?)" if hint else flag)
        raise SeedFlagError("unknown flag(s): " + ", ".join(lines) +
                            "; docs/seed_flags.md lists the flags and their overrides")
    args = parser.parse_args(seed_args)
    return hydra_flags, _to_overrides(args) + overrides, args.print_hydra


def _to_overrides(args: argparse.Namespace) -> list[str]:
    later = [flag for flag in NOT_YET
             if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if later:
        needs = "; ".join(f"{flag} needs {NOT_YET[flag]}" for flag in later)
        raise SeedFlagError(f"not available in this version yet: {needs}", EXIT_NOT_AVAILABLE)
    out: list[str] = []
    if args.task:
        if args.task not in TASKS:
            raise SeedFlagError(f"--task {args.task}: unknown task; choose one of "
                                f"{', '.join(TASKS)}")
        if args.task == "casual_lm":
            print("rapidformer: note: --task casual_lm is the seed docs' spelling of causal_lm; "
                  "running task=causal_lm", file=sys.stderr)
        out.append(f"task={TASKS[args.task]}")
    if args.pretrained_model_name_or_path:
        out += ["model=hf", f"model.name_or_path={args.pretrained_model_name_or_path}"]
    pretraining = args.data_impl is not None or TASKS.get(args.task) in PRETRAINING_TASKS \
        or bool(args.data_path and Path(args.data_path + ".idx").is_file())
    out += _model_overrides(args, pretraining)
    if args.data_path:
        out += _data_overrides(args.data_path, args.data_name, pretraining,
                               TASKS.get(args.task, "sequence_classification"))
    elif args.data_name:
        out.append(f"data.subset={args.data_name}")
    if args.lr_decay_style:
        out.append(f"scheduler={args.lr_decay_style}")
    if args.tokenizer_type:
        if args.tokenizer_type not in TOKENIZER_TYPES:
            raise SeedFlagError(f"--tokenizer-type {args.tokenizer_type}: unknown; choose one of "
                                f"{', '.join(TOKENIZER_TYPES)}")
        out.append(f"model.tokenizer_type={args.tokenizer_type}")
        if TOKENIZER_TYPES[args.tokenizer_type] is not None:
            out.append(f"model.lowercase={str(TOKENIZER_TYPES[args.tokenizer_type]).lower()}")
    if args.vocab_file:
        out.append(f"model.tokenizer={args.vocab_file}")
    switches = [o for flag, o in SWITCHES.items() if getattr(args, flag[2:].replace("-", "_"))]
    for group in ("precision", "memory"):
        chosen = sorted({o for o in switches if o.startswith(group + "=")})
        if len(chosen) > 1:
            raise SeedFlagError(f"conflicting flags: {' and '.join(chosen)}; choose one")
    out += list(dict.fromkeys(switches))
    for flag, key in VALUE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out.append(f"{key}={value}")
    return out


def _whole(value: str | None) -> int | None:
    """A flag's whole number, or None (a value that is none is the config's to refuse)."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _model_overrides(args: argparse.Namespace, pretraining: bool) -> list[str]:
    """The model a seed line without --pretrained-model-name-or-path builds, as Megatron-LM's
    pretraining scripts do: a GPT for --task causal_lm, a BERT for --task pretraining (without
    a task, on pretraining data, the --tokenizer-type's family), megatron-core's model when
    --tensor- or --pipeline-model-parallel-size is above 1, shaped by --num-layers,
    --hidden-size, --num-attention-heads, --max-position-embeddings (their overrides), and
    --ffn-hidden-size, 4 x --hidden-size where not given (Megatron-LM's default)."""
    if args.pretrained_model_name_or_path:
        return []  # the checkpoint's own shape; the shape flags are checked against it
    family = TASK_FAMILIES.get(TASKS.get(args.task, ""))
    if family is None and args.task is None and pretraining:
        family = TOKENIZER_FAMILIES.get(args.tokenizer_type or "")
    out = []
    if family is not None:
        parallel = any((_whole(size) or 1) > 1 for size in (
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size))
        out.append(f"model={SEED_MODELS[family, parallel]}")
    hidden = _whole(args.hidden_size)
    if hidden is not None and args.ffn_hidden_size is None:
        out.append(f"model.intermediate_size={4 * hidden}")
    return out


def _data_overrides(path: str, name: str | None, pretraining: bool,
                    task: str = "sequence_classification") -> list[str]:
    """--data-path: a Megatron prefix (pretraining), a local file or directory, GLUE/MRPC, or
    any other hub dataset."""
    if pretraining or Path(path + ".idx").is_file():
        return ["data=megatron", f"data.path={path}"]
    if Path(path).exists():
        local = "pairs_local" if task == "sequence_classification" else "local"
        return [f"data={local}", f"data.path={path}"]
    if path == "glue" and name == "mrpc":
        return ["data=glue_mrpc"]
    return ["data=hub", f"data.path={path}", *([f"data.subset={name}"] if name else [])]
