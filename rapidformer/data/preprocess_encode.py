"""The workers' job in `preprocess_data`: a chunk of numbered input lines -> for each
`--json-keys` key, NumPy arrays of token ids, sequence lengths and sequences per document.
Each line is parsed and checked (a bad one is reported with its line, column or key), split
into sentences with `--split-sentences`, and the chunk's pieces are tokenized in one batched
call. A worker process imports neither transformers nor torch."""
from __future__ import annotations

import json
import os
import re
import signal

import numpy as np

from rapidformer.data.preprocess_errors import LineError, json_type
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
        return
    if not isinstance(value, list):
        raise LineError(f"{json_type(value)}, expected a string or a list of strings (its "
                        f"sentences)", f", key {key!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise LineError(f"{json_type(item)}, expected a string (a sentence)",
                            f", key {key!r}, item {i}")


def split_sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in SENTENCE_END.split(text)) if s]


# documents per task a worker takes: one batched tokenizer call and one array per key each


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
