"""Loose JSON -> Megatron's indexed dataset (.bin/.idx), as the seeds' preprocess_data.py.

    python -m rapidformer.data.preprocess_data --input corpus.json --output-prefix gpt_small \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

One JSON object per line; each `--json-keys` field (default `text`) becomes
`{prefix}_{key}_document.bin/.idx` (`_sentence` with `--split-sentences`). The files are written
with megatron-core's `IndexedDatasetBuilder`, so they are Megatron's format exactly. They are
written under a temporary name and renamed at the end: an interrupted or failed run leaves
nothing under the output name.

Differences from Megatron's script: `--split-sentences` uses a rule-based splitter (after . ! ?
followed by whitespace and an upper-case letter, digit or quote) instead of NLTK's punkt model,
which needs a download; `--dataset-impl` accepts only `mmap` (megatron-core has no other).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z0-9])")


class PreprocessError(Exception):
    pass


def build_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None,
                    tokenizer_path: str | None):
    """(tokenizer, eod id, vocabulary size) for one of the seed's tokenizer types."""
    from transformers import AutoTokenizer, BertTokenizer, GPT2Tokenizer

    if kind.startswith("BertWordPiece"):
        if not vocab_file or not Path(vocab_file).is_file():
            raise PreprocessError(f"--tokenizer-type {kind} needs --vocab-file (a WordPiece "
                                  f"vocab.txt); not found: {vocab_file}")
        if Path(vocab_file).read_text(encoding="utf-8", errors="replace").lstrip().startswith("{"):
            raise PreprocessError(f"{vocab_file} is a JSON vocabulary (GPT-2 style), not a "
                                  f"WordPiece vocab.txt: use --tokenizer-type GPT2BPETokenizer "
                                  f"with --merge-file, or give a vocab.txt")
        tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=kind.endswith("LowerCase"))
        return tokenizer, tokenizer.sep_token_id, len(tokenizer)
    if kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not Path(path).is_file():
                raise PreprocessError(f"--tokenizer-type GPT2BPETokenizer needs {flag}; not "
                                      f"found: {path}")
        try:
            json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise PreprocessError(f"{vocab_file} is not a GPT-2 vocab.json (JSON); for a "
                                  f"WordPiece vocab.txt use --tokenizer-type "
                                  f"BertWordPieceLowerCase") from exc
        tokenizer = GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
        eod = tokenizer.get_vocab().get("<|endoftext|>")
        if eod is None:
            raise PreprocessError(f"{vocab_file} has no <|endoftext|> token, which GPT-2 "
                                  f"tokenization uses as end of document")
        return tokenizer, eod, len(tokenizer)
    if not tokenizer_path or not Path(tokenizer_path).is_dir():
        raise PreprocessError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a "
                              f"local tokenizer directory; not found: {tokenizer_path}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eod = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return tokenizer, eod, len(tokenizer)


def split_sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in SENTENCE_END.split(text)) if s]


def _encode(tokenizer, pieces: list[str]) -> list[list[int]]:
    """Token ids of each non-empty piece. Rust-backed tokenizers get one batched call per
    document: with short sentences the Python wrapper around each call, not the tokenizer,
    was most of the time (about 2x overall)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids = [e.ids for e in backend.encode_batch(pieces, add_special_tokens=False)] \
            if pieces else []
    else:
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    return [s for s in ids if s]


class Encoder:
    """Per worker: parse a line, tokenize each key (by sentence or whole), append EOD."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        Encoder.tokenizer, Encoder.eod, _ = build_tokenizer(
            self.args.tokenizer_type, self.args.vocab_file, self.args.merge_file,
            self.args.tokenizer_model)

    def encode(self, numbered_line):
        number, line = numbered_line
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in self.args.json_keys if k not in record]
            if missing:
                raise ValueError(f"no key {', '.join(map(repr, missing))}")
        except ValueError as exc:
            return number, None, f"line {number}: {exc}", len(line)
        out = {}
        for key in self.args.json_keys:
            text = str(record[key])
            pieces = split_sentences(text) if self.args.split_sentences else [text]
            ids = _encode(Encoder.tokenizer, pieces)
            if ids and self.args.append_eod:
                ids[-1].append(Encoder.eod)
            out[key] = ids
        return number, out, None, len(line)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="rapidformer-preprocess-data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="one JSON object per line")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--split-sentences", action="store_true")
    parser.add_argument("--keep-newlines", action="store_true",
                        help="accepted for compatibility; newlines are kept in the text")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", "--vocab", dest="vocab_file")
    parser.add_argument("--merge-file")
    parser.add_argument("--tokenizer-model", help="a local Hugging Face tokenizer directory")
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--dataset-impl", default="mmap")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10000)
    parser.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                        help="a malformed line: stop (default), or report it and go on")
    args = parser.parse_args(argv)
    if args.dataset_impl != "mmap":
        parser.error(f"--dataset-impl {args.dataset_impl}: megatron-core writes and reads only "
                     f"mmap; use --dataset-impl mmap")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def preprocess(args) -> list[Path]:
    import torch

    import rapidformer.data.megatron  # noqa: F401  (quiets megatron-core's import warnings)

    try:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except ImportError as exc:
        raise PreprocessError("writing Megatron indexed datasets needs megatron-core: pip install "
                              "'megatron-core>=0.16,<0.17' (or the project's [megatron] extra)") from exc

    source = Path(args.input)
    if not source.is_file():
        raise PreprocessError(f"--input {source}: no such file")
    # built here first so that a bad vocabulary fails at once, not inside a worker
    tokenizer, eod, vocab_size = build_tokenizer(args.tokenizer_type, args.vocab_file,
                                                 args.merge_file, args.tokenizer_model)
    level = "sentence" if args.split_sentences else "document"
    out_dir = Path(args.output_prefix).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    finals, temps, builders = {}, {}, {}
    dtype = DType.optimal_dtype(vocab_size)
    for key in args.json_keys:
        finals[key] = f"{args.output_prefix}_{key}_{level}"
        temps[key] = str(out_dir / f".tmp-{Path(finals[key]).name}-{os.getpid()}")
        builders[key] = IndexedDatasetBuilder(temps[key] + ".bin", dtype=dtype)
    encoder = Encoder(args)
    started, done, size, skipped = time.time(), 0, 0, 0
    pool = None
    try:
        with open(source, encoding="utf-8", errors="strict") as f:
            lines = ((n, line) for n, line in enumerate(f, start=1) if line.strip())
            if args.workers > 1:
                pool = multiprocessing.get_context("spawn").Pool(args.workers,
                                                                 initializer=encoder.initializer)
                results = pool.imap(encoder.encode, lines, chunksize=32)
            else:
                Encoder.tokenizer, Encoder.eod = tokenizer, eod
                results = map(encoder.encode, lines)
            for number, docs, error, nbytes in results:
                size += nbytes
                if error:
                    if args.on_error == "fail":
                        raise PreprocessError(f"{source} {error}; fix the line or pass "
                                              f"--on-error skip")
                    skipped += 1
                    print(f"skipping {source} {error}", file=sys.stderr)
                    continue
                for key, sentences in docs.items():
                    if sentences:
                        flat = [t for s in sentences for t in s]
                        builders[key].add_document(torch.tensor(flat, dtype=torch.int64),
                                                   [len(s) for s in sentences])
                done += 1
                if done % args.log_interval == 0:
                    _progress(done, size, started)
        if done == 0:
            raise PreprocessError(f"{source} holds no documents (every line empty or "
                                  f"skipped); nothing written")
        for key, builder in builders.items():
            builder.finalize(temps[key] + ".idx")
        for key in args.json_keys:
            for ext in (".bin", ".idx"):
                os.replace(temps[key] + ext, finals[key] + ext)
    except UnicodeDecodeError as exc:
        raise PreprocessError(f"{source} is not valid UTF-8 (byte {exc.start} of a line); "
                              f"re-encode it") from exc
    finally:
        if pool is not None:
            pool.terminate()
        for temp in temps.values():
            for ext in (".bin", ".idx"):
                Path(temp + ext).unlink(missing_ok=True)
    _progress(done, size, started, final=True, skipped=skipped)
    return [Path(finals[k]) for k in args.json_keys]


def _progress(done: int, size: int, started: float, final: bool = False, skipped: int = 0):
    elapsed = max(time.time() - started, 1e-9)
    what = "done:" if final else "processed"
    extra = f", {skipped} malformed lines skipped" if skipped else ""
    print(f"{what} {done} documents ({done / elapsed:.1f} docs/s, "
          f"{size / elapsed / 2**20:.2f} MB/s){extra}", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        outputs = preprocess(args)
    except PreprocessError as exc:
        print(f"rapidformer-preprocess-data: error: {exc}", file=sys.stderr)
        sys.exit(2)
    for prefix in outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
