"""Speed of `python -m rapidformer.data.preprocess_data` on a synthetic corpus: MB/s of input JSON,
documents/s and tokens/s, for GPT-2 BPE (document level, --append-eod) and lower-case BERT
WordPiece (--split-sentences); with --megatron, side by side with Megatron-LM's own
tools/preprocess_data.py on the same corpus, flags and workers.

    python benchmarks/preprocess_speed.py                  # 100 MB corpus, --workers 2
    python benchmarks/preprocess_speed.py --workers 1 2 4 8 16   # scaling, one row each
    python benchmarks/preprocess_speed.py --mb 5           # a quick check of the plumbing
    python benchmarks/preprocess_speed.py --mb 50 --megatron --megatron-git MEGATRON-LM/.git
    python benchmarks/preprocess_speed.py --megatron --megatron-lm DIR   # a Megatron-LM tree

The corpus and both vocabularies come from rapidformer.data.corpus, so nothing is downloaded.
Our rows run with TOKENIZERS_PARALLELISM=false, so that a row's workers are the cores it uses
(each worker's Rust tokenizer runs one thread; with --workers 1 it would use every core).
Each row is one real run of a tool in a subprocess and is timed from the outside, so the time
includes interpreter start-up and imports, as a user's run does; the tool's own rate (its
`done:` line; Megatron's last `Processed` line, which starts after its start-up) is recorded
too. Every output is opened (megatron-core's IndexedDataset when installed, else the .idx read
here) and its documents and tokens counted. Appends a run to docs/benchmarks/preprocess_speed.json
and prints a markdown table.

The comparison (--megatron). Megatron-LM's script cannot split sentences without NLTK's punkt
data (a download), so both tools run without --split-sentences: GPT-2 BPE and BERT WordPiece at
document level, with --append-eod. Megatron-LM has two BERT conventions, and each is compared
with the one of ours that should give the same bytes: its legacy tokenizer (`--legacy-tokenizer`
from core 0.15; the only one up to core 0.14) ends a document with [EOS] after the vocabulary,
as ours does by default; its newer tokenizer system ends it with [SEP], as ours with
`--bert-eod sep`. A row says whether its .bin/.idx are byte-identical to ours.

Megatron-LM's source: `--megatron-lm DIR` (a checkout or an extract with megatron/ and tools/),
or `--megatron-git GITDIR --megatron-ref REF` (default core_v0.16.1, the Megatron-LM of the
megatron-core this project pins), whose megatron/ and tools/ are extracted with `git archive`
into the work directory. The tool runs with that source first on PYTHONPATH, so its own
megatron-core is used whether or not one is installed. Offline: its newer tokenizer system
loads Hugging Face's 'gpt2' and 'bert-large-uncased' (their settings; the vocab files are
passed), which Hugging Face reads from directories of those names in the working directory
before the hub: the tool runs in one holding them, made from the local vocabularies. What its
start needs beyond torch, numpy and transformers is checked first (`--help`): `six` (for the
legacy BERT tokenizer) is given as a three-line module when missing; anything else (e.g.
`triton`, which megatron.training imports at start) is reported with the fix (install it, or
`--megatron-pythonpath DIR` holding it) and the Megatron rows are skipped.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from rapidformer.data.corpus import (VOCAB_SAMPLE_DOCS, iter_documents, write_corpus,
                                     write_gpt2_bpe, write_wordpiece_vocab)

DEFAULT_REF = "core_v0.16.1"
SIX = "PY2 = False\nPY3 = True\ntext_type = str\nbinary_type = bytes\nstring_types = (str,)\n"


def run_best(repeat: int, *args, **kwargs) -> dict:
    """The fastest of `repeat` runs of one row (all times recorded): on a shared machine a run
    can be slowed by others' work, never sped up."""
    rows = [run_one(*args, **kwargs) for _ in range(repeat)]
    good = [r for r in rows if "error" not in r] or rows
    best = min(good, key=lambda r: r["seconds"])
    if repeat > 1:
        best["seconds_all"] = [r["seconds"] for r in rows]
    return best


def run_one(name: str, flags: list[str], level: str, corpus: dict, workers: int,
            work: Path, tool: str = "rapidformer", megatron: dict | None = None) -> dict:
    """One timed run of our CLI (tool "rapidformer") or of Megatron-LM's script."""
    prefix = work / f"{name}_{tool}_w{workers}"
    common = ["--input", corpus["path"], "--output-prefix", str(prefix), "--workers",
              str(workers)]
    if tool == "rapidformer":
        argv = [sys.executable, "-m", "rapidformer.data.preprocess_data", *common,
                "--dataset-impl", "mmap", "--log-interval", "1000000", *flags]
        # one tokenizer thread a worker: a row's workers are the cores it uses (with --workers 1
        # the tool's Rust tokenizer would otherwise use every core of the machine)
        shown, env, cwd = "python -m rapidformer.data.preprocess_data", \
            {**os.environ, "TOKENIZERS_PARALLELISM": "false"}, None
    else:
        # its progress line comes every --log-interval documents: once, at the end
        argv = [sys.executable, str(megatron["dir"] / "tools" / "preprocess_data.py"), *common,
                "--log-interval", str(corpus["documents"]), *flags]
        shown, env, cwd = "python MEGATRON-LM/tools/preprocess_data.py", megatron["env"], \
            megatron["cwd"]
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    seconds = time.perf_counter() - started
    command = " ".join([shown, *argv[3 if tool == "rapidformer" else 2:]])
    if megatron:
        command = command.replace(str(megatron["dir"]), "MEGATRON-LM")
    row = {"name": name, "tool": tool, "workers": workers, "seconds": round(seconds, 2),
           # the work directory is temporary: record the command relative to it
           "command": command.replace(str(work), "WORK")}
    output = Path(f"{prefix}_text_{level}")
    # Megatron's script exits 0 when its workers fail: its output files are the test
    if result.returncode != 0 or not Path(f"{output}.idx").is_file():
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"\w*(Error|Exception)\b", line)]
        row["error"] = ((errors or lines or ["(no output)"])[-1])[:300]
        return row
    documents, sequences, tokens = count(str(output))
    if documents != corpus["documents"]:
        row["error"] = f"{documents} documents in the output, {corpus['documents']} in the input"
    row.update({"documents": documents, "sequences": sequences, "tokens": tokens,
                "mb_per_s": corpus["bytes"] / 2**20 / seconds, "docs_per_s": documents / seconds,
                "tokens_per_s": tokens / seconds, "tokens_per_doc": tokens / documents,
                "output_bytes": sum(Path(f"{output}{e}").stat().st_size
                                    for e in (".bin", ".idx")),
                "output": str(output)})
    if tool == "rapidformer":
        done = re.search(r"done: \d+ documents \(([\d.]+) docs/s, ([\d.]+) MB/s\)", result.stderr)
    else:
        done = list(re.finditer(r"Processed \d+ documents \(([\d.]+) docs/s, ([\d.]+) MB/s\)",
                                result.stderr))
        done = done[-1] if done else None
        startup = re.search(r"Time to startup: ([\d.]+)", result.stdout + result.stderr)
        if startup:
            row["startup_s"] = round(float(startup[1]), 2)
    if done:
        row["cli_docs_per_s"], row["cli_mb_per_s"] = (round(float(done[1]), 1),
                                                      round(float(done[2]), 2))
    return row


def count(prefix: str) -> tuple[int, int, int]:
    """(documents, sequences, tokens) of prefix.bin/.idx."""
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:  # the .idx header and lengths, as data/indexed_writer.py writes them
        raw = np.fromfile(prefix + ".idx", dtype=np.uint8)
        sequences, documents = (int(n) for n in raw[18:34].view("<u8"))
        lengths = raw[34:34 + 4 * sequences].view("<i4")
        return documents - 1, sequences, int(lengths.sum(dtype=np.int64))
    dataset = IndexedDataset(prefix)
    return (len(dataset.document_indices) - 1, len(dataset),
            int(dataset.sequence_lengths.sum(dtype=np.int64)))


def same_bytes(a: str, b: str) -> tuple[bool, str]:
    """Whether two outputs' .bin and .idx are byte-identical, and if not where they part."""
    for ext in (".bin", ".idx"):
        x, y = Path(a + ext).read_bytes(), Path(b + ext).read_bytes()
        if x != y:
            at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return False, f"{ext} differs from byte {at} ({len(x)} vs {len(y)} bytes)"
    return True, "byte-identical"


# --------------------------------------------------------------------------- Megatron-LM's tool

def megatron_source(args, work: Path) -> dict:
    """Megatron-LM's tree (given, or extracted from a git directory) and what it says of
    itself: {"dir", "ref", "commit", "legacy"} (legacy: it has --legacy-tokenizer)."""
    if args.megatron_lm:
        root = Path(args.megatron_lm).resolve()
        # its commit only when it is a checkout of its own (not a folder in another repository)
        own = _git(["rev-parse", "--show-toplevel"], root) == str(root)
        ref, commit = None, _git(["rev-parse", "HEAD"], root) if own else None
    else:
        git_dir = args.megatron_git or os.environ.get("MEGATRON_LM_GIT")
        if not git_dir:
            raise SystemExit("--megatron needs Megatron-LM's source: --megatron-lm DIR or "
                             "--megatron-git GITDIR (a clone's .git, or a bare repository)")
        root, ref = work / "megatron-lm", args.megatron_ref
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref, "megatron",
                                  "tools"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        commit = _git(["rev-parse", f"{ref}^{{commit}}"], None, git_dir)
    script = root / "tools" / "preprocess_data.py"
    if not script.is_file():
        raise SystemExit(f"{root} has no tools/preprocess_data.py: give Megatron-LM's top "
                         f"directory")
    return {"dir": root, "ref": ref, "commit": commit, "version": megatron_version(root),
            "legacy": "legacy_tokenizer" in script.read_text()}


def _git(command: list[str], cwd, git_dir=None) -> str | None:
    extra = [f"--git-dir={git_dir}"] if git_dir else []
    try:
        result = subprocess.run(["git", *extra, *command], cwd=cwd, capture_output=True,
                                text=True)
    except FileNotFoundError:  # no git on this machine
        return None
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def megatron_environment(source: dict, args, work: Path, wordpiece: Path, gpt2: tuple) -> dict:
    """PYTHONPATH, working directory and offline Hugging Face directories for Megatron's tool;
    then a `--help` start, which runs all its imports. Adds "env", "cwd", "shims" and, when it
    cannot start, "error" to `source`."""
    shims = work / "megatron-shims"
    shims.mkdir(exist_ok=True)
    paths = [str(source["dir"]), *args.megatron_pythonpath, str(shims)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        paths + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cwd = work / "megatron-cwd"
    vocab, merges = gpt2
    local = {"gpt2": ({"model_type": "gpt2"}, {"model_max_length": 1024},
                      {"vocab.json": vocab, "merges.txt": merges}),
             "bert-large-uncased": ({"model_type": "bert"},
                                    {"do_lower_case": True, "model_max_length": 512},
                                    {"vocab.txt": wordpiece})}
    for name, (config, tokenizer_config, files) in local.items():
        directory = cwd / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        for file_name, path in files.items():
            (directory / file_name).write_bytes(Path(path).read_bytes())
    source.update(env=env, cwd=cwd, shims=[])
    script = str(source["dir"] / "tools" / "preprocess_data.py")
    for _ in range(3):  # each round can reveal one missing module
        result = subprocess.run([sys.executable, script, "--help"], capture_output=True,
                                text=True, env=env, cwd=cwd)
        missing = re.search(r"No module named '([\w.]+)'", result.stderr)
        if result.returncode == 0:
            return source
        if missing and missing[1] == "six" and "six" not in source["shims"]:
            (shims / "six.py").write_text(SIX)  # the legacy BERT tokenizer's PY3 check
            source["shims"].append("six")
            continue
        break
    where = re.findall(r'File "([^"]+)", line \d+', result.stderr)
    importer = next((w for w in reversed(where) if str(source["dir"]) in w), None)
    why = missing[0] if missing else (result.stderr.strip().splitlines() or ["?"])[-1]
    source["error"] = (f"Megatron-LM's tools/preprocess_data.py cannot start: {why}"
                       + (f" (imported by {Path(importer).relative_to(source['dir'])})"
                          if importer else "")
                       + (f"; install it (pip install {missing[1].split('.')[0]}) or pass "
                          f"--megatron-pythonpath DIR holding it" if missing else ""))
    return source


def megatron_version(root: Path) -> str | None:
    """The megatron-core version the tree's megatron/core/package_info.py states."""
    path = root / "megatron" / "core" / "package_info.py"
    if not path.is_file():
        return None
    values = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?(\w*)",
                             path.read_text(), re.M))
    return ".".join(values.get(k, "") for k in ("MAJOR", "MINOR", "PATCH")) + \
        values.get("PRE_RELEASE", "")


# --------------------------------------------------------------------------- the run

def machine() -> dict:
    import torch

    versions = {}
    for package in ("torch", "transformers", "tokenizers", "megatron-core"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), **versions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="worker counts: a row per tokenizer and count")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work-dir", help="keep the corpus and outputs here (default: a temporary "
                                           "directory, removed at the end)")
    parser.add_argument("--out", default="docs/benchmarks/preprocess_speed.json",
                        help="the JSON file a run is appended to")
    parser.add_argument("--note", help="what this run measures (recorded with it)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per row; the fastest is reported (all are recorded)")
    parser.add_argument("--megatron", action="store_true",
                        help="also time Megatron-LM's tools/preprocess_data.py (document level)")
    parser.add_argument("--megatron-lm", metavar="DIR", help="Megatron-LM's source tree")
    parser.add_argument("--megatron-git", metavar="GITDIR",
                        help="a Megatron-LM git directory to extract --megatron-ref from "
                             "(default: $MEGATRON_LM_GIT)")
    parser.add_argument("--megatron-ref", default=DEFAULT_REF,
                        help=f"the tag or commit to extract (default {DEFAULT_REF})")
    parser.add_argument("--megatron-pythonpath", nargs="*", default=[], metavar="DIR",
                        help="directories put on Megatron's PYTHONPATH after its source (modules "
                             "its start needs that this Python lacks)")
    parser.add_argument("--only-megatron-comparison", action="store_true",
                        help="with --megatron: leave out the sentence-level BERT row")
    args = parser.parse_args()
    if args.mb <= 0 or min(args.workers) < 1 or args.repeat < 1:
        parser.error("--mb must be positive, --workers and --repeat at least 1")
    with tempfile.TemporaryDirectory(prefix="rapidformer-preprocess-") as temp:
        work = Path(args.work_dir or temp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        corpus = write_corpus(work / "corpus.json", target_bytes=int(args.mb * 2**20),
                              seed=args.seed)
        corpus["seconds"] = round(time.perf_counter() - started, 2)
        print(f"corpus: {corpus['documents']} documents, {corpus['bytes'] / 2**20:.1f} MiB in "
              f"{corpus['seconds']} s", flush=True)
        sample = list(iter_documents(VOCAB_SAMPLE_DOCS, args.seed))
        wordpiece = write_wordpiece_vocab(sample, work / "wordpiece")
        vocab, merges = write_gpt2_bpe(sample, work / "gpt2")
        gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                "--merge-file", str(merges), "--append-eod"]
        bert = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(wordpiece)]
        # (name, our flags, level, [(Megatron's extra flags, its label)] to compare with)
        runs = [("gpt2_bpe_document", gpt2, "document",
                 [([], "megatron"), (["--legacy-tokenizer"], "megatron-legacy")])]
        if not (args.megatron and args.only_megatron_comparison):
            runs.append(("bert_wordpiece_sentence", [*bert, "--split-sentences"], "sentence", []))
        megatron = None
        if args.megatron:
            runs += [("bert_wordpiece_document_eos", [*bert, "--append-eod"], "document",
                      [(["--legacy-tokenizer"], "megatron-legacy")]),
                     ("bert_wordpiece_document_sep", [*bert, "--append-eod", "--bert-eod", "sep"],
                      "document", [([], "megatron")])]
            megatron = megatron_environment(megatron_source(args, work), args, work, wordpiece,
                                            (vocab, merges))
            print(f"Megatron-LM {megatron['ref'] or megatron['dir']} ({megatron['commit']}): "
                  f"{megatron.get('error') or 'starts'}; shims: {megatron['shims'] or 'none'}",
                  flush=True)
        rows = []
        for name, flags, level, theirs in runs:
            for workers in args.workers:
                ours = run_best(args.repeat, name, flags, level, corpus, workers, work)
                rows.append(ours)
                print(json.dumps(rows[-1]), flush=True)
                for extra, label in theirs if megatron else []:
                    if label == "megatron-legacy" and not megatron["legacy"]:
                        continue  # this Megatron-LM has only its newer tokenizer system
                    their_flags = [f for f in flags if f not in ("--bert-eod", "sep")] + extra
                    if "error" in megatron:
                        row = {"name": name, "tool": label, "workers": workers,
                               "error": megatron["error"]}
                    else:
                        row = run_best(args.repeat, name, their_flags, level, corpus, workers,
                                       work, tool=label, megatron=megatron)
                    if "output" in row and "output" in ours:
                        row["identical"], row["comparison"] = same_bytes(ours["output"],
                                                                         row["output"])
                    rows.append(row)
                    print(json.dumps(rows[-1]), flush=True)
        for row in rows:
            row.pop("output", None)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(),
              "corpus": {**corpus, "path": None if not args.work_dir else corpus["path"],
                         "mb": corpus["bytes"] / 2**20, "seed": args.seed},
              "repeat": args.repeat, "rows": rows}
    if args.note:
        result["note"] = args.note
    if megatron:
        result["megatron_lm"] = {"ref": megatron["ref"], "commit": megatron["commit"],
                                 "megatron_core_version": megatron["version"],
                                 "shims": megatron["shims"], "error": megatron.get("error")}
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    report = report if "runs" in report else {"runs": [report]}
    report["runs"].append(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{corpus['bytes'] / 2**20:.1f} MiB, {corpus['documents']} documents, "
          f"{os.cpu_count()} CPUs; appended to {args.out}\n")
    print("| tokenizer | tool | workers | seconds | MB/s | tool's MB/s | docs/s | tokens "
          "| sequences | output |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tokens" not in r:
            print(f"| {r['name']} | {r['tool']} | {r['workers']} | failed: {r['error']} "
                  f"| | | | | | |")
            continue
        print(f"| {r['name']} | {r['tool']} | {r['workers']} | {r['seconds']:.1f} "
              f"| {r['mb_per_s']:.2f} | {r.get('cli_mb_per_s', '')} | {r['docs_per_s']:.0f} "
              f"| {r['tokens']} | {r['sequences']} | {r.get('comparison', '')} |")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
