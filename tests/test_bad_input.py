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
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from rapidformer import checkpoint
from tests.conftest import FAST, assert_ok, run_cli

QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false"]
PAIRS_HEADER = "sentence1,sentence2,label\n"


@dataclass
class Case:
    name: str  # what is wrong, as the docs table says it
    args: Callable[[dict], list[str]]  # the command line, from the prepared inputs
    expected: str  # a fragment of the message
    code: int = 2
    setup: Callable[[Path], dict] = field(default=lambda tmp: {})  # extra files for this case
    entry: str = "rapidformer"  # or "cli": the seed's console script


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

    from rapidformer.runtime.run_dir import LOCK, RUN_MARKER

    folder = tmp / "busy"
    folder.mkdir()
    (folder / RUN_MARKER).touch()
    lock = open(folder / LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(json.dumps({"pid": 4242, "host": "node7", "started": "2026-12-01T10:00:00"}))
    lock.flush()
    return {"busy_lock": lock}

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
    Case("wrong columns", local("cols", *FAST[2:]), "column",
         setup=lambda tmp: pairs(tmp, "cols", "text,target\nhello,1\n" * 3)),
    Case("empty dataset", local("empty"), "holds no examples (only a header)",
         setup=lambda tmp: pairs(tmp, "empty", PAIRS_HEADER)),
    Case("labels out of range", local("labels", "task.num_labels=2"), "label",
         setup=lambda tmp: pairs(tmp, "labels", PAIRS_HEADER + good_rows(label=lambda i: i % 5))),
    Case("non-UTF-8 lines", local("latin1"), "is not valid UTF-8 text (line 3)",
         setup=lambda tmp: pairs(tmp, "latin1", (PAIRS_HEADER + "caf\u00e9,ok,1\n").encode()
                                 + "na\u00efve,ok,0\n".encode("latin-1"))),
    Case("corrupt JSON lines", local("badjson"), "cannot read",
         setup=lambda tmp: pairs(tmp, "badjson", '{"sentence1": "a", "sentence2": "b", "la',
                                 filename="train.jsonl")),
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
         "created a RapidformerEngine but trained nothing (no trainer.train(), no engine.step())",
         setup=lambda tmp: user_script(tmp, NEVER_TRAINS)),
]


def _file(path: Path) -> Path:
    path.write_text("a file, not a directory\n")
    return path


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


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
    it, and no case may change a byte of what it holds."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert_ok(run_cli([*FAST, "trainer.train_iters=2", "trainer.save_interval=1",
                       f"trainer.output_dir={run}"], cwd=run.parent))
    return run


def call(entry: str, argv: list[str], capsys) -> tuple[int, str]:
    """Run an entry point in this process: (exit code, stderr)."""
    from rapidformer import __main__ as module_main
    from rapidformer.cli import console as cli

    os.environ.pop("RAPIDFORMER_DEBUG", None)
    target = cli.main if entry == "cli" else module_main.main
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

    lines = [line for line in stderr.splitlines() if line.startswith("rapidformer: error")]
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
