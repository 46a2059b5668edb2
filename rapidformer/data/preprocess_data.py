"""Loose JSON -> Megatron's indexed dataset (.bin/.idx), as the seeds' preprocess_data.py.

    python -m rapidformer.data.preprocess_data --input corpus.json --output-prefix gpt_small \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

One JSON object per line; each `--json-keys` field (default `text`) becomes
`{prefix}_{key}_document.bin/.idx` (`_sentence` with `--split-sentences`). The files are
Megatron's format exactly (`data/indexed_writer.py`: byte for byte what megatron-core's
`IndexedDatasetBuilder` writes), without importing megatron-core.

Speed: the lines go to the workers in chunks of `CHUNK_LINES`; a worker tokenizes a chunk's
pieces in one batched call to the Rust tokenizer, rebuilt from the main process's serialized
one (no transformers or torch import in a worker), and sends back NumPy arrays, which the main
process writes as they come, in input order.

Documents are numbered as Megatron-LM's tools/preprocess_data.py (the megatron-core version)
numbers them, one per line:
- a `text` that is a list of strings (Megatron's sentence-split form, `{"text": ["One.",
  "Two."]}`) is one document whose sentences are tokenized one by one and written as separate
  sequences, at either level (Megatron passes the per-sentence lengths to `add_document` with
  or without `--split-sentences`); the list's items are taken as the sentences, not split again;
  `--append-eod` extends the last sentence;
- with a BERT WordPiece tokenizer, `--append-eod` ends a document with Megatron-LM's `[EOS]`
  (`--bert-eod eos`, the default): its BERT tokenizer (`_BertWordPieceTokenizer` in
  megatron/training/tokenizer/tokenizer.py) adds `[BOS]` and `[EOS]` after the vocab.txt's
  V entries (ids V and V + 1; a vocab.txt that has them keeps its own ids), its `eod` is
  `[EOS]`, and its vocabulary, V + 2 entries, sets the token dtype; `--bert-eod sep` ends it
  with `[SEP]` and keeps V entries, as Megatron-LM's newer tokenizer system (the default from
  core 0.15, the only one from 0.17) and earlier versions of this script do. The files load for
  training either way (data/pretraining_tokenizer.py reads the convention from the data);
- an empty `text` (or one with no tokens: `""`, `[]`, `[""]`) is an empty document: an entry in
  the document index with no sequence and no EOD, even with `--append-eod` (Megatron appends
  the EOD only to a document with tokens). Megatron-LM before megatron-core dropped such
  documents; its current script keeps them, and so does this one;
- blank lines are skipped (Megatron's script stops at them), and `--on-error skip` leaves out
  malformed lines; without those, line N of the input is document N (counting from 1; index
  N - 1 of the document index). A corpus in which every document is empty is refused: it would
  hold no sequence to train on.

Every data problem stops the run (or, with `--on-error skip`, skips the line) with one message
naming the file, the line and the column or key: invalid UTF-8 (line, byte column), invalid
JSON (line, column), a line that is not an object, a missing key, a `text` that is neither a
string nor a list of strings (line, key, item). Unusable tokenizer files (a merges file that
does not belong to the vocabulary, files that are not UTF-8, JSON or a vocabulary of the kind
`--tokenizer-type` needs, a tokenizer directory that does not load) are named with the fix.
These are `InputError`s: exit code 2, no traceback.

The output is written under a hidden temporary name next to the prefix
(`.tmp-{name}-{pid}.bin/.idx`) and renamed at the end: a failed or interrupted run leaves
nothing under the output name. SIGTERM or SIGINT (Ctrl-C) stops the run, removes its temporary
files and exits with 128 + the signal number (143, 130), as a run stopped at once does in
docs/reliability.md; the renaming at the end is not interrupted. A run killed outright
(SIGKILL, a power cut) cannot clean up: the next run of the same prefix removes temporary files
whose writer process is gone, and never those of a live one.

Differences from Megatron's script: `--split-sentences` uses a rule-based splitter (after . ! ?
followed by whitespace and an upper-case letter, digit or quote) instead of NLTK's punkt model,
which needs a download; `--dataset-impl` accepts only `mmap` (megatron-core has no other).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from rapidformer.data.indexed_writer import IndexedWriter
from rapidformer.errors import InputError

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z0-9])")
# Megatron's BERT tokenizer looks each of these up in the vocabulary file
BERT_SPECIAL_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
# ...and adds these after its entries, in this order, when it lacks them; [EOS] is its eod
MEGATRON_BERT_ADDED = ("[BOS]", "[EOS]")
# --bert-eod: Megatron's [EOS] (the default) or [SEP]
BERT_EODS = ("eos", "sep")
LEVELS = ("document", "sentence")
PROG = "rapidformer-preprocess-data"


class PreprocessError(InputError):
    """Input, tokenizer files or output paths that preprocessing cannot use."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT, raised in the main thread so that the `finally` clauses remove the
    temporary files. A BaseException, as KeyboardInterrupt is: no `except Exception` on the
    way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.name = signal.Signals(signum).name
        self.progress = "before any document was written"


class LineError(ValueError):
    """A line of the input that cannot be used; `where` is what follows 'line N' (a column,
    a key)."""

    def __init__(self, what: str, where: str = ""):
        super().__init__(what)
        self.what, self.where = what, where


# ---------------------------------------------------------------------------- tokenizer files

def _read_text(path: str, flag: str) -> str:
    """A tokenizer file as text, or an error naming the line and byte that are not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PreprocessError(f"{path} ({flag}) cannot be read: {exc.strerror}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PreprocessError(f"{path} ({flag}) is not UTF-8 text: line {line}, byte column "
                              f"{column} is 0x{data[exc.start]:02x}; tokenizer files are UTF-8 "
                              f"(is it the right file, or a binary model?)") from exc


def _require_file(path: str | None, flag: str, kind: str, what: str) -> None:
    if not path or not Path(path).is_file():
        raise PreprocessError(f"--tokenizer-type {kind} needs {flag} ({what}); not found: {path}")


def build_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None,
                    tokenizer_path: str | None, bert_eod: str = "sep"):
    """(tokenizer, eod id, vocabulary size) for one of the seed's tokenizer types; every
    unusable file is a PreprocessError naming it and the fix. `bert_eod` (BERT WordPiece only):
    "sep" ends documents with [SEP] in a vocabulary of the file's V entries, "eos" as
    Megatron-LM's BERT tokenizer does, with [EOS] in V + 2 (`megatron_bert_added`); the
    tokenizer itself is the file's either way (Megatron's never matches [BOS]/[EOS] in text)."""
    if kind.startswith("BertWordPiece"):
        tokenizer, sep, size = _bert_tokenizer(kind, vocab_file)
        if bert_eod == "sep":
            return tokenizer, sep, size
        ids, size = megatron_bert_added(tokenizer.get_vocab())
        return tokenizer, ids["[EOS]"], size
    if kind == "GPT2BPETokenizer":
        return _gpt2_tokenizer(vocab_file, merge_file)
    return _hf_tokenizer(tokenizer_path)


def megatron_bert_added(vocab: dict) -> tuple[dict, int]:
    """({"[BOS]": id, "[EOS]": id}, vocabulary size) as Megatron-LM's BERT tokenizer has them:
    `_BertWordPieceTokenizer.__init__` calls `add_token("[BOS]")` then `add_token("[EOS]")`,
    which give a token the next id (`len(vocab)`) unless the vocab.txt has it; `vocab_size` is
    then len(vocab), and `eod` is the [EOS] id. For bert-base-uncased's 30,522 entries:
    [BOS] 30522, [EOS] 30523, 30,524 entries."""
    ids, size = {}, len(vocab)
    for token in MEGATRON_BERT_ADDED:
        if token in vocab:
            ids[token] = vocab[token]
        else:
            ids[token], size = size, size + 1
    return ids, size


def _bert_tokenizer(kind: str, vocab_file: str | None):
    from transformers import BertTokenizer

    _require_file(vocab_file, "--vocab-file", kind, "a WordPiece vocab.txt")
    text = _read_text(vocab_file, "--vocab-file")
    if text.lstrip().startswith("{"):
        raise PreprocessError(f"{vocab_file} is a JSON vocabulary (GPT-2 style), not a "
                              f"WordPiece vocab.txt: use --tokenizer-type GPT2BPETokenizer "
                              f"with --merge-file, or give a vocab.txt")
    tokens = {line.strip() for line in text.splitlines()}
    missing = [t for t in BERT_SPECIAL_TOKENS if t not in tokens]
    if missing:
        # transformers would add them after the file's entries, with ids that Megatron's BERT
        # tokenizer, reading the same file, does not have
        raise PreprocessError(f"{vocab_file} (--vocab-file) has no {' '.join(missing)} "
                              f"(one token a line; it has {len(tokens - {''})} entries): a BERT "
                              f"WordPiece vocab.txt holds all of {' '.join(BERT_SPECIAL_TOKENS)}; "
                              f"give the vocab.txt of a BERT model, or add the missing lines")
    try:
        tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=kind.endswith("LowerCase"))
    except Exception as exc:  # the Rust WordPiece loader's own checks
        raise PreprocessError(f"{vocab_file} (--vocab-file) cannot be loaded as a WordPiece "
                              f"vocab.txt: {exc}") from exc
    return tokenizer, tokenizer.sep_token_id, len(tokenizer)


def _gpt2_tokenizer(vocab_file: str | None, merge_file: str | None):
    from transformers import GPT2Tokenizer

    _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "a GPT-2 vocab.json")
    _require_file(merge_file, "--merge-file", "GPT2BPETokenizer", "a GPT-2 merges.txt")
    vocab = _gpt2_vocab(vocab_file)
    if "<|endoftext|>" not in vocab:
        raise PreprocessError(f"{vocab_file} has no <|endoftext|> token, which GPT-2 "
                              f"tokenization uses as end of document")
    merges = _read_text(merge_file, "--merge-file")
    try:
        tokenizer = GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    except Exception as exc:  # the Rust BPE loader: "Token `qq` out of vocabulary" and the like
        raise PreprocessError(_merges_problem(vocab, merges, vocab_file, merge_file)
                              or f"{vocab_file} (--vocab-file) and {merge_file} (--merge-file) "
                                 f"cannot be loaded as a GPT-2 BPE tokenizer: {exc}") from exc
    return tokenizer, vocab["<|endoftext|>"], len(tokenizer)


def _gpt2_vocab(vocab_file: str) -> dict:
    text = _read_text(vocab_file, "--vocab-file")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as exc:
        # a file that starts as JSON is a damaged vocab.json, not a vocab.txt: say where
        damage = f"; its JSON breaks at line {exc.lineno}, column {exc.colno} ({exc.msg})" \
            if text.lstrip().startswith("{") else ""
        raise PreprocessError(f"{vocab_file} is not a GPT-2 vocab.json (JSON); for a "
                              f"WordPiece vocab.txt use --tokenizer-type "
                              f"BertWordPieceLowerCase{damage}") from exc
    if not isinstance(vocab, dict):
        raise PreprocessError(f"{vocab_file} (--vocab-file) is JSON but not a GPT-2 vocabulary: "
                              f"it is {_json_type(vocab)}, expected an object mapping each token "
                              f"to its id, as {{\"<|endoftext|>\": 50256, ...}}")
    for token, index in vocab.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise PreprocessError(f"{vocab_file} (--vocab-file), key {token!r}: its id is "
                                  f"{_json_type(index)}, expected an integer; a GPT-2 vocab.json "
                                  f"maps each token to its id")
    return vocab


def _merges_problem(vocab: dict, merges: str, vocab_file: str, merge_file: str) -> str | None:
    """Why merges.txt does not load with this vocabulary: the first bad line, named."""
    if merges.lstrip().startswith("{"):
        return (f"{merge_file} (--merge-file) is JSON, not a GPT-2 merges.txt: were "
                f"--vocab-file and --merge-file swapped?")
    first, unknown, total = None, 0, 0
    for number, line in enumerate(merges.splitlines(), start=1):
        if number == 1 and line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            return (f"{merge_file} (--merge-file), line {number}: {line!r} is not two tokens "
                    f"separated by one space (a GPT-2 merges.txt line looks like 'Ġ t'); is it "
                    f"the merges file?")
        total += 1
        if not all(t in vocab for t in (*parts, "".join(parts))):
            unknown += 1
            first = first or (number, line, "".join(parts))
    if first is None:
        return None
    number, line, merged = first
    return (f"{merge_file} (--merge-file) does not match {vocab_file} (--vocab-file): line "
            f"{number}, {line!r}, makes {merged!r}, which that vocabulary does not have "
            f"({unknown} of the {total} merges do not fit it); pass the merges.txt saved "
            f"together with this vocab.json (they come as a pair, e.g. gpt2-vocab.json and "
            f"gpt2-merges.txt)")


def _hf_tokenizer(tokenizer_path: str | None):
    from transformers import AutoTokenizer

    if not tokenizer_path or not Path(tokenizer_path).is_dir():
        raise PreprocessError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a "
                              f"local tokenizer directory; not found: {tokenizer_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as exc:  # corrupt or missing tokenizer.json, vocab files, config
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise PreprocessError(f"{tokenizer_path} (--tokenizer-model) does not load as a Hugging "
                              f"Face tokenizer ({type(exc).__name__}: {reason}); give a "
                              f"directory written by tokenizer.save_pretrained()") from exc
    eod = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return tokenizer, eod, len(tokenizer)


# ---------------------------------------------------------------------------- input lines

def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    return {dict: "an object", list: "an array", str: "a string"}[type(value)]


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        near = raw[max(0, exc.start - 20):exc.start + 10].decode("utf-8", "backslashreplace")
        raise LineError(f"byte 0x{raw[exc.start]:02x} is not valid UTF-8 (near: {near.strip()}); "
                        f"re-encode the file as UTF-8, e.g. iconv -f cp1252 -t utf-8",
                        f", byte column {exc.start + 1}") from exc


def parse_line(raw: bytes, keys: list[str]) -> dict:
    """key -> a string or a list of strings, from one line of the input."""
    # without its line end, so that an error at the end is placed on this line, not the next
    text = _decode(raw).rstrip("\r\n")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"not valid JSON ({exc.msg})", f", column {exc.pos + 1}") from exc
    if not isinstance(record, dict):
        raise LineError(f"{_json_type(record)}, not a JSON object with the key "
                        f"{', '.join(map(repr, keys))}")
    missing = [k for k in keys if k not in record]
    if missing:
        raise LineError(f"no key {', '.join(map(repr, missing))} (its keys: "
                        f"{', '.join(record) or 'none'}); set --json-keys")
    for key in keys:
        _check_text(record[key], key)
    return {key: record[key] for key in keys}


def _check_text(value, key: str) -> None:
    # Megatron reads a list as the document's sentences; anything else would be tokenized as
    # its Python repr ('None', '{...}')
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise LineError(f"{_json_type(value)}, expected a string or a list of strings (its "
                        f"sentences)", f", key {key!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise LineError(f"{_json_type(item)}, expected a string (a sentence)",
                            f", key {key!r}, item {i}")


def split_sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in SENTENCE_END.split(text)) if s]


# documents per task a worker takes: one batched tokenizer call and one array per key each
CHUNK_LINES = 256


class Encoder:
    """Per worker: parse a chunk of lines, tokenize every key's pieces of the whole chunk in
    one batched call, and hand back NumPy arrays (cheap to send between processes and to
    write). A worker process builds its tokenizer from the main process's serialized Rust
    tokenizer: it imports neither transformers nor torch (a spawned worker used to spend
    seconds importing them before its first line)."""

    def __init__(self, args, tokenizer, eod: int | None):
        self.args, self.eod = args, eod
        # the Rust tokenizer behind a Hugging Face one (a tokenizers.Tokenizer), else the
        # Hugging Face tokenizer itself
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.tokenizer = tokenizer if backend is None else backend

    def __getstate__(self):
        # a worker gets the Rust tokenizer serialized, or builds the Hugging Face one itself
        rust = hasattr(self.tokenizer, "encode_batch")
        return {**self.__dict__, "tokenizer": self.tokenizer.to_str() if rust else None}

    def initializer(self):
        # Ctrl-C reaches the whole process group: the main process alone handles it, and stops
        # the workers itself (a KeyboardInterrupt here would print a traceback per worker)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # one thread per worker: the workers are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if isinstance(self.tokenizer, str):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(self.tokenizer)
        else:
            a = self.args
            self.tokenizer, _, _ = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file,
                                                   a.tokenizer_model, a.bert_eod)

    def encode_chunk(self, chunk: list[tuple[int, bytes]]):
        """(errors as (line, message), input bytes, documents, {key: (tokens, sequence
        lengths, sequences per document)}) for a chunk of numbered lines, in their order."""
        errors, pieces, nbytes = [], {k: [] for k in self.args.json_keys}, 0
        counts = {k: [] for k in self.args.json_keys}  # pieces per document
        for number, raw in chunk:
            nbytes += len(raw)
            try:
                texts = parse_line(raw, self.args.json_keys)
            except LineError as exc:
                errors.append((number, f"line {number}{exc.where}: {exc.what}"))
                continue
            for key, text in texts.items():
                split = self._pieces(text)
                pieces[key].extend(split)
                counts[key].append(len(split))
        out = {key: self._arrays(pieces[key], counts[key]) for key in self.args.json_keys}
        return errors, nbytes, len(chunk) - len(errors), out

    def _pieces(self, text: str | list[str]) -> list[str]:
        if isinstance(text, list):
            return text
        return split_sentences(text) if self.args.split_sentences else [text]

    def _arrays(self, pieces: list[str], counts: list[int]):
        ids = self._encode(pieces)
        tokens, lengths, per_document, at = [], [], [], 0
        for n in counts:
            # Megatron keeps only sentences with tokens, and ends a document with tokens with
            # the EOD (on its last sentence)
            sentences = [s for s in ids[at:at + n] if s]
            at += n
            if sentences and self.args.append_eod:
                sentences[-1] = [*sentences[-1], self.eod]
            for s in sentences:
                tokens.extend(s)
                lengths.append(len(s))
            per_document.append(len(sentences))
        return (np.array(tokens, dtype=np.int32), np.array(lengths, dtype=np.int32),
                np.array(per_document, dtype=np.int32))

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        if not pieces:
            return []
        tokenizer = self.tokenizer
        if hasattr(tokenizer, "encode_batch"):  # Rust: one batched call for the chunk
            return [e.ids for e in tokenizer.encode_batch(pieces, add_special_tokens=False)]
        return [tokenizer.encode(p, add_special_tokens=False) for p in pieces]


_worker: Encoder | None = None  # a worker process's encoder, with its tokenizer


def _start_worker(encoder: Encoder) -> None:
    global _worker
    encoder.initializer()
    _worker = encoder


def _encode_in_worker(chunk):
    return _worker.encode_chunk(chunk)


def _chunks(lines, size: int):
    chunk = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------- signals, temp files

class _SignalStop:
    """SIGTERM/SIGINT raise Interrupted in the main thread, once; while `defer` is set (the
    clean-up, and everything after the output is finished) they are ignored, so that a clean-up
    is never half done and a finished output never half renamed: both take milliseconds."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.raised, self.defer, self.previous = False, False, {}

    def __enter__(self):
        # signal handlers can only be set from the main thread; elsewhere the caller's own
        # handling stays
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            # None: a handler set outside Python, which cannot be put back; the default is
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        return False

    def _handle(self, signum, frame):
        if self.raised or self.defer:
            return
        self.raised = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self):
        before, self.defer = self.defer, True
        try:
            yield
        finally:
            self.defer = before


def _writer_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a file of an earlier process with this pid: this one has not begun
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:  # a zombie (killed, not yet reaped by its parent) writes nothing more
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temporaries(out_dir: Path, names: list[str]) -> list[Path]:
    """Remove the temporary files of these outputs whose writer is gone: a run killed with
    SIGKILL, or a machine that went down, cannot remove its own."""
    pattern = re.compile(r"\.tmp-(?:" + "|".join(map(re.escape, names)) + r")-(\d+)\.(?:bin|idx)")
    removed = []
    for path in sorted(out_dir.glob(".tmp-*")):
        match = pattern.fullmatch(path.name)
        if match and not _writer_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------- the run

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--bert-eod", choices=BERT_EODS,
                        help="BertWordPiece tokenizers: the token --append-eod ends a document "
                             "with. eos (default): Megatron-LM's [EOS], which its BERT tokenizer "
                             "adds after the vocab.txt's V entries with [BOS] (ids V+1 and V; "
                             "V+2 entries); sep: [SEP], within the V entries (Megatron-LM's "
                             "newer tokenizer system, and this script before)")
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
    bert = args.tokenizer_type.startswith("BertWordPiece")
    if args.bert_eod is not None and not bert:
        parser.error(f"--bert-eod is for the BertWordPiece tokenizer types, not "
                     f"{args.tokenizer_type} (which ends documents with its own EOS token)")
    if args.bert_eod is not None and not args.append_eod:
        parser.error(f"--bert-eod {args.bert_eod} chooses the token --append-eod writes at the "
                     f"end of each document; add --append-eod, or drop --bert-eod")
    args.bert_eod = args.bert_eod or ("eos" if bert else "sep")
    return args


def preprocess(args) -> list[Path]:
    with _SignalStop() as stop:
        return _preprocess(args, stop)


def _preprocess(args, stop: _SignalStop) -> list[Path]:
    source = Path(args.input)
    if not source.is_file():
        raise PreprocessError(f"--input {source}: no such file")
    # built here first so that a bad vocabulary fails at once, not inside a worker
    tokenizer, eod, vocab_size = build_tokenizer(args.tokenizer_type, args.vocab_file,
                                                 args.merge_file, args.tokenizer_model,
                                                 args.bert_eod)
    if args.append_eod and eod is None:
        raise PreprocessError(f"--append-eod: the tokenizer in {args.tokenizer_model} has neither "
                              f"an EOS nor a SEP token to end documents with; leave out "
                              f"--append-eod or use a tokenizer with an eos_token")
    if args.append_eod and args.tokenizer_type.startswith("BertWordPiece"):
        print(f"documents end with {'[EOS]' if args.bert_eod == 'eos' else '[SEP]'} (id {eod}; "
              f"a vocabulary of {vocab_size} entries): "
              + ("Megatron-LM's BERT end of document; --bert-eod sep ends them with [SEP]"
                 if args.bert_eod == "eos" else "--bert-eod eos ends them with Megatron-LM's [EOS]"),
              file=sys.stderr)
    level = LEVELS[1] if args.split_sentences else LEVELS[0]
    out_dir = Path(args.output_prefix).parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreprocessError(f"--output-prefix {args.output_prefix}: {out_dir} cannot be created "
                              f"({exc.strerror}); choose another directory") from exc
    name = Path(args.output_prefix).name
    stale = remove_stale_temporaries(out_dir, [f"{name}_{k}_{lv}" for k in args.json_keys
                                               for lv in LEVELS])
    if stale:
        print(f"removed {len(stale)} temporary files of earlier runs that were stopped before "
              f"they finished: {', '.join(p.name for p in stale)}", file=sys.stderr)
    finals = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    temps = {key: str(out_dir / f".tmp-{Path(finals[key]).name}-{os.getpid()}")
             for key in args.json_keys}
    encoder = Encoder(args, tokenizer, eod)
    started, done, tokens, size, skipped = time.time(), 0, 0, 0, 0
    pool, writers = None, {}
    try:
        writers = {key: IndexedWriter(temps[key] + ".bin", vocab_size)
                   for key in args.json_keys}
        with open(source, "rb") as f:
            # bytes, decoded line by line: a bad byte is then reported at its line and column
            lines = ((n, line) for n, line in enumerate(f, start=1) if line.strip())
            chunks = _chunks(lines, CHUNK_LINES)
            if args.workers > 1:
                pool = multiprocessing.get_context("spawn").Pool(
                    args.workers, initializer=_start_worker, initargs=(encoder,))
                results = pool.imap(_encode_in_worker, chunks)
            else:
                results = map(encoder.encode_chunk, chunks)
            for errors, nbytes, documents, arrays in results:
                size += nbytes
                for _, error in errors:
                    if args.on_error == "fail":
                        raise PreprocessError(f"{source} {error}; fix the line, or pass "
                                              f"--on-error skip to leave such lines out")
                    skipped += 1
                    print(f"skipping {source} {error}", file=sys.stderr)
                for key, (ids, lengths, per_document) in arrays.items():
                    # an empty document too: Megatron's builder keeps it, so document N stays
                    # line N
                    writers[key].add(ids, lengths, per_document)
                    tokens += int(ids.size)
                before, done = done, done + documents
                if done // args.log_interval > before // args.log_interval:
                    _progress(done, size, started)
        _check_not_empty(source, args, done, tokens)
        for key, writer in writers.items():
            writer.finalize(temps[key] + ".idx")
        # from here the output is whole: a signal no longer stops the run, which ends in
        # milliseconds, so that no output is left half renamed or reported as not written
        stop.defer = True
        for key in args.json_keys:
            for ext in (".bin", ".idx"):
                os.replace(temps[key] + ext, finals[key] + ext)
    except Interrupted as exc:
        exc.progress = (f"after {done} documents" if done else exc.progress) + \
            f": removed its temporary files " \
            f"{', '.join(Path(t).name + '.bin/.idx' for t in temps.values())} and wrote " \
            f"nothing to {', '.join(f + '.bin/.idx' for f in finals.values())}"
        raise
    except OSError as exc:  # a full disk, a read-only or vanished output directory
        raise PreprocessError(f"{exc.filename or out_dir}: {exc.strerror}; nothing was written "
                              f"under {args.output_prefix}_* (free disk space, or choose another "
                              f"--output-prefix)") from exc
    finally:
        with stop.deferred():
            if pool is not None:
                pool.terminate()
            for writer in writers.values():
                writer.close()
            for temp in temps.values():
                for ext in (".bin", ".idx"):
                    Path(temp + ext).unlink(missing_ok=True)
    _progress(done, size, started, final=True, skipped=skipped)
    return [Path(finals[k]) for k in args.json_keys]


def _check_not_empty(source: Path, args, done: int, tokens: int) -> None:
    if done == 0:
        raise PreprocessError(f"{source} holds no documents (every line empty or "
                              f"skipped); nothing written")
    if tokens == 0:
        raise PreprocessError(f"{source}: every one of its {done} documents has an empty "
                              f"{' / '.join(map(repr, args.json_keys))} (no tokens); nothing "
                              f"written")


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
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Interrupted as stop:
        print(f"{PROG}: stopped by {stop.name} {stop.progress}; run the same command again to "
              f"start over (exit code {stop.exit_code})", file=sys.stderr)
        sys.exit(stop.exit_code)
    for prefix in outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
