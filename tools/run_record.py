"""Record what a fixed table of short rapidformer runs does, so that a refactor can be compared
with the code before it run for run: per-step losses, lr and grad norms, evaluation metrics,
the checkpoint trees, the exported tensors and the log lines, each normalized so that the same
behaviour gives the same record (no timestamps, throughput, absolute paths or ports).

    python tools/run_record.py --out RECORD.json [--only NAME ...] [--workdir DIR]
    python tools/run_record.py --diff BEFORE.json AFTER.json    # exit 1 on any difference
    python tools/run_record.py --list                           # the rows and their commands

Every row runs `python -m rapidformer ...` (or the console script's module, for verbs) in a
subprocess with the interpreter running this script, so the record is of whichever
rapidformer that interpreter imports:

    OLD_VENV/bin/python tools/run_record.py --out before.json --workdir WORK_BEFORE
    NEW_VENV/bin/python tools/run_record.py --out after.json --workdir WORK_AFTER
    python tools/run_record.py --diff before.json after.json

The runs are CPU-only, one thread per process, offline; the whole table takes a few minutes on
2 cores. A row that exits otherwise than its table entry expects (0, or 2 for a refusal) is
reported at the end and makes the exit status 1; its record is still written. Give the work
directory a distinctive name (record_before, not x): its name is how a path stored part by
part inside a binary file is recognized.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# --- the table ----------------------------------------------------------------------------

# no network; CUDA hidden so that a GPU machine records the same CPU runs (and the same
# refusals); one thread per process so the float reductions, and so the digits, do not depend
# on the core count; a fixed hash seed so set-ordered names print in one order
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "HYDRA_FULL_ERROR": "0", "CUDA_VISIBLE_DEVICES": "",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}

QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu",
         "trainer.log_interval=1"]
# 16 steps of 2 micro-batches over 2 epochs; checkpoints at 6 and 12 (12 and 16 kept)
QUICKSTART = ["+recipe=quickstart", *QUIET, "data.synthetic_train_size=256",
              "data.synthetic_eval_size=64", "trainer.micro_batch_size=16",
              "trainer.global_batch_size=32", "trainer.epochs=2", "trainer.save_interval=6"]
# 12 steps of the chat recipes (8 a epoch: an epoch boundary inside), eval and save at 6 and 12
CHAT = [*QUIET, "data.synthetic_train_size=128", "data.synthetic_eval_size=16",
        "trainer.epochs=null", "trainer.train_iters=12", "trainer.eval_interval=6",
        "trainer.save_interval=6", "task.sample_generations=4"]
TWO_RANKS = ["launcher.nproc_per_node=2", "trainer.micro_batch_size=8"]
GPT_DATA = ["data.path={data}/gpt_text_document", "model.tokenizer={data}/gpt2/vocab.json",
            "model.merge_file={data}/gpt2/merges.txt"]
# tests/test_parallel.py's tiny layout-independent job, with eval and save half-way
PRETRAIN = ["data.max_seq_length=64", "data.num_workers=0", "trainer.micro_batch_size=4",
            "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.train_iters=8",
            "trainer.eval_interval=4", "trainer.eval_iters=1", "trainer.save_interval=4", *QUIET]
MEGATRON_GPT = ["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", *GPT_DATA, *PRETRAIN]
HF_GPT = ["+recipe=gpt_pretrain", "model=gpt2_tiny", *GPT_DATA, *PRETRAIN]
MEGATRON_BERT = ["+recipe=bert_pretrain", "model=megatron_bert_tiny",
                 "data.path={data}/bert_text_sentence",
                 "model.tokenizer={data}/wordpiece/vocab.txt", *PRETRAIN,
                 "trainer.micro_batch_size=8", "trainer.lr=2e-3"]
REFUSED = 2  # the CLI's exit code for a refused config or input


@dataclass(frozen=True)
class Row:
    name: str
    # each command: a program key (see PROGRAMS) and its arguments, with {run}, {work}, {data}
    commands: tuple[tuple[str, ...], ...]
    expect: int = 0  # the last command's exit code
    run: str | None = None  # the run directory's name when it is not the row's own
    needs: tuple[str, ...] = ()  # rows whose run directories this one reads
    continues: bool = False  # goes on in the run directory an earlier row left (a resume)
    timeout: int = 240
    fresh_dir: bool = False  # the commands write into {run}, which must exist


PROGRAMS = {"rapidformer": ["-m", "rapidformer"], "console": ["-m", "rapidformer.cli.console"],
            "corpus": ["-m", "rapidformer.data.corpus"],
            "preprocess": ["-m", "rapidformer.data.preprocess_data"]}


def train(name: str, *args: str, **kw) -> Row:
    return Row(name, (("rapidformer", *args, "trainer.output_dir={run}"),), **kw)


def verb(name: str, source: str, *args: str, **kw) -> Row:
    return Row(name, (("console", *args),), needs=(source,), **kw)


def export(name: str, source: str, *flags: str) -> Row:
    return verb(name, source, "export", "{work}/" + source, "--to", "{run}", *flags)


def pretraining_data() -> Row:
    """The generated corpus, its vocabularies and both Megatron preprocessings, as
    docs/pretraining.md makes them (600 documents: a few seconds)."""
    return Row("pretraining_data", (
        ("corpus", "{run}/corpus.json", "--docs", "600", "--seed", "3", "--wordpiece-vocab",
         "{run}/wordpiece", "--gpt2-bpe", "{run}/gpt2", "--vocab-size", "1000"),
        ("preprocess", "--input", "{run}/corpus.json", "--output-prefix", "{run}/bert",
         "--vocab-file", "{run}/wordpiece/vocab.txt", "--tokenizer-type",
         "BertWordPieceLowerCase", "--split-sentences", "--workers", "1"),
        ("preprocess", "--input", "{run}/corpus.json", "--output-prefix", "{run}/gpt",
         "--vocab-file", "{run}/gpt2/vocab.json", "--merge-file", "{run}/gpt2/merges.txt",
         "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1")),
        fresh_dir=True, timeout=180)


def table() -> list[Row]:
    data = ("pretraining_data",)
    multi = 420  # two ranks start two interpreters and a launcher
    return [
        train("quickstart", *QUICKSTART),
        verb("quickstart_verify", "quickstart", "verify", "{work}/quickstart"),
        # a resume: the first half stops at step 6, the second goes on in the same directory
        train("quickstart_exit", *QUICKSTART, "trainer.exit_interval=6", run="quickstart_split"),
        train("quickstart_resume", *QUICKSTART, "trainer.resume=auto", run="quickstart_split",
              needs=("quickstart_exit",), continues=True),
        train("quickstart_unpad", *QUICKSTART, "trainer.unpad=true"),
        train("quickstart_lora", *QUICKSTART, "peft=lora"),
        train("quickstart_lora_unpad_refused", *QUICKSTART, "peft=lora", "trainer.unpad=true",
              expect=REFUSED),
        train("llama_sft", "+recipe=llama_sft", *CHAT),
        train("llama_sft_packed", "+recipe=llama_sft", *CHAT, "data.packing=true"),
        train("llama_lora", "+recipe=llama_lora", *CHAT),
        export("llama_lora_export", "llama_lora"),
        export("llama_lora_export_adapter", "llama_lora", "--adapter-only"),
        train("llama_lora_packed", "+recipe=llama_lora", *CHAT, "data.packing=true"),
        train("llama_lora_zero2", "+recipe=llama_lora", *CHAT, *TWO_RANKS, "memory=zero2",
              timeout=multi),
        export("llama_lora_zero2_export", "llama_lora_zero2"),
        train("llama_lora_fsdp", "+recipe=llama_lora", *CHAT, *TWO_RANKS, "memory=fsdp",
              timeout=multi),
        export("llama_lora_fsdp_export", "llama_lora_fsdp"),
        # float8 on a CPU: refused by the config check; emulated, refused by the layer
        # conversion (every layer of the tiny model is "too small") unless told to convert all
        train("fp8_refused", *QUICKSTART, "precision=fp8", expect=REFUSED),
        train("fp8_emulated_refused", "+recipe=llama_sft", *CHAT, "precision=fp8",
              "precision.fp8_emulate=true", expect=REFUSED),
        train("fp8_emulated", "+recipe=llama_sft", *CHAT, "precision=fp8",
              "precision.fp8_emulate=true", "precision.fp8_skip_small=false"),
        train("qlora_refused", "+recipe=llama_lora", *CHAT, "peft=qlora", expect=REFUSED),
        train("liger_refused", "+recipe=llama_sft", *CHAT, "kernels=liger", expect=REFUSED),
        pretraining_data(),
        train("gpt_megatron", *MEGATRON_GPT, needs=data),
        train("gpt_megatron_tp2", *MEGATRON_GPT, "parallelism=tp2", "launcher.nproc_per_node=2",
              needs=data, timeout=multi),
        train("gpt_megatron_pp2", *MEGATRON_GPT, "parallelism=pp2", "launcher.nproc_per_node=2",
              needs=data, timeout=multi),
        train("gpt_megatron_pp2_exit", *MEGATRON_GPT, "parallelism=pp2",
              "launcher.nproc_per_node=2", "trainer.exit_interval=4", run="gpt_megatron_pp2_split",
              needs=data, timeout=multi),
        train("gpt_megatron_pp2_resume", *MEGATRON_GPT, "parallelism=pp2",
              "launcher.nproc_per_node=2", "trainer.resume=auto", run="gpt_megatron_pp2_split",
              needs=("gpt_megatron_pp2_exit",), continues=True, timeout=multi),
        train("gpt2_pretrain", *HF_GPT, needs=data),
        train("gpt2_pretrain_exit", *HF_GPT, "trainer.exit_interval=4", run="gpt2_pretrain_split",
              needs=data),
        train("gpt2_pretrain_resume", *HF_GPT, "trainer.resume=auto", run="gpt2_pretrain_split",
              needs=("gpt2_pretrain_exit",), continues=True),
        train("bert_megatron", *MEGATRON_BERT, needs=data),
    ]


def select(rows: list[Row], only: list[str] | None) -> list[Row]:
    """The rows named and every row they need, in table order."""
    if not only:
        return rows
    by_name = {r.name: r for r in rows}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        sys.exit(f"unknown row(s): {', '.join(unknown)}; --list shows the table")
    wanted, todo = set(), list(only)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(by_name[name].needs)
    return [r for r in rows if r.name in wanted]


def command_text(command: tuple[str, ...]) -> str:
    """The command as recorded: placeholders, not this machine's paths."""
    args = [a.replace("{data}", "{work}/pretraining_data") for a in command[1:]]
    text = " ".join(["python", *PROGRAMS[command[0]], *args])
    return text.replace("{run}", "<RUN>").replace("{work}", "<WORK>")


# --- normalization ------------------------------------------------------------------------

TIMESTAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]")
ROLE = re.compile(r"^\[([a-z_]+\d+)\]:")  # torchrun's tee of a worker's lines
# hydra's log format with a rapidformer logger (workers log as "rank N"), and the console's lines
RECORD_LINE = re.compile(r"^\[(rapidformer[\w.]*|rank \d+)\]\[[A-Z]+\] - ")
CONSOLE_LINE = re.compile(r"^rapidformer(-preprocess-data)?: |^python -m rapidformer[\w.]*: ")
INDENTED = re.compile(r"^  +\w")
# a library's logger in a verb's stdout (DeepSpeed's "[WARNING] [file.py:N:func]"): printed or
# not depending on what happened to be imported, not on what the verb did
LIBRARY_LOG = re.compile(r"^\s*\[(DEBUG|INFO|WARNING)\]\s*\[[\w.]+:\d+")
PROGRESS = re.compile(r"\d+%\|")  # tqdm's bars
# numbers that measure time or speed, which no two runs share
MASKS = [
    (re.compile(r"\d[\d,]*(\.\d+)?(e[+-]?\d+)?\s*([A-Za-z]+)/s\b"), r"<N> \3/s"),
    (re.compile(r"\d+(\.\d+)?% waiting for data"), "<N>% waiting for data"),
    (re.compile(r"\b\d+(\.\d+)?\s*(ms|s|sec|seconds|min|minutes|h)\b(?!/)"), r"<N> \2"),
    (re.compile(r"\b\d+(\.\d+)?\s*(GB|GiB)\b"), r"<N> \2"),
    (re.compile(r"\b(\d{1,3}(\.\d{1,3}){3}|localhost):\d+"), r"\1:<PORT>"),
    (re.compile(r"\bpid[ =:]*\d+"), "pid <PID>"),
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d([.,]\d+)?"), "<TIME>"),
]
# run-directory names that carry a timestamp, a pid, a host or a random id
NAME_MASKS = [
    (re.compile(r"events\.out\.tfevents\.[^/]+"), "events.out.tfevents.<ID>"),
    (re.compile(r"(logs/node\d+)/[^/]+(/attempt_\d+)"), r"\1/<ID>\2"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "<HASH>"),  # megatron-core's index cache (it hashes paths)
    (re.compile(r"\.tmp-([^/]*?)-[a-z0-9_]{8}$"), r".tmp-\1-<ID>"),
]
# JSON keys whose values are digests or clock readings: masked, the key kept
VOLATILE_KEY = re.compile(r"sha256|^time|_time|time_|timestamp|^date$|_date|elapsed|seconds"
                          r"|duration|^wall|started|finished|^pid$|^host$|_s$")
# metrics.jsonl fields that measure speed, memory or time
VOLATILE_METRIC = re.compile(r"per_s|tflops|mfu|data_wait|_gb$|_mb$|time|_ms$|_s$|elapsed"
                             r"|seconds|throughput|memory")


@dataclass
class Paths:
    """Absolute paths of this machine, replaced by placeholders, longest first (a run
    directory lies inside the work directory, a venv may lie inside the repository)."""
    pairs: list[tuple[str, str]] = field(default_factory=list)
    work_name: str = ""  # the work directory's own name: how a path pickled by parts shows

    @classmethod
    def of(cls, work: Path, run: Path) -> "Paths":
        spec = importlib.util.find_spec("rapidformer")  # locates it without importing it
        repo = Path(spec.origin).resolve().parents[1] if spec and spec.origin else None
        pairs = [(str(run), "<RUN>"), (str(work), "<WORK>"), (sys.prefix, "<VENV>"),
                 (str(Path.home()), "<HOME>")]
        if repo is not None:
            pairs.append((str(repo), "<REPO>"))
        resolved = [(str(Path(p).resolve()), t) for p, t in pairs]
        unique = {p: t for p, t in [*pairs, *resolved] if p not in ("", "/")}
        return cls(sorted(unique.items(), key=lambda pt: -len(pt[0])), work.name)

    def text(self, s: str) -> str:
        for path, token in self.pairs:
            s = s.replace(path, token)
        return s

    def data(self, b: bytes) -> bytes:
        for path, token in self.pairs:
            b = b.replace(path.encode(), token.encode())
        return b


def masked(line: str, paths: Paths) -> str:
    line = paths.text(line)
    for pattern, repl in MASKS:
        line = pattern.sub(repl, line)
    return line.rstrip()


def rounded(value):
    """Floats to 6 significant digits, recursively (what the comparison cares about)."""
    if isinstance(value, float):
        return value if not math.isfinite(value) else float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def clean_json(value, paths: Paths, key: str = ""):
    """A JSON value with paths replaced, digests and clock readings masked, floats rounded."""
    if key and VOLATILE_KEY.search(key) and not isinstance(value, (dict, list)):
        return "<masked>"
    if isinstance(value, dict):
        return {k: clean_json(v, paths, k) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_json(v, paths) for v in value]
    if isinstance(value, str):
        return paths.text(value)
    return rounded(value)


def clean_name(rel: str) -> str:
    for pattern, repl in NAME_MASKS:
        rel = pattern.sub(repl, rel)
    return rel


# --- the log ------------------------------------------------------------------------------

def split_lines(text: str) -> list[str]:
    """Lines, with a progress bar's carriage-return updates reduced to what is left after them."""
    lines = []
    for raw in text.splitlines():
        parts = [p for p in raw.split("\r") if p.strip() and not PROGRESS.search(p)]
        if parts:
            lines.append(parts[-1])
    return lines


def log_lines(text: str, paths: Paths, everything: bool = False) -> dict[str, list[str]]:
    """rapidformer's lines of one stream, by source: the launcher's own, or a worker's (whose
    lines reach the launcher's stream through threads, in an order that varies between runs
    across workers, never within one). `everything`: every line (a verb's or a tool's stdout,
    which is its result)."""
    groups: dict[str, list[str]] = {}
    console = False  # the line above was the console's: its indented lines belong to it
    for line in split_lines(text):
        role = ROLE.match(line)
        source = role.group(1) if role else "main"
        body = TIMESTAMP.sub("", line[role.end():] if role else line)
        if CONSOLE_LINE.match(body):
            console = True
        elif console and INDENTED.match(body):
            pass  # the run summary's lines
        else:
            console = False
            if not (RECORD_LINE.match(body) or everything and not LIBRARY_LOG.match(body)):
                continue
        groups.setdefault(source, []).append(masked(body, paths))
    return groups


def tail(text: str, paths: Paths, n: int = 5) -> list[str]:
    return [masked(line, paths) for line in split_lines(text)[-n:]]


# --- what a run directory holds -----------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append({"unparsed": line})
    return rows


def metrics(run: Path) -> dict:
    """Training steps (records with a loss and no split prefix) and every other record
    (evaluations, tests), speed and memory fields left out, floats rounded."""
    train_steps, evals = [], []
    for record in read_jsonl(run / "metrics.jsonl"):
        kept = rounded({k: v for k, v in record.items() if not VOLATILE_METRIC.search(k)})
        is_train = "loss" in record and not any("/" in k for k in record)
        (train_steps if is_train else evals).append(kept)
    return {"train": train_steps, "evals": evals}


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def size(path: Path, paths: Paths) -> int | str:
    """The file's size with this machine's paths replaced by placeholders, so that a file
    naming the run directory is as long in every work directory. A file that still names the
    work directory stores the path in another form (torch DCP's .metadata pickles a PosixPath
    part by part), and its size depends on the work directory's: a marker instead (DCP's
    metadata is recorded by content, `dcp_metadata`)."""
    data = paths.data(path.read_bytes())
    if paths.work_name and paths.work_name.encode() in data:
        return "<size depends on the work directory's path>"
    return len(data)


def read_json(path: Path, paths: Paths):
    try:
        return clean_json(json.loads(path.read_text()), paths)
    except (OSError, ValueError) as exc:
        return f"<unreadable: {type(exc).__name__}>"


def manifest(path: Path, root: Path, paths: Paths):
    """COMPLETE.json with its digests masked and each file's byte count as `size` reports it
    (or a note where the manifest disagrees with the file)."""
    content = read_json(path, paths)
    if not isinstance(content, dict) or not isinstance(content.get("files"), dict):
        return content
    raw = json.loads(path.read_text())["files"]
    for rel, entry in content["files"].items():
        target = root / rel
        if not isinstance(entry, dict) or "bytes" not in entry:
            continue
        if not target.is_file():
            entry["bytes"] = "<file missing>"
        elif raw[rel]["bytes"] != target.stat().st_size:
            entry["bytes"] = f"<manifest {raw[rel]['bytes']}, file {target.stat().st_size}>"
        else:
            entry["bytes"] = size(target, paths)
    return content


def tensor_sha(t) -> str:
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw = flat.view(torch.uint8)
    try:
        data = raw.numpy().tobytes()
    except (RuntimeError, TypeError):  # a torch without numpy
        data = bytes(raw.tolist())
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_entry(t) -> list:
    return [list(t.shape), str(t.dtype).replace("torch.", ""), tensor_sha(t)]


def flatten(obj, paths: Paths, prefix: str = "", out: dict | None = None) -> dict:
    """A torch.load'ed object as {key path: tensor entry or value}."""
    import torch

    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix or "."] = tensor_entry(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, paths, f"{prefix}/{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)) and len(obj) > 8 and \
            all(v is None or isinstance(v, (bool, int, float)) for v in obj):
        # a long list of numbers (Python's RNG state): one entry, by digest
        digest = hashlib.sha256(json.dumps(list(obj)).encode()).hexdigest()[:16]
        out[prefix] = [f"{len(obj)} numbers", digest]
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, paths, f"{prefix}[{i}]", out)
    elif isinstance(obj, str):
        out[prefix] = paths.text(obj)
    elif obj is None or isinstance(obj, (bool, int, float)):
        out[prefix] = rounded(obj)
    else:
        out[prefix] = f"<{type(obj).__name__}>"
    return out


def torch_file(path: Path, paths: Paths):
    import torch

    try:
        return flatten(torch.load(path, map_location="cpu", weights_only=True), paths)
    except Exception as exc:  # a pickle of objects weights_only refuses: its name says so
        return f"<not loadable with weights_only: {type(exc).__name__}>"


def dcp_metadata(folder: Path):
    """A torch.distributed.checkpoint directory's index: every tensor's global shape, dtype
    and the chunks (offsets, sizes) its shards hold; other entries as bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # the format changed: say so rather than stop the record
        return f"<unreadable: {type(exc).__name__}>"
    entries = {}
    for key in sorted(metadata.state_dict_metadata):
        item = metadata.state_dict_metadata[key]
        if hasattr(item, "chunks"):
            chunks = sorted([list(c.offsets), list(c.sizes)] for c in item.chunks)
            entries[key] = [list(item.size), str(item.properties.dtype).replace("torch.", ""),
                            chunks]
        else:
            entries[key] = "bytes"
    return entries


def safetensors_file(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        entries = {name: tensor_entry(f.get_tensor(name)) for name in sorted(f.keys())}
        metadata = f.metadata() or {}
    return {"metadata": metadata, "tensors": entries}


def checkpoints(run: Path, paths: Paths) -> dict:
    """Each step directory: file names and sizes, state.json and COMPLETE.json; the newest one's
    torch files also tensor by tensor. Other entries beside the steps (best.json, leftovers of
    an interrupted save) by name."""
    root = run / "checkpoints"
    if not root.is_dir():
        return {}
    steps = sorted(p for p in root.iterdir() if p.is_dir() and re.match(r"step_\d+$", p.name))
    result = {"beside_steps": sorted(clean_name(p.name) for p in root.iterdir()
                                     if p not in steps)}
    for step in steps:
        entry = {"files": {clean_name(str(f.relative_to(step))): size(f, paths)
                           for f in files_of(step)}}
        for name in ("state.json", "COMPLETE.json"):
            if (step / name).is_file():
                entry[name] = manifest(step / name, step, paths) if name == "COMPLETE.json" \
                    else read_json(step / name, paths)
        result[step.name] = entry
    if (root / "best.json").is_file():
        result["best.json"] = read_json(root / "best.json", paths)
    if steps:
        newest = steps[-1]
        content = {}
        for f in files_of(newest):
            if f.suffix == ".pt":
                content[str(f.relative_to(newest))] = torch_file(f, paths)
            elif f.name == ".metadata":  # FSDP2's and megatron-core's sharded checkpoints
                content[str(f.relative_to(newest))] = dcp_metadata(f.parent)
        result["newest_content"] = content
    return result


MODEL_FILE = re.compile(r"\.safetensors$|(^|/)(pytorch_model|adapter_model)[\w.-]*\.bin$")


def export_dir(folder: Path, paths: Paths) -> dict:
    """An exported model: every file's size, the JSON files' content (a tokenizer.json by
    digest), every tensor of the weight files."""
    entry = {"files": {}, "json": {}, "tensors": {}}
    for f in files_of(folder):
        rel = str(f.relative_to(folder))
        entry["files"][rel] = size(f, paths)
        if f.name == "tokenizer.json":
            entry["json"][rel] = hashlib.sha256(paths.data(f.read_bytes())).hexdigest()[:16]
        elif f.suffix == ".json":
            entry["json"][rel] = read_json(f, paths)
        elif f.suffix == ".safetensors":
            entry["tensors"][rel] = safetensors_file(f)
        elif MODEL_FILE.search(rel):
            entry["tensors"][rel] = torch_file(f, paths)
    return entry


def exports(run: Path, paths: Paths) -> dict:
    """The run's export (hf_model), the base copy a peft run exports from (peft_base), and the
    directory itself when a verb wrote a model there."""
    found = {}
    for name, folder in (("hf_model", run / "hf_model"), ("peft_base", run / "peft_base"),
                         (".", run)):
        if folder.is_dir() and any(MODEL_FILE.search(f.name) for f in folder.iterdir()):
            found[name] = export_dir(folder, paths)
    return found


def data_files(run: Path, paths: Paths) -> dict:
    """A tool's outputs by content digest (the pretraining data: every later row reads it)."""
    return {str(f.relative_to(run)): [size(f, paths),
                                      hashlib.sha256(paths.data(f.read_bytes())).hexdigest()[:16]]
            for f in files_of(run)}


def collect(row: Row, run: Path, paths: Paths) -> dict:
    """What a run directory holds after the row."""
    if not run.exists():
        return {"run_dir": "absent"}
    if row.fresh_dir:
        return {"data_files": data_files(run, paths)}
    found = {"run_files": sorted({clean_name(str(f.relative_to(run))) for f in files_of(run)}),
             **metrics(run), "checkpoints": checkpoints(run, paths),
             "exports": exports(run, paths)}
    for name in ("status.json",):
        if (run / name).is_file():
            found[name] = read_json(run / name, paths)
    if (run / "config.yaml").is_file():
        found["config.yaml"] = [paths.text(line) for line in
                                (run / "config.yaml").read_text().splitlines()]
    generations = read_jsonl(run / "generations.jsonl")
    if generations:
        found["generations"] = [clean_json(g, paths) for g in generations]
    return found


# --- running ------------------------------------------------------------------------------

def argv(command: tuple[str, ...], work: Path, run: Path) -> list[str]:
    values = {"run": str(run), "work": str(work), "data": str(work / "pretraining_data")}
    return [sys.executable, *PROGRAMS[command[0]], *(a.format(**values) for a in command[1:])]


def execute(args: list[str], cwd: Path, timeout: int) -> tuple[object, str, str]:
    """(exit code or "timeout", stdout, stderr). The command gets a session of its own, so a
    timeout ends the launcher and every worker it started."""
    env = {**os.environ, **ENV}
    env.pop("RAPIDFORMER_DEBUG", None)  # with it, a refusal is a traceback, not its one line
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return "timeout", out, err


def run_row(row: Row, work: Path) -> tuple[dict, float]:
    run = work / (row.run or row.name)
    if not row.continues:  # a run directory left by an earlier record would be resumed
        shutil.rmtree(run, ignore_errors=True)
    if row.fresh_dir:
        run.mkdir(parents=True)
    paths = Paths.of(work, run)
    record = {"commands": [command_text(c) for c in row.commands], "expect": row.expect}
    exit_codes, log, stderr = [], {}, ""
    started = time.monotonic()
    for command in row.commands:
        code, out, err = execute(argv(command, work, run), work, row.timeout)
        exit_codes.append(code)
        for stream, text in (("stdout", out), ("stderr", err)):
            # a verb's or a tool's stdout is its result; stderr holds the libraries' warnings
            everything = stream == "stdout" and command[0] != "rapidformer"
            for source, lines in log_lines(text, paths, everything).items():
                log.setdefault(f"{stream}:{source}", []).extend(lines)
        stderr = err
        if code != 0:
            break
    seconds = time.monotonic() - started
    record["exit_codes"] = exit_codes
    record["as_expected"] = exit_codes[-1] == row.expect and all(c == 0 for c in exit_codes[:-1])
    record["log"] = dict(sorted(log.items()))
    if exit_codes[-1] != 0 or row.expect != 0:
        record["stderr_tail"] = tail(stderr, paths)
    record.update(collect(row, run, paths))
    return record, seconds


def meta() -> dict:
    """Where the record was made: shown by --diff, never counted as a difference."""
    spec = importlib.util.find_spec("rapidformer")
    repo = Path(spec.origin).resolve().parents[1] if spec and spec.origin else None
    commit = None
    if repo is not None:
        git = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"],
                               capture_output=True, text=True)
        if git.returncode == 0:
            commit = git.stdout.strip() + (" (local changes)" if dirty.stdout.strip() else "")
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "rapidformer_repo": str(repo), "commit": commit}


def record_main(args) -> int:
    rows = select(table(), args.only)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="run_record-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"work directory: {work}", flush=True)
    result = {"meta": meta(), "rows": {}, "seconds": {}}
    started = time.monotonic()
    for row in rows:
        print(f"{row.name:32s}", end=" ", flush=True)
        record, seconds = run_row(row, work)
        result["rows"][row.name] = record
        result["seconds"][row.name] = round(seconds, 1)
        mark = "ok" if record["as_expected"] else f"UNEXPECTED (expected exit {row.expect})"
        print(f"exit {record['exit_codes']}  {seconds:6.1f} s  {mark}", flush=True)
    result["seconds"]["total"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    bad = [name for name, r in result["rows"].items() if not r["as_expected"]]
    print(f"wrote {out}: {len(rows)} rows in {result['seconds']['total']:.0f} s"
          + (f"; not as expected: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


# --- diff ---------------------------------------------------------------------------------

LIMIT = 12  # differences shown per field before "... and N more"


def show(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def leaves(value, path: tuple = ()) -> dict[tuple, object]:
    """A JSON value as {key path: leaf}; a list of plain values (a shape) is one leaf."""
    if isinstance(value, dict) and value:
        return {p: v for k, sub in value.items() for p, v in leaves(sub, (*path, k)).items()}
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return {p: v for i, sub in enumerate(value) for p, v in leaves(sub, (*path, i)).items()}
    return {path: value}


def dotted(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def moves(only_a: dict, only_b: dict) -> list[tuple[tuple, tuple]]:
    """Leaves that changed place only: the same key and value under another parent (a
    restructured JSON file), paired once each."""
    pairs, taken = [], set()
    for pa, va in only_a.items():
        for pb, vb in only_b.items():
            if pb not in taken and pa and pb and pa[-1] == pb[-1] and va == vb:
                pairs.append((pa, pb))
                taken.add(pb)
                break
    return pairs


def walk(a, b, path: str = "") -> list[str]:
    """Every leaf that differs between two JSON values, as `path: before -> after`; keys that
    only moved are one line per old and new parent."""
    fa, fb = leaves(a), leaves(b)
    prefix = (lambda p: f"{path}.{dotted(p)}".strip(".")) if path else dotted
    lines = [f"{prefix(p)}: {show(fa[p])} -> {show(fb[p])}"
             for p in fa if p in fb and fa[p] != fb[p]]
    only_a = {p: v for p, v in fa.items() if p not in fb}
    only_b = {p: v for p, v in fb.items() if p not in fa}
    grouped: dict[tuple, list[str]] = {}
    for pa, pb in moves(only_a, only_b):
        grouped.setdefault((pa[:-1], pb[:-1]), []).append(str(pa[-1]))
        del only_a[pa], only_b[pb]
    for (old, new), keys in grouped.items():
        names = ", ".join(keys[:6]) + (f", ... ({len(keys)} keys)" if len(keys) > 6 else "")
        lines.append(f"moved, values unchanged: {prefix(old) or '<top>'}.{{{names}}} -> "
                     f"{prefix(new) or '<top>'}")
    lines += [f"{prefix(p)}: only before: {show(v)}" for p, v in only_a.items()]
    lines += [f"{prefix(p)}: only after: {show(v)}" for p, v in only_b.items()]
    return lines


def step_diff(a: list[dict], b: list[dict]) -> list[str]:
    """Per-step series field by field: the first step where they part, and the largest gap."""
    before, after = {r.get("step"): r for r in a}, {r.get("step"): r for r in b}
    lines = []
    only_a, only_b = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    if only_a:
        lines.append(f"steps only before: {only_a}")
    if only_b:
        lines.append(f"steps only after: {only_b}")
    common = sorted(set(before) & set(after))
    keys = list(dict.fromkeys(k for s in common for k in [*before[s], *after[s]]))
    for key in keys:
        differ = [s for s in common if before[s].get(key) != after[s].get(key)]
        if not differ:
            continue
        first = differ[0]
        gaps = [abs(before[s][key] - after[s][key]) for s in differ
                if isinstance(before[s].get(key), (int, float))
                and isinstance(after[s].get(key), (int, float))]
        gap = f", max abs difference {max(gaps):.6g}" if gaps else ""
        lines.append(f"{key}: differs at {len(differ)} of {len(common)} steps, first at step "
                     f"{first}: {show(before[first].get(key))} -> {show(after[first].get(key))}"
                     f"{gap}")
    return lines


def records_diff(a: list[dict], b: list[dict]) -> list[str]:
    """Records in file order (evaluations, generations), field by field."""
    lines = []
    for i in range(max(len(a), len(b))):
        if i >= len(b):
            lines.append(f"[{i}] only before: {show(a[i])}")
        elif i >= len(a):
            lines.append(f"[{i}] only after: {show(b[i])}")
        else:
            lines.extend(walk(a[i], b[i], f"[{i}] step {a[i].get('step')}"))
    return lines


def lines_diff(a: list[str], b: list[str]) -> list[str]:
    return [line for line in difflib.unified_diff(a, b, "before", "after", n=1, lineterm="")
            if not line.startswith(("---", "+++"))]


def log_diff(a: dict, b: dict) -> list[str]:
    lines = []
    for source in [*a, *(s for s in b if s not in a)]:
        changed = lines_diff(a.get(source, []), b.get(source, []))
        if changed:
            lines.append(f"[{source}]")
            lines.extend(changed)
    return lines


def row_diff(a: dict, b: dict) -> dict[str, list[str]]:
    """field -> the lines describing its differences (no entry where equal)."""
    fields = {}
    for key in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if key not in a or key not in b:
            fields[key] = [f"only {'after' if key not in a else 'before'}: {show(x or y)}"]
        elif key == "train":
            fields[key] = step_diff(x, y)
        elif key == "log":
            fields[key] = log_diff(x, y)
        elif key in ("evals", "generations"):
            fields[key] = records_diff(x, y)
        elif key in ("config.yaml", "run_files", "stderr_tail", "commands"):
            fields[key] = lines_diff([str(v) for v in x], [str(v) for v in y])
        else:
            fields[key] = walk(x, y)
    return fields


def diff_main(before_path: str, after_path: str) -> int:
    before = json.loads(Path(before_path).read_text())
    after = json.loads(Path(after_path).read_text())
    for side, rec in (("before", before), ("after", after)):
        m = rec.get("meta", {})
        print(f"{side}: {m.get('rapidformer_repo')} at {m.get('commit')}, python {m.get('python')}"
              f", torch {m.get('torch')}, {rec.get('seconds', {}).get('total')} s")
    rows_a, rows_b = before["rows"], after["rows"]
    names = [*rows_a, *(n for n in rows_b if n not in rows_a)]
    differing = 0
    for name in names:
        if name not in rows_a or name not in rows_b:
            differing += 1
            print(f"\n== {name}: only in {'after' if name not in rows_a else 'before'}")
            continue
        fields = row_diff(rows_a[name], rows_b[name])
        if not fields:
            continue
        differing += 1
        print(f"\n== {name}: {', '.join(fields)} differ{'s' if len(fields) == 1 else ''}")
        for key, lines in fields.items():
            print(f"  -- {key}")
            for line in lines[:LIMIT]:
                print(f"     {line}")
            if len(lines) > LIMIT:
                print(f"     ... and {len(lines) - LIMIT} more")
    print(f"\n{len(names) - differing} of {len(names)} rows identical"
          + (f", {differing} differ" if differing else ""))
    return 1 if differing else 0


def list_main() -> int:
    for row in table():
        expect = "" if row.expect == 0 else f"   (expect exit {row.expect})"
        print(f"{row.name}{expect}")
        for command in row.commands:
            print(f"    {command_text(command)}")
    return 0


def main(argv_: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the record to write (JSON)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="these rows (and the rows they need) only")
    parser.add_argument("--workdir", help="where the runs write (default: a new temporary "
                                          "directory); each row's directory is replaced")
    parser.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print every difference between two records")
    parser.add_argument("--list", action="store_true", help="print the rows and their commands")
    args = parser.parse_args(argv_)
    if args.diff:
        return diff_main(*args.diff)
    if args.list:
        return list_main()
    if not args.out:
        parser.error("give --out RECORD.json, --diff BEFORE AFTER or --list")
    return record_main(args)


if __name__ == "__main__":
    sys.exit(main())
