"""Train a vocabulary on your own text for `rapidformer-preprocess-data` and the pretraining
recipes, with Hugging Face `tokenizers`' trainers: nothing is downloaded.

    rapidformer-train-vocab --input corpus.jsonl --type wordpiece --lowercase \
        --vocab-size 30522 --output-dir wp
    rapidformer-train-vocab --input 'texts/*.txt' more.jsonl --type gpt2-bpe \
        --vocab-size 50257 --output-dir gpt2

`--type wordpiece` writes `OUTPUT_DIR/vocab.txt` (BERT's WordPiece: `[PAD] [UNK] [CLS] [SEP]
[MASK]`, then the word pieces; for `--tokenizer-type BertWordPieceLowerCase` with
`--lowercase`, `BertWordPieceCase` without), `--type gpt2-bpe` writes `OUTPUT_DIR/vocab.json`
and `OUTPUT_DIR/merges.txt` (GPT-2's byte-level BPE with `<|endoftext|>`, for
`--tokenizer-type GPT2BPETokenizer`): exactly the files those tokenizer types read, as
`--vocab-file` (and `--merge-file`), and as the recipes' `model.tokenizer` (and
`model.merge_file`).

Input: files or glob patterns. A `.json` / `.jsonl` file is read as preprocess_data reads it,
one JSON object per line, each `--json-keys` field (default `text`; a string, or a list of
strings) a text; any other file (or every file, with `--format text`) as plain text, each
non-blank line a text. The files are read twice: once to check every line and count the
characters (before any training), once by the trainer.

The same files give the same vocabulary on every run: `tokenizers`' WordPiece trainer numbers
the `##` continuation of each character in the order of a hash map, and breaks ties between
equally frequent merges by those numbers, so it gives a different vocabulary from run to run.
Here the alphabet (the `--limit-alphabet` most frequent characters, ties by character) and its
`##` continuations are numbered first, in order; the byte-level BPE trainer's alphabet is the
256 bytes in order already.

Refused before any work, with one message and exit code 2, writing nothing: an input that is
missing, a directory, or a pattern that matches no file; a line that is not UTF-8 or (JSON
lines) not a JSON object with the keys, naming the file and the line; a corpus with no text; an
output directory that already holds the vocabulary's files (unless `--overwrite`); an output
file that is one of the inputs (by any path or link, `--overwrite` or not). The files are
written into a hidden folder of the output directory and moved into place when the vocabulary
is whole and loads as preprocess_data loads it; a failed or interrupted run leaves nothing
(and no folder it made) behind.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

from rapidformer.data.preprocess_encode import _decode, parse_line
from rapidformer.data.preprocess_errors import LineError
from rapidformer.data.preprocess_write import _same
from rapidformer.errors import InputError

PROG = "rapidformer-train-vocab"
TYPES = ("wordpiece", "gpt2-bpe")
OUTPUTS = {"wordpiece": ("vocab.txt",), "gpt2-bpe": ("vocab.json", "merges.txt")}
WORDPIECE_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_EOD = "<|endoftext|>"
JSON_SUFFIXES = (".json", ".jsonl")


class VocabError(InputError):
    """Input or output that training a vocabulary cannot use (exit code 2)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="The files written are preprocess_data's --vocab-file (and --merge-file).")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="text files or glob patterns (quote a pattern to have it "
                             "expanded here): .json/.jsonl as JSON lines, others as plain text")
    parser.add_argument("--type", required=True, choices=TYPES,
                        help="wordpiece: vocab.txt (BertWordPiece*); gpt2-bpe: vocab.json and "
                             "merges.txt (GPT2BPETokenizer)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=_positive, default=None,
                        help="entries in the vocabulary (default: 30522 for wordpiece, 50257 "
                             "for gpt2-bpe, BERT's and GPT-2's sizes)")
    parser.add_argument("--lowercase", action="store_true",
                        help="wordpiece: lowercase and strip accents, as "
                             "BertWordPieceLowerCase does (without it: BertWordPieceCase)")
    parser.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                        help="the fields of a JSON line that hold text (default: text)")
    parser.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                        help="auto (default): .json/.jsonl are JSON lines, other files text")
    parser.add_argument("--min-frequency", type=_non_negative, default=2,
                        help="merges seen fewer times are not made (default 2)")
    parser.add_argument("--limit-alphabet", type=_positive, default=1000,
                        help="wordpiece: the most frequent characters kept (default 1000)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the vocabulary files already in --output-dir")
    args = parser.parse_args(argv)
    if args.lowercase and args.type == "gpt2-bpe":
        parser.error("--lowercase is for --type wordpiece: GPT-2's byte-level BPE keeps the "
                     "text as it is")
    if args.vocab_size is None:
        args.vocab_size = 30522 if args.type == "wordpiece" else 50257
    least = {"wordpiece": len(WORDPIECE_SPECIAL) + 1, "gpt2-bpe": 257}[args.type]
    if args.vocab_size < least:
        parser.error(f"--vocab-size {args.vocab_size}: a {args.type} vocabulary has at least "
                     f"{least} entries"
                     + (" (the 256 bytes and <|endoftext|>)" if args.type == "gpt2-bpe"
                        else " (its 5 special tokens and a character)"))
    if args.format == "text" and args.json_keys:
        parser.error("--json-keys names fields of JSON lines; --format text reads every file "
                     "as plain text")
    return args


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return number


def input_files(patterns: list[str]) -> list[Path]:
    """The files the patterns name, in order, each once; a missing file, a directory or a
    pattern that matches nothing is refused."""
    files: list[Path] = []
    seen: set[str] = set()
    for pattern in patterns:
        if glob.has_magic(pattern) and not Path(pattern).exists():
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise VocabError(f"--input {pattern}: no file matches the pattern")
        else:
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if path.is_dir():
                if match == pattern:
                    raise VocabError(f"--input {match} is a directory; name its files, e.g. "
                                     f"'{Path(match) / '*.jsonl'}'")
                continue  # a pattern's directories (a '**' pattern matches them): not text
            if not path.exists():
                raise VocabError(f"--input {match}: no such file")
            if not path.is_file():
                raise VocabError(f"--input {match} is not a regular file (a FIFO or a device "
                                 f"is read once; copy it to a file)")
            if os.path.realpath(path) not in seen:
                seen.add(os.path.realpath(path))
                files.append(path)
    if not files:
        raise VocabError(f"--input {' '.join(patterns)}: the patterns match directories only")
    return files


def is_json_lines(path: Path, fmt: str) -> bool:
    return fmt == "jsonl" or (fmt == "auto" and path.suffix.lower() in JSON_SUFFIXES)


def iter_texts(files: list[Path], fmt: str, keys: list[str]) -> Iterator[str]:
    """Every text of the files, in order; a line that cannot be read raises VocabError naming
    the file and the line (counting from 1)."""
    for path in files:
        json_lines = is_json_lines(path, fmt)
        try:
            with open(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        if not json_lines:
                            yield _decode(raw).rstrip("\r\n")
                            continue
                        for value in parse_line(raw, keys).values():
                            yield from (value if isinstance(value, list) else [value])
                    except LineError as exc:
                        raise VocabError(f"{path} line {number}{exc.where}: {exc.what}; "
                                         f"nothing was written") from None
        except OSError as exc:
            raise VocabError(f"--input {path} cannot be read: {exc.strerror}") from exc


def check_corpus(files: list[Path], fmt: str, keys: list[str],
                 normalizer) -> tuple[int, Counter]:
    """(texts, character counts after the normalizer): every line checked before training."""
    texts, chars = 0, Counter()
    for text in iter_texts(files, fmt, keys):
        texts += 1
        chars.update(normalizer.normalize_str(text) if normalizer else text)
    for blank in (" ", "\t", "\n", "\r"):
        chars.pop(blank, None)
    if not chars:
        where = ", ".join(map(str, files))
        fields = f" (the JSON lines' {', '.join(map(repr, keys))} fields)" \
            if any(is_json_lines(p, fmt) for p in files) else ""
        raise VocabError(f"{where}: no text to train on{fields}: "
                         + (f"{texts} text{'s' if texts > 1 else ''}, all blank" if texts
                            else "no non-blank line"))
    return texts, chars


def refuse_outputs_over_inputs(out_dir: Path, names: tuple[str, ...], files: list[Path],
                               overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise VocabError(f"--output-dir {out_dir} is a file; give a directory (it is created "
                         f"if missing)")
    for name in names:
        output = out_dir / name
        for given in files:
            how = _same(output, given)
            if how:
                raise VocabError(f"--input {given} is also an output of this run: --output-dir "
                                 f"{out_dir} writes {output}, which is {given} ({how}); the "
                                 f"run would overwrite its own input. Choose another "
                                 f"--output-dir (or move the input); nothing was written")
    there = [out_dir / n for n in names if os.path.lexists(out_dir / n)]
    if there and not overwrite:
        raise VocabError(f"--output-dir {out_dir} holds a vocabulary already "
                         f"({', '.join(map(str, there))}): data preprocessed with it would no "
                         f"longer match it. Choose another --output-dir, or pass --overwrite "
                         f"to replace it; nothing was written")


def _wordpiece(args, files, keys, normalizer, chars: Counter, tmp: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # the alphabet and its continuations numbered first, in a fixed order: see the docstring
    alphabet = sorted(sorted(chars), key=lambda c: -chars[c])[:args.limit_alphabet]
    alphabet.sort()
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=args.vocab_size, min_frequency=args.min_frequency, show_progress=False,
        special_tokens=WORDPIECE_SPECIAL + [f"##{c}" for c in alphabet],
        initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tokenizer.train_from_iterator(iter_texts(files, args.format, keys), trainer)
    tokenizer.model.save(str(tmp))  # vocab.txt, one token a line in id order
    return tokenizer.get_vocab_size()


def _gpt2_bpe(args, files, keys, tmp: Path) -> int:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(iter_texts(files, args.format, keys), vocab_size=args.vocab_size,
                            min_frequency=args.min_frequency, special_tokens=[GPT2_EOD],
                            show_progress=False)
    bpe.save_model(str(tmp))  # vocab.json and merges.txt, as GPT-2's own files
    return bpe.get_vocab_size()


def _check_loads(args, paths: dict[str, Path]) -> None:
    """The files load as preprocess_data (and the pretraining data loader) loads them."""
    from rapidformer.data.preprocess_tokenizers import build_tokenizer

    if args.type == "wordpiece":
        kind = "BertWordPieceLowerCase" if args.lowercase else "BertWordPieceCase"
        build_tokenizer(kind, str(paths["vocab.txt"]), None, None)
    else:
        build_tokenizer("GPT2BPETokenizer", str(paths["vocab.json"]), str(paths["merges.txt"]),
                        None)


def train_vocab(args) -> tuple[list[Path], int, int, int]:
    """(files written, entries, texts, input files)."""
    from tokenizers import normalizers

    files = input_files(args.input)
    keys = args.json_keys or ["text"]
    if args.json_keys and not any(is_json_lines(p, args.format) for p in files):
        raise VocabError(f"--json-keys {' '.join(args.json_keys)} names fields of JSON lines, "
                         f"but every input is read as plain text (only .json/.jsonl files, or "
                         f"--format jsonl, are JSON lines)")
    out_dir = Path(args.output_dir)
    names = OUTPUTS[args.type]
    refuse_outputs_over_inputs(out_dir, names, files, args.overwrite)
    normalizer = normalizers.BertNormalizer(lowercase=args.lowercase) \
        if args.type == "wordpiece" else None
    texts, chars = check_corpus(files, args.format, keys, normalizer)
    made = [p for p in (out_dir, *out_dir.parents) if not os.path.lexists(p)]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VocabError(f"--output-dir {out_dir} cannot be created ({exc.strerror}); choose "
                         f"another directory") from exc
    done = False
    # trained into a hidden folder of the output directory, renamed into place when whole
    tmp = out_dir / f".tmp-train-vocab-{os.getpid()}"
    try:
        tmp.mkdir()
        if args.type == "wordpiece":
            entries = _wordpiece(args, files, keys, normalizer, chars, tmp)
        else:
            entries = _gpt2_bpe(args, files, keys, tmp)
        _check_loads(args, {name: tmp / name for name in names})
        for name in names:
            os.replace(tmp / name, out_dir / name)
        done = True
    except OSError as exc:
        raise VocabError(f"{exc.filename or out_dir}: {exc.strerror}; nothing was written to "
                         f"{out_dir} (free disk space, or choose another --output-dir)") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:  # a failed or interrupted run leaves no folder it made behind
            for folder in made:
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return [out_dir / n for n in names], entries, texts, len(files)


def next_step(args, written: list[Path]) -> str:
    """The preprocess_data options that read these files."""
    if args.type == "wordpiece":
        kind = "BertWordPieceLowerCase" if args.lowercase else "BertWordPieceCase"
        return f"--vocab-file {written[0]} --tokenizer-type {kind}"
    return f"--vocab-file {written[0]} --merge-file {written[1]} --tokenizer-type GPT2BPETokenizer"


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    try:
        written, entries, texts, nfiles = train_vocab(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    note = f" (above --vocab-size {args.vocab_size}: the alphabet and its ## continuations " \
           f"alone take that many)" if entries > args.vocab_size else ""
    print(f"wrote {' and '.join(map(str, written))}: {entries} entries{note}, from {texts} "
          f"texts in {nfiles} file{'s' if nfiles > 1 else ''} ({time.time() - started:.1f} s)")
    plain = [f for f in input_files(args.input) if not is_json_lines(f, args.format)]
    if plain:  # preprocess_data reads JSON lines only
        print(f"rapidformer-preprocess-data reads JSON lines ({{\"text\": ...}} a line), not "
              f"plain text such as {plain[0]}: write each text as one JSON line first")
    print(f"for rapidformer-preprocess-data: {next_step(args, written)}")


if __name__ == "__main__":
    main()
