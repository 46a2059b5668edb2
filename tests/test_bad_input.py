"""Bad input, case by case, through the real entry points (`python -m rapidformer` and the seed's
`rapidformer` console script, called in this process for speed): one clear message naming the
problem and the fix, a non-zero exit code, no traceback, and nothing already on disk changed.

The table in docs/reliability.md is made from these cases
(`python tools/bad_input_table.py` runs them and rewrites it with the messages they print).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from rapidformer.checkpoint import store as checkpoint
from tests.conftest import FAST, assert_ok, run_cli, run_in_process

QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false"]
# the one error line of `rapidformer ...` and of `rapidformer-preprocess-data ...`
ERROR_LINE = re.compile(r"^rapidformer(-preprocess-data)?: error")
PAIRS_HEADER = "sentence1,sentence2,label\n"


@dataclass
class Case:
    name: str  # what is wrong, as the docs table says it
    args: Callable[[dict], list[str]]  # the command line, from the prepared inputs
    expected: str  # a fragment of the message
    code: int = 2
    setup: Callable[[Path], dict] = field(default=lambda tmp: {})  # extra files for this case
    # or "cli": the seed's console script; "preprocess": python -m rapidformer.data.preprocess_data
    entry: str = "rapidformer"


def pairs(tmp: Path, name: str, text: bytes | str, filename: str = "train.csv") -> dict:
    folder = tmp / name
    folder.mkdir()
    data = text.encode() if isinstance(text, str) else text
    (folder / filename).write_bytes(data)
    return {name: folder}


def good_rows(n: int = 40, label=lambda i: i % 2) -> str:
    return "".join(f"a cat sat {i},a dog ran {i},{label(i)}\n" for i in range(n))


def local(key: str, *extra: str) -> Callable[[dict], list[str]]:
    return lambda p: ["data=pairs_local", f"data.path={p[key]}", *QUIET, *extra]


def megatron_copy(tmp: Path, data: dict, edit: Callable[[Path, Path], None]) -> dict:
    prefix = tmp / "gpt_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(data["gpt"] + ext, str(prefix) + ext)
    edit(Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx"))
    return {"prefix": prefix}


def gpt(prefix_key: str = "prefix", tokenizer: list[str] | None = None
        ) -> Callable[[dict], list[str]]:
    """The GPT pretraining recipe on `prepared[prefix_key]`; its GPT-2 BPE files unless
    `tokenizer` names others (keys of the pretraining_data fixture)."""
    def args(p: dict) -> list[str]:
        files = [f"model.tokenizer={p['data']['gpt2_vocab']}",
                 f"model.merge_file={p['data']['merges']}"]
        if tokenizer is not None:
            files = [t.format(**p["data"]) for t in tokenizer]
        return ["+recipe=gpt_pretrain", "model=gpt2_tiny", f"data.path={p[prefix_key]}", *files,
                "data.max_seq_length=64", "data.split=90,5,5", "trainer.micro_batch_size=4",
                "trainer.global_batch_size=16", *QUIET]
    return args


def truncate_bin(bin_path: Path, idx: Path) -> None:
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 10)


def scramble_idx(bin_path: Path, idx: Path) -> None:
    with open(idx, "r+b") as f:
        f.write(b"NOTMEGAT")


def user_script(tmp: Path, body: str) -> dict:
    script = tmp / "script.py"
    script.write_text(body)
    return {"script": script}


WRONG_SIGNATURE = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class MyFinetuner(SequenceClassificationFinetuner):
    def run_forward_step(self, batch):
        return super().run_forward_step(batch, self.model)


MyFinetuner(engine=RapidformerEngine()).train()
'''

NO_TEMPLATE = '''
print("a script that never builds a RapidformerEngine or a template")
'''

SYNTAX_ERROR = '''
from rapidformer import RapidformerEngine

engine = RapidformerEngine(
'''

MISSING_IMPORT = '''
import os

from rapidformer.tasks.nothing_here import MyFinetuner
'''

WRONG_PROVIDER = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class MyFinetuner(SequenceClassificationFinetuner):
    def train_valid_test_datasets_provider(self):
        train, valid, test, collate = super().train_valid_test_datasets_provider()
        return train, valid, test


MyFinetuner(engine=RapidformerEngine()).train()
'''

NEVER_TRAINS = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner

trainer = SequenceClassificationFinetuner(engine=RapidformerEngine())
'''


def foreign_dir(tmp: Path) -> dict:
    """A directory of the user's own files, e.g. the project root (trainer.output_dir=.)."""
    folder = tmp / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("my: own config\n")
    (folder / "status.json").write_text("{}\n")
    return {"project": folder}


def held_by_another_run(tmp: Path) -> dict:
    """A run directory whose lock another live run holds (an open flock, as a run keeps)."""
    import fcntl

    from rapidformer.checkpoint.run_dir import LOCK, RUN_MARKER

    folder = tmp / "busy"
    folder.mkdir()
    (folder / RUN_MARKER).touch()
    lock = open(folder / LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(json.dumps({"pid": 4242, "host": "node7", "started": "2026-12-01T10:00:00"}))
    lock.flush()
    return {"busy_lock": lock}

NAMES = lambda i: "yes" if i % 2 else "no"  # noqa: E731  (string labels)
NER_TRAIN = "".join(json.dumps({"tokens": ["anna", "met", "ben"], "ner_tags": t}) + "\n"
                    for t in ([1, 0, 1], [0, 0, 1]) * 4)
NER_NAMES = "".join(json.dumps({"tokens": ["anna", "met", "ben"],
                                "ner_tags": ["B-PER", "O", "B-PER"]}) + "\n" for _ in range(8))


def ner(key: str) -> Callable[[dict], list[str]]:
    return lambda p: ["+recipe=bert_ner", "model=bert_tiny", "data=local", f"data.path={p[key]}",
                      *QUIET]


def ner_dir(tmp: Path, name: str, **files: str) -> dict:
    folder = tmp / name
    folder.mkdir()
    for split, text in files.items():
        (folder / f"{split}.jsonl").write_text(text)
    return {name: folder}


def ner_rows(*rows) -> str:
    return "".join(json.dumps({"tokens": w, "ner_tags": t}) + "\n" for w, t in rows)


def preprocess(corpus_key: str, merges: str = "{merges}") -> Callable[[dict], list[str]]:
    """`python -m rapidformer.data.preprocess_data` on `prepared[corpus_key]` with the GPT-2
    files of the pretraining_data fixture (`merges`: another merges file)."""
    return lambda p: ["--input", str(p[corpus_key]), "--output-prefix", str(p["tmp"] / "out"),
                      "--vocab-file", str(p["data"]["gpt2_vocab"]),
                      "--merge-file", merges.format(merges=p["data"]["merges"], **p),
                      "--tokenizer-type", "GPT2BPETokenizer"]


def corpus(tmp: Path, name: str, data: bytes) -> dict:
    path = tmp / f"{name}.json"
    path.write_bytes(data)
    return {name: path}


def other_merges(tmp: Path) -> dict:
    """The merges file of a BPE trained on other text: it does not fit the fixture's vocab."""
    from tokenizers import ByteLevelBPETokenizer

    other = ByteLevelBPETokenizer()
    other.train_from_iterator(["zzzz qqqq xxxx"] * 3, vocab_size=270, min_frequency=1,
                              show_progress=False)
    folder = _dir(tmp / "other_bpe")
    other.save_model(str(folder))
    return {**corpus(tmp, "good_corpus", b'{"text": "a cat sat"}\n'),
            "other_merges": folder / "merges.txt"}


CASES = [
    # --- the config: keys, types, values ---------------------------------------------------------
    Case("unknown key", lambda p: ["trainer.lrr=0.1"],
         "trainer.lrr: unknown key; did you mean 'trainer.lr'?"),
    Case("misspelled group", lambda p: ["traner.lr=0.1"],
         "traner: unknown key; did you mean 'trainer'?"),
    Case("unknown group option", lambda p: ["precision=fp17"],
         "precision=fp17: no such option; did you mean 'precision=fp16'?"),
    Case("unknown recipe", lambda p: ["+recipe=bert_mrcp"], "did you mean 'recipe=bert_mrpc'?"),
    Case("wrong type (integer)", lambda p: ["trainer.micro_batch_size=abc"],
         "trainer.micro_batch_size: expected an integer, got 'abc'"),
    Case("wrong type (boolean)", lambda p: ["trainer.deterministic=maybe"],
         "trainer.deterministic: expected true or false"),
    Case("wrong choice", lambda p: ["optim.fused=yes"],
         "optim.fused: expected one of 'auto', 'on', 'off'"),
    Case("negative learning rate", lambda p: ["trainer.lr=-0.1"],
         "trainer.lr=-0.1 must not be negative"),
    Case("dropout out of range", lambda p: ["model.hidden_dropout=1.5"],
         "model.hidden_dropout=1.5 must be in [0, 1)"),
    Case("warm-up fraction out of range", lambda p: ["scheduler.warmup_fraction=1.5"],
         "scheduler.warmup_fraction=1.5 must be in [0, 1)"),
    Case("no length given", lambda p: ["trainer.epochs=null", "trainer.train_iters=null"],
         "set one of them, e.g. trainer.epochs=3"),
    Case("global batch not divisible",
         lambda p: ["trainer.global_batch_size=60", "trainer.micro_batch_size=16"],
         "trainer.global_batch_size=60 is not a multiple of trainer.micro_batch_size (16) x "
         "data-parallel size (1) = 16; set it to a multiple, e.g. trainer.global_batch_size=64"),
    Case("global batch vs processes", lambda p: ["launcher.nproc_per_node=3",
                                                 "trainer.micro_batch_size=16",
                                                 "trainer.global_batch_size=64"],
         "x data-parallel size (3) = 48"),
    Case("heads do not divide hidden size", lambda p: ["model.hidden_size=65"],
         "model.hidden_size=65 is not divisible by model.num_attention_heads"),
    Case("sequence longer than the positions", lambda p: ["data.max_seq_length=512"],
         "data.max_seq_length=512 is above model.max_position_embeddings=128"),
    Case("sequence too short for the special tokens", lambda p: ["data.max_seq_length=2"],
         "data.max_seq_length=2 must be at least 8: a task=sequence_classification sample is "
         "[CLS] text_a [SEP] text_b [SEP]"),
    Case("optimizer setting out of range", lambda p: ["optim.beta1=1.5"],
         "optim.beta1=1.5 must be in [0, 1) (AdamW's decay rate of the gradient average); set "
         "e.g. optim.beta1=0.9"),
    Case("setting of an option not picked", lambda p: ["memory.offload_optimizer=true"],
         "memory.offload_optimizer=true has no effect with memory=none; it is used by "
         "memory=zero1, zero2, zero3 or fsdp: choose one of those or drop the override"),
    Case("'+' on a key that exists", lambda p: ["+trainer.lr=1e-4"],
         "trainer.lr already exists in the config: write trainer.lr=1e-4 (no '+'); '+' adds a "
         "key that is not there"),
    Case("a sweep with a job whose config is invalid", lambda p: ["-m", "trainer.lr=-1"],
         "rapidformer: sweep: 1 of 1 jobs did not succeed (job 0: failed)", code=1),
    # --- settings that do not go together --------------------------------------------------------
    Case("tensor parallelism with a Hugging Face model",
         lambda p: ["parallelism=tp2", "launcher.nproc_per_node=2"],
         "needs a Megatron model, but model=bert_tiny is a Hugging Face model"),
    Case("fsdp and zero3 at once (seed flags)",
         lambda p: ["--zero-3-memory-optimization", "--fsdp-memory-optimization"],
         "conflicting flags: memory=fsdp and memory=zero3", entry="cli"),
    Case("fp16 with DeepSpeed on a CPU",
         lambda p: ["precision=fp16", "memory=zero2", "trainer.device=cpu"],
         "precision=fp16 with memory=zero2: DeepSpeed has no fp16 on a CPU"),
    Case("ONNX Runtime on an unsupported torch", lambda p: ["graph=ort", "trainer.device=cpu"],
         f"trains only with torch 2.4-2.6 (this environment: torch {torch.__version__}", code=3),
    Case("GPU asked for, none visible", lambda p: ["trainer.device=cuda"],
         "trainer.device=cuda but no CUDA GPU is visible"),
    # --- paths ------------------------------------------------------------------------------------
    Case("local data without a path", lambda p: ["data=pairs_local"],
         "data.path must be set"),
    Case("missing data directory", lambda p: ["data=pairs_local", f"data.path={p['tmp']}/nope"],
         "data directory not found"),
    Case("resume path that does not exist",
         lambda p: [f"trainer.resume={p['tmp']}/old_run/checkpoints/step_00000007"],
         "no such checkpoint directory; use trainer.resume=auto"),
    Case("output directory under a file",
         lambda p: [f"trainer.output_dir={p['blocker']}/run"],
         "cannot be created", setup=lambda tmp: {"blocker": _file(tmp / "blocker")}),
    Case("user script that does not exist", lambda p: [f"user_script={p['tmp']}/nope.py"],
         "no such file"),
    # --- run directories ----------------------------------------------------------------------
    Case("fresh run into a finished run's directory",
         lambda p: [*FAST, f"trainer.output_dir={p['tmp']}/run"],
         "holds an earlier run (its checkpoints or metrics); add trainer.resume=auto to continue "
         "it, trainer.overwrite=true to discard it"),
    Case("output directory holding the user's own files",
         lambda p: [*FAST, f"trainer.output_dir={p['project']}"],
         "holds files that no rapidformer run wrote (config.yaml, status.json)",
         setup=foreign_dir),
    Case("run directory in use by another run",
         lambda p: [*FAST, f"trainer.output_dir={p['tmp']}/busy"],
         "is in use by another run (pid 4242 on host node7, started 2026-12-01T10:00:00)",
         setup=held_by_another_run),
    Case("resume after the model size changed",
         lambda p: [*FAST, f"trainer.output_dir={p['tmp']}/run", "trainer.resume=auto",
                    "model.hidden_size=128"],
         "changed: model.hidden_size=128 (was 64); resume with the model settings it was "
         "written with"),
    # --- data files -------------------------------------------------------------------------------
    Case("no training file", local("empty_dir"), "no training file in",
         setup=lambda tmp: {"empty_dir": _dir(tmp / "empty_dir")}),
    Case("wrong columns", local("cols", *[a for a in FAST[2:] if "synthetic" not in a]), "column",
         setup=lambda tmp: pairs(tmp, "cols", "text,target\nhello,1\n" * 3)),
    Case("empty dataset", local("empty"), "holds no examples (only a header)",
         setup=lambda tmp: pairs(tmp, "empty", PAIRS_HEADER)),
    Case("labels out of range", local("labels", "task.num_labels=2"), "label",
         setup=lambda tmp: pairs(tmp, "labels", PAIRS_HEADER + good_rows(label=lambda i: i % 5))),
    Case("non-UTF-8 lines", local("latin1"), "is not valid UTF-8 text (line 3)",
         setup=lambda tmp: pairs(tmp, "latin1", (PAIRS_HEADER + "caf\u00e9,ok,1\n").encode()
                                 + "na\u00efve,ok,0\n".encode("latin-1"))),
    Case("corrupt JSON lines", local("badjson"),
         "badjson/train.jsonl line 1 is not valid JSON (Unterminated string starting at column "
         "38); a .jsonl file holds one JSON object per line: fix the line",
         setup=lambda tmp: pairs(tmp, "badjson", '{"sentence1": "a", "sentence2": "b", "la',
                                 filename="train.jsonl")),
    Case("runaway quote in a csv", local("runaway"),
         "runaway/train.csv line 4: a quote opens a field there and runs on to line 15, so "
         "lines 4-15 would be read as one field, but each of them reads as a row of its own",
         setup=lambda tmp: pairs(tmp, "runaway", PAIRS_HEADER + good_rows(2)
                                 + '"an open quote,b,1\n' + good_rows(10) + 'it ends",b,0\n'
                                 + good_rows(30))),
    Case("runaway quote in a quoted tsv", local("quoted_tsv", "data.quoting=csv"),
         "quoted_tsv/train.tsv line 3: a quote opens a field there and runs on to line 14",
         setup=lambda tmp: pairs(tmp, "quoted_tsv", (PAIRS_HEADER + good_rows(1) + '"open,b,1\n'
                                                     + good_rows(10) + 'end ",b,0\n'
                                                     + good_rows(30)).replace(",", "\t"),
                                 filename="train.tsv")),
    Case("tsv row wider than its header", local("wide_tsv"),
         "wide_tsv/train.tsv line 3 has 4 tab-separated fields, the header (line 1) has 3; if "
         "this file quotes its fields",
         setup=lambda tmp: pairs(tmp, "wide_tsv", (PAIRS_HEADER + good_rows(1)).replace(",", "\t")
                                 + '"a\tcat"\tb\t1\n', filename="train.tsv")),
    Case("JSON object over several lines", local("pretty"),
         "pretty/train.jsonl line 2 starts a JSON object that ends on line 6",
         setup=lambda tmp: pairs(tmp, "pretty", '{"sentence1": "a", "sentence2": "b", "label": 0}\n'
                                 + json.dumps({"sentence1": "c", "sentence2": "d", "label": 1},
                                              indent=1) + "\n", filename="train.jsonl")),
    Case("training file that is a directory", local("dir_file"),
         "dir_file/train.csv is a directory, not a data file: it cannot be read as the train split",
         setup=lambda tmp: {"dir_file": _dir(_dir(tmp / "dir_file") / "train.csv").parent}),
    Case("training file that is a symbolic link loop", local("link_loop"),
         "link_loop/train.csv is a symbolic link that loops (following it never reaches a file)",
         setup=lambda tmp: {"link_loop": _link_loop(_dir(tmp / "link_loop") / "train.csv")}),
    Case("empty label", local("nolabel"),
         "train.csv line 4 has an empty label in column 'label' (data.label_column); every "
         "training row needs a label",
         setup=lambda tmp: pairs(tmp, "nolabel", PAIRS_HEADER + "a,b,yes\nc,d,no\ne,f,\n"
                                 + good_rows(label=NAMES))),
    Case("fractional label", local("fraction"),
         "train.csv line 4 has the label 0.5 in column 'label' (data.label_column), which is no "
         "class",
         setup=lambda tmp: pairs(tmp, "fraction", PAIRS_HEADER
                                 + good_rows(label=lambda i: 0.5 if i == 2 else i % 2))),
    Case("validation label not in the training data",
         local("unseen", "data.validation_file=../unseen_dev/validation.csv"),
         "validation.csv line 3 has the label 'maybe' in column 'label' (data.label_column), "
         "which no training row has (the training labels: no, yes); add it to the training data",
         setup=lambda tmp: {**pairs(tmp, "unseen", PAIRS_HEADER + good_rows(label=NAMES)),
                            **pairs(tmp, "unseen_dev", PAIRS_HEADER + "a,b,yes\nc,d,maybe\n",
                                    filename="validation.csv")}),
    Case("validation label id above the training ids",
         local("unseen_id", "data.validation_file=../unseen_id_dev/validation.csv"),
         "validation.csv line 3 has label 2 but task.num_labels=2 (column 'label', "
         "data.label_column); labels must be 0..1",
         setup=lambda tmp: {**pairs(tmp, "unseen_id", PAIRS_HEADER + good_rows()),
                            **pairs(tmp, "unseen_id_dev", PAIRS_HEADER + "a,b,1\nc,d,2\n",
                                    filename="validation.csv")}),
    Case("token tag id above the training tags", ner("ner_range"),
         "validation.jsonl line 1 has tag id 5 for word 2 ('berlin') in column 'ner_tags' "
         "(data.tags_column), but there are 2 tags (ids 0..1)",
         setup=lambda tmp: ner_dir(tmp, "ner_range", train=NER_TRAIN,
                                   validation=ner_rows((["anna", "berlin"], [0, 5])))),
    Case("token tag that no training row has", ner("ner_unseen"),
         "validation.jsonl line 1 has the tag 'B-LOC' for word 2 ('berlin') in column "
         "'ner_tags' (data.tags_column), which no training row has (the training tags: O, B-PER)",
         setup=lambda tmp: ner_dir(tmp, "ner_unseen", train=NER_NAMES,
                                   validation=ner_rows((["anna", "berlin"], ["O", "B-LOC"])))),
    Case("fewer tags than words", ner("ner_short"),
         "train.jsonl line 9 has 3 words in column 'tokens' (data.tokens_column) but 2 tags in "
         "column 'ner_tags' (data.tags_column)",
         setup=lambda tmp: ner_dir(tmp, "ner_short",
                                   train=NER_TRAIN + ner_rows((["a", "b", "c"], [0, 1])))),
    Case("words as text, not a list", ner("ner_text"),
         "train.jsonl line 1 has the text 'anna met ben' in column 'tokens' "
         "(data.tokens_column), not a list of words",
         setup=lambda tmp: ner_dir(tmp, "ner_text", train=ner_rows(("anna met ben", [1, 0, 1])))),
    Case("null token tag", ner("ner_null"),
         "train.jsonl line 9 has no tag (null) for word 2 ('b') in column 'ner_tags' "
         "(data.tags_column)",
         setup=lambda tmp: ner_dir(tmp, "ner_null",
                                   train=NER_TRAIN + ner_rows((["a", "b"], [0, None])))),
    Case("Megatron data prefix missing", gpt("missing"), "does not exist; give the prefix",
         setup=lambda tmp: {"missing": tmp / "nothing_text_document"}),
    Case("truncated .bin", gpt(), "truncated",
         setup=lambda tmp: {"edit": truncate_bin}),
    Case("corrupt .idx", gpt(), "not a Megatron mmap index",
         setup=lambda tmp: {"edit": scramble_idx}),
    Case(".bin/.idx made with another vocabulary",
         gpt(tokenizer=["model.tokenizer_type=BertWordPieceLowerCase", "model.tokenizer={vocab}"]),
         "made with another vocabulary", setup=lambda tmp: {"edit": lambda b, i: None}),
    Case("vocab file that does not fit the tokenizer type",
         gpt(tokenizer=["model.tokenizer={vocab}", "model.merge_file={merges}"]),
         "is not a GPT-2 vocab.json (JSON); for a WordPiece vocab.txt use", setup=lambda tmp: {"edit": lambda b, i: None}),
    # --- preprocess_data ------------------------------------------------------------------------
    Case("merges file of another vocabulary", preprocess("good_corpus", "{other_merges}"),
         "(--merge-file) does not match", setup=other_merges, entry="preprocess"),
    Case("corpus byte that is not UTF-8", preprocess("latin1_corpus"),
         "latin1_corpus.json line 2, byte column 14: byte 0xe9 is not valid UTF-8",
         setup=lambda tmp: corpus(tmp, "latin1_corpus", b'{"text": "ok"}\n{"text": "caf\xe9 au '
                                                        b'lait"}\n'),
         entry="preprocess"),
    Case("corpus text that is not text", preprocess("number_corpus"),
         "number_corpus.json line 2, key 'text': a number (5), expected a string or a list of "
         "strings", setup=lambda tmp: corpus(tmp, "number_corpus",
                                             b'{"text": "ok"}\n{"text": 5}\n'),
         entry="preprocess"),
    Case("corpus of empty texts", preprocess("empty_corpus"),
         "every one of its 2 documents has an empty 'text' (no tokens); nothing written",
         setup=lambda tmp: corpus(tmp, "empty_corpus", b'{"text": ""}\n{"text": []}\n'),
         entry="preprocess"),
    # --- white-box scripts ------------------------------------------------------------------------
    Case("user script without a template", lambda p: [f"user_script={p['script']}", *FAST],
         "finished without creating a RapidformerEngine",
         setup=lambda tmp: user_script(tmp, NO_TEMPLATE)),
    Case("template method with a wrong signature",
         lambda p: [f"user_script={p['script']}", *FAST],
         "MyFinetuner.run_forward_step(self, batch) does not match the template's "
         "run_forward_step(self, batch, model)",
         setup=lambda tmp: user_script(tmp, WRONG_SIGNATURE)),
    Case("user script with a syntax error", lambda p: [f"user_script={p['script']}", *FAST],
         "script.py:4: SyntaxError: ", setup=lambda tmp: user_script(tmp, SYNTAX_ERROR)),
    Case("user script with a missing import", lambda p: [f"user_script={p['script']}", *FAST],
         "script.py:4: ModuleNotFoundError: No module named 'rapidformer.tasks.nothing_here'",
         setup=lambda tmp: user_script(tmp, MISSING_IMPORT)),
    Case("provider returning the wrong tuple", lambda p: [f"user_script={p['script']}", *FAST],
         "MyFinetuner.train_valid_test_datasets_provider() returned a tuple of 3 (Dataset, "
         "Dataset, Dataset); it must return (train_dataset, valid_dataset, test_dataset, "
         "collate_fn)", setup=lambda tmp: user_script(tmp, WRONG_PROVIDER)),
    Case("user script that never trains", lambda p: [f"user_script={p['script']}", *FAST],
         "created a RapidformerEngine but trained nothing (no trainer.train(), no "
         "engine.backward() or engine.step())",
         setup=lambda tmp: user_script(tmp, NEVER_TRAINS)),
    # --- a run that is over; what predict writes ----------------------------------------------
    Case("resume of a run that early stopping ended, with the same settings",
         lambda p: [*EARLY_STOP, f"trainer.output_dir={p['stopped']}", "trainer.resume=auto"],
         "is of a run that already stopped early at step 2 of 6 (no improvement of more than "
         "0.5 in validation/loss for 1 evaluation", setup=lambda tmp: early_stopped_run(tmp)),
    Case("predict --output a file that exists, without --overwrite",
         lambda p: ["predict", f"{p['tmp']}/run", "--input",
                    f"{p['tmp']}/run/data/validation.jsonl", "--output", str(p["mine"])],
         "exists; nothing was written: give --output another path, or add --overwrite to "
         "replace it", entry="cli", setup=lambda tmp: {"mine": _jsonl(tmp / "mine.jsonl")}),
    Case("predict --output the run's training data, with --overwrite",
         lambda p: ["predict", f"{p['tmp']}/run", "--input",
                    f"{p['tmp']}/run/data/validation.jsonl", "--output",
                    f"{p['tmp']}/run/data/train.jsonl", "--overwrite"],
         "is one of the run's data files", entry="cli"),
]

EARLY_STOP = [*FAST, "trainer.epochs=null", "trainer.train_iters=6", "trainer.eval_interval=1",
              "trainer.best_metric=validation/loss", "trainer.early_stopping_patience=1",
              "trainer.early_stopping_min_delta=0.5"]


def early_stopped_run(tmp: Path) -> dict:
    """A run that the second evaluation stopped early (the loss falls by far less than 0.5).
    Given as text, not a Path: its .lock is a claim's, rewritten by every start; the rest of
    it is compared in tests/test_trust_round3_review.py."""
    assert_ok(run_cli([*EARLY_STOP, f"trainer.output_dir={tmp / 'stopped'}"], cwd=tmp))
    return {"stopped": str(tmp / "stopped")}


def _jsonl(path: Path) -> Path:
    path.write_text('{"mine": 1}\n')
    return path


def _file(path: Path) -> Path:
    path.write_text("a file, not a directory\n")
    return path


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def _link_loop(path: Path) -> Path:
    """A symbolic link to itself, in a folder of its own (returned)."""
    os.symlink(path, path)
    return path.parent


def fingerprint(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def inputs(path: Path) -> dict[str, str]:
    """The bytes of a case's input: a directory, a file, or a Megatron prefix's .bin/.idx."""
    if path.is_dir():
        return fingerprint(path)
    files = [path] if path.is_file() else [Path(f"{path}{ext}") for ext in (".bin", ".idx")]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


# what a run leaves that a later command must never change; config.yaml, environment.json,
# status.json and the logs describe the newest attempt, and are rewritten by design
KEPT = ("checkpoints/", "hf_model/", "tokenizer/", "data/", "metrics.jsonl")


def results(run: Path) -> dict[str, str]:
    return {k: v for k, v in fingerprint(run).items() if k.startswith(KEPT)}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints and an export beside every bad command's own output
    directory; the cases that aim at it (a fresh run into it, a resume that cannot fit) name
    it, and no case may change a byte of what it holds. Trained in this process: the bad
    commands are the subject."""
    run = tmp_path_factory.mktemp("finished") / "run"
    run_in_process([*FAST, "trainer.train_iters=2", "trainer.save_interval=1",
                    f"trainer.output_dir={run}"], cwd=run.parent)
    return run


def call(entry: str, argv: list[str], capsys) -> tuple[int, str]:
    """Run an entry point in this process: (exit code, stderr)."""
    from rapidformer import __main__ as module_main
    from rapidformer.cli import console as cli

    os.environ.pop("RAPIDFORMER_DEBUG", None)
    from rapidformer.data import preprocess_data

    target = {"cli": cli.main, "preprocess": preprocess_data.main}.get(entry, module_main.main)
    try:
        target(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def record(case: Case, code: int, message: str) -> None:
    """Collect the messages for docs/reliability.md (tools/bad_input_table.py sets the file)."""
    path = os.environ.get("RAPIDFORMER_BAD_INPUT_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case.name, "code": code, "message": message}) + "\n")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_error_and_harms_nothing(case, tmp_path, finished_run, capsys,
                                                          pretraining_data, monkeypatch):
    if case.name == "GPU asked for, none visible" and torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = results(run)
    assert any(k.startswith("checkpoints/") for k in before)
    prepared = {"tmp": tmp_path, "data": pretraining_data, **case.setup(tmp_path)}
    if "edit" in prepared:
        prepared.update(megatron_copy(tmp_path, pretraining_data, prepared["edit"]))
    before_inputs = {k: inputs(v) for k, v in prepared.items()
                     if isinstance(v, Path) and v != tmp_path}
    monkeypatch.chdir(tmp_path)
    argv = case.args(prepared)
    if case.entry == "rapidformer" and not any(a.startswith("trainer.output_dir=") for a in argv):
        argv = [*argv, f"trainer.output_dir={tmp_path / 'new_run'}"]
    code, stderr = call(case.entry, argv, capsys)

    lines = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    message = "\n".join(stderr[stderr.index(lines[0]):].splitlines()) if lines else stderr
    record(case, code, message)
    assert code == case.code, stderr[-3000:]
    assert case.expected in message, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]  # one message, not one per layer
    assert "Traceback" not in stderr
    assert results(run) == before  # nothing rewritten, nothing added
    assert checkpoint.scan(run / "checkpoints")[0]  # the checkpoints still verify
    for key, fingerprint_before in before_inputs.items():
        assert inputs(prepared[key]) == fingerprint_before, key


def test_a_full_disk_during_a_checkpoint_keeps_the_earlier_ones(tmp_path, capsys, monkeypatch):
    """ENOSPC in the middle of the second checkpoint's model.pt, where the operating system
    reports it (torch's writer turns it into `RuntimeError: ... unexpected pos`): exit 74, one
    message naming the cause and the checkpoint left, the first checkpoint complete and no
    half-written directory left."""
    real_write = checkpoint.HashingWriter.write
    files = []

    def full_disk(self, data):
        if self not in files:
            files.append(self)
        if len(files) > 5:  # step_1's five torch.save files, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint.HashingWriter, "write", full_disk)
    run = tmp_path / "run"
    code, stderr = call("rapidformer", [*FAST, "trainer.train_iters=3", "trainer.save_interval=1",
                                        "trainer.export_hf=false", f"trainer.output_dir={run}"],
                        capsys)
    record(Case("disk full while writing a checkpoint (simulated)", lambda p: [], ""), code,
           stderr[stderr.index("rapidformer: error"):] if "rapidformer: error" in stderr
           else stderr)
    assert code == 74, stderr[-3000:]
    assert "could not write checkpoint" in stderr and "No space left on device" in stderr
    assert "the newest complete checkpoint, step_00000001, is untouched" in stderr
    assert "Traceback" not in stderr and stderr.count("rapidformer: error") == 1
    complete, broken = checkpoint.scan(run / "checkpoints")
    assert [p.name for p in complete] == ["step_00000001"] and not broken
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
