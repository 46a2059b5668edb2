"""The workers' job in `preprocess_data`: a byte range of the input -> for each `--json-keys`
key, NumPy arrays of token ids, sequence lengths and sequences per document. The worker reads
the range itself; each line is parsed and checked (a bad one is reported with its line, column
or key), split into sentences with `--split-sentences`, and every `CHUNK_LINES` lines' pieces
are tokenized in one batched call. A worker process imports neither transformers nor torch."""
from __future__ import annotations

import itertools
import json
import os
import re
import signal

import numpy as np

from rapidformer.data.preprocess_errors import LineError, PreprocessError, json_type
from rapidformer.data.preprocess_tokenizers import build_tokenizer

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z0-9])")


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
        raise LineError(f"{json_type(record)}, not a JSON object with the key "
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
        _check_encodable(value, f", key {key!r}")
        return
    if not isinstance(value, list):
        raise LineError(f"{json_type(value)}, expected a string or a list of strings (its "
                        f"sentences)", f", key {key!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise LineError(f"{json_type(item)}, expected a string (a sentence)",
                            f", key {key!r}, item {i}")
        _check_encodable(item, f", key {key!r}, item {i}")


def _check_encodable(text: str, where: str) -> None:
    # a JSON escape of half a UTF-16 pair ("\ud800") decodes to a lone surrogate, which no
    # tokenizer takes (the Rust one raised a TypeError for the whole run)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LineError(f"\\u{ord(text[exc.start]):04x} is half of a UTF-16 surrogate pair "
                        f"(an escape without its other half); fix or remove the escape",
                        f"{where}, character {exc.start + 1}") from exc


def split_sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in SENTENCE_END.split(text)) if s]


# lines per batched tokenizer call inside a task
CHUNK_LINES = 256
# a task is a byte range of the input, read by the worker itself: about this many per worker
# (load balance and progress), and no smaller than MIN_TASK_BYTES (per-task overhead) until the
# end of the input, where they shrink (`byte_ranges`)
TASKS_PER_WORKER = 8
MIN_TASK_BYTES = 1 << 20
MAX_TASK_BYTES = 4 << 20  # a range's lines are held at once: about 12x its bytes at worst


def task_bytes(size: int, workers: int) -> int:
    return min(max(size // max(workers * TASKS_PER_WORKER, 1), MIN_TASK_BYTES), MAX_TASK_BYTES)


def byte_ranges(path, workers: int) -> list[tuple[int, int]]:
    """Consecutive (start, end) byte ranges covering the file, each starting at the beginning
    of a line (right after a b"\\n"), so that no line is cut. Each is `task_bytes` long while
    much of the input is left, then a worker's share of half of what is left, down to a 16th of
    that (guided scheduling): the last ranges, which the workers end at different times, are
    short, so that no worker is left tokenizing a full range while the others wait."""
    size = os.path.getsize(path)
    per = task_bytes(size, workers)
    least = max(per // 16, 1)
    bounds = [0]
    with open(path, "rb") as f:
        while True:
            left = size - bounds[-1]
            step = per if workers == 1 else max(min(per, left // (2 * workers)), least)
            if step >= left:
                break
            f.seek(bounds[-1] + step - 1)  # a line that starts exactly there stays whole
            f.readline()
            end = f.tell()
            if end >= size:
                break
            bounds.append(end)
    bounds.append(size)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def file_identity(stat: os.stat_result) -> tuple:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class Encoder:
    """Per worker: parse a chunk of lines, tokenize every key's pieces of the whole chunk in
    one batched call, and hand back NumPy arrays (cheap to send between processes and to
    write). A worker process builds its tokenizer from the main process's serialized Rust
    tokenizer: it imports neither transformers nor torch (a spawned worker used to spend
    seconds importing them before its first line)."""

    def __init__(self, args, tokenizer, eod: int | None, dtype=np.int32, identity=None):
        self.args, self.eod, self.dtype = args, eod, dtype
        # the input file the run started on (`file_identity`): each process opens it once and
        # checks that it still is (a file replaced, grown or cut short is an error, not data)
        self.identity, self._input = identity, None
        # the Rust tokenizer behind a Hugging Face one (a tokenizers.Tokenizer), else the
        # Hugging Face tokenizer itself
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.tokenizer = tokenizer if backend is None else backend

    def __getstate__(self):
        # a worker gets the Rust tokenizer serialized, or builds the Hugging Face one itself
        rust = hasattr(self.tokenizer, "encode_batch")
        return {**self.__dict__, "tokenizer": self.tokenizer.to_str() if rust else None,
                "_input": None}

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
        self.open_input()  # at the start: a later removal of the file does not stop the run

    def open_input(self):
        if self._input is None:
            try:
                f = open(self.args.input, "rb")
            except OSError as exc:
                raise self._changed(f"could not be opened again ({exc.strerror})") from exc
            if self.identity is not None and file_identity(os.fstat(f.fileno())) != self.identity:
                f.close()
                raise self._changed("was replaced or written to")
            self._input = f
        return self._input

    def close_input(self):
        if self._input is not None:
            self._input.close()
            self._input = None

    def _changed(self, what: str) -> PreprocessError:
        return PreprocessError(f"--input {self.args.input} {what} while the run read it; "
                               f"nothing was written under {self.args.output_prefix}_*; run "
                               f"again on a file that does not change while it is read")

    def encode_chunk(self, chunk: list[tuple[int, bytes]]):
        """(errors as (line, message), documents, {key: (tokens, sequence lengths, sequences
        per document)}) for a chunk of numbered lines, in their order."""
        errors, pieces = [], {k: [] for k in self.args.json_keys}
        counts = {k: [] for k in self.args.json_keys}  # pieces per document
        for number, raw in chunk:
            try:
                texts = parse_line(raw, self.args.json_keys)
            except LineError as exc:
                errors.append((number, f"{exc.where}: {exc.what}"))
                continue
            for key, text in texts.items():
                split = self._pieces(text)
                pieces[key].extend(split)
                counts[key].append(len(split))
        out = {key: self._arrays(pieces[key], counts[key]) for key in self.args.json_keys}
        return errors, len(chunk) - len(errors), out

    def encode_range(self, task: tuple[int, int]):
        """The worker reads its own byte range of the input (nothing of it is sent through a
        pipe): (errors as (line within the range, where + message), bytes, documents,
        {key: (tokens, sequence lengths, sequences per document)}, newlines in the range).
        With --on-error fail it stops at its first malformed line."""
        start, end = task
        f = self.open_input()
        try:
            f.seek(start)
            data = f.read(end - start)
        except OSError as exc:
            raise self._changed(f"could not be read at byte {start} ({exc.strerror})") from exc
        if len(data) != end - start:
            raise self._changed("became shorter")
        newlines = data.count(b"\n")
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # after the range's last b"\n"
        numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
        del data, lines
        errors, documents, parts = [], 0, {k: [] for k in self.args.json_keys}
        for chunk in _chunks(numbered, CHUNK_LINES):
            chunk_errors, docs, arrays = self.encode_chunk(chunk)
            documents += docs
            for key, value in arrays.items():
                parts[key].append(value)
            if chunk_errors:
                errors += chunk_errors
                if self.args.on_error == "fail":
                    break
        out = {key: self._joined(chunks) for key, chunks in parts.items()}
        return errors, end - start, documents, out, newlines

    def _joined(self, chunks: list[tuple]) -> tuple:
        """One (tokens, sequence lengths, sequences per document) of a range's chunks."""
        if not chunks:
            return np.zeros(0, self.dtype), np.zeros(0, np.int32), np.zeros(0, np.int32)
        return chunks[0] if len(chunks) == 1 else tuple(map(np.concatenate, zip(*chunks)))

    def _pieces(self, text: str | list[str]) -> list[str]:
        if isinstance(text, list):
            return text
        return split_sentences(text) if self.args.split_sentences else [text]

    def _arrays(self, pieces: list[str], counts: list[int]):
        ids = self._encode(pieces)
        lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype,
                             count=int(lens.sum()))
        counts = np.asarray(counts, dtype=np.int64)
        document = np.repeat(np.arange(counts.size), counts)
        # Megatron keeps only sentences with tokens, and ends a document with tokens with the
        # EOD (on its last sentence)
        keep = lens > 0
        lengths, document = lens[keep], document[keep]
        per_document = np.bincount(document, minlength=counts.size).astype(np.int32)
        if self.args.append_eod and lengths.size:
            last = np.ones(lengths.size, dtype=bool)
            last[:-1] = document[1:] != document[:-1]
            tokens = np.insert(tokens, np.cumsum(lengths)[last], self.dtype(self.eod))
            lengths = lengths + last
        return tokens, lengths.astype(np.int32), per_document

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        if not pieces:
            return []
        tokenizer = self.tokenizer
        if hasattr(tokenizer, "encode_batch_fast"):  # Rust, without offsets: ids alone
            return [e.ids for e in tokenizer.encode_batch_fast(pieces, add_special_tokens=False)]
        if hasattr(tokenizer, "encode_batch"):  # Rust: one batched call for the chunk
            return [e.ids for e in tokenizer.encode_batch(pieces, add_special_tokens=False)]
        return [tokenizer.encode(p, add_special_tokens=False) for p in pieces]


_worker: Encoder | None = None  # a worker process's encoder, with its tokenizer


def _start_worker(encoder: Encoder) -> None:
    global _worker
    encoder.initializer()
    _worker = encoder


def _encode_range_in_worker(task):
    return _worker.encode_range(task)


def _chunks(lines, size: int):
    chunk = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
