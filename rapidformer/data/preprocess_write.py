"""The run of `preprocess_data`: the input's chunks encoded (in worker processes with
`--workers`), written in input order under hidden temporary names next to the output prefix
and renamed whole at the end. SIGTERM and SIGINT stop a run and remove its temporary files,
but never interrupt the clean-up or the renaming; the temporary files of earlier runs whose
writer is gone are removed first."""
from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from rapidformer.data.indexed_writer import IndexedWriter, token_dtype
from rapidformer.data.preprocess_encode import (Encoder, _encode_range_in_worker, _start_worker,
                                                byte_ranges, file_identity)
from rapidformer.data.preprocess_errors import Interrupted, PreprocessError
from rapidformer.data.preprocess_tokenizers import build_rust_tokenizer

LEVELS = ("document", "sentence")


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


def _in_order(pool, tasks, ahead: int):
    """The ranges' results in input order, no more than `ahead` ranges sent before the one to
    write (the arrays of ranges done early wait in memory: a slow range held them all)."""
    pending = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_range_in_worker, (task,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


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


def preprocess(args) -> list[Path]:
    with _SignalStop() as stop:
        return _preprocess(args, stop)


def _preprocess(args, stop: _SignalStop) -> list[Path]:
    source = Path(args.input)
    if not source.is_file():
        raise PreprocessError(f"--input {source}: no such file")
    level = LEVELS[1] if args.split_sentences else LEVELS[0]
    refuse_outputs_over_inputs(args, level)  # before any work: nothing read, nothing written
    # built here first so that a bad vocabulary fails at once, not inside a worker
    tokenizer, eod, vocab_size = build_rust_tokenizer(args.tokenizer_type, args.vocab_file,
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
    # the dtype holds every id the tokenizer gives: a vocabulary file with gaps or repeated
    # entries has ids past its entry count (uint16 wrapped them)
    id_bound = max([vocab_size - 1, *tokenizer.get_vocab().values(), eod or 0]) + 1
    identity = file_identity(source.stat())
    encoder = Encoder(args, tokenizer, eod, token_dtype(id_bound), identity)
    started, done, tokens, size, skipped, lines_before = time.time(), 0, 0, 0, 0, 0
    pool, writers = None, {}
    try:
        writers = {key: IndexedWriter(temps[key] + ".bin", id_bound)
                   for key in args.json_keys}
        # tasks are byte ranges of the input, each starting at a line: a worker reads and
        # tokenizes its own range and sends back NumPy arrays, written here in input order
        tasks = byte_ranges(source, args.workers)
        if args.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(
                args.workers, initializer=_start_worker, initargs=(encoder,))
            results = _in_order(pool, tasks, ahead=4 * args.workers)
        else:
            encoder.open_input()
            results = map(encoder.encode_range, tasks)
        for errors, nbytes, documents, arrays, newlines in results:
            size += nbytes
            for number, error in errors:
                error = f"line {lines_before + number}{error}"
                if args.on_error == "fail":
                    raise PreprocessError(f"{source} {error}; fix the line, or pass "
                                          f"--on-error skip to leave such lines out")
                skipped += 1
                print(f"skipping {source} {error}", file=sys.stderr)
            lines_before += newlines
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
            encoder.close_input()  # the one-worker run read the input here
            for writer in writers.values():
                writer.close()
            for temp in temps.values():
                for ext in (".bin", ".idx"):
                    Path(temp + ext).unlink(missing_ok=True)
    _progress(done, size, started, final=True, skipped=skipped)
    return [Path(finals[k]) for k in args.json_keys]


def _inputs(args) -> list[tuple[str, Path]]:
    """(option, file) for every file the run reads: the corpus, the tokenizer files (a
    --tokenizer-model directory: each file in it)."""
    inputs = [("--input", Path(args.input))]
    for option, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if value:
            inputs.append((option, Path(value)))
    if args.tokenizer_model and Path(args.tokenizer_model).is_dir():
        inputs += [("--tokenizer-model", p) for p in sorted(Path(args.tokenizer_model).rglob("*"))
                   if p.is_file()]
    return inputs


def _entry(path: Path) -> str:
    """The directory entry `path` names, its folder resolved (links, `..`, a relative path),
    its own name not: what os.replace replaces."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _same(output: Path, given: Path) -> str | None:
    """How writing or replacing `output` would reach the file `given` (None: it would not)."""
    out_entry, in_entry = _entry(output), _entry(given)
    in_file = os.path.realpath(given)
    if out_entry == in_entry:
        if str(output) == str(given):
            return "the same path"
        return "the same file, by another path (a relative path, '..' or a linked folder)"
    if out_entry == in_file or os.path.realpath(output) == in_file:
        return "the same file, through a symbolic link"
    try:
        if os.path.samefile(output, given):
            return "the same file, through a hard link"
    except OSError:  # the output is not there yet
        pass
    return None


def refuse_outputs_over_inputs(args, level: str) -> None:
    """Refuse a run one of whose outputs is one of its inputs: the output would replace it
    (its .bin/.idx, renamed over the input at the end), the temporary file would truncate it,
    or the clean-up of an earlier stopped run's temporary files would delete it."""
    prefix = Path(args.output_prefix)
    out_dir, name = prefix.parent, prefix.name
    outputs = []
    for key in args.json_keys:
        final = f"{args.output_prefix}_{key}_{level}"
        outputs += [(Path(final + ext), f"writes {final}{ext}") for ext in (".bin", ".idx")]
        temp = out_dir / f".tmp-{Path(final).name}-{os.getpid()}"
        outputs += [(Path(f"{temp}{ext}"), f"writes its temporary file {temp}{ext}")
                    for ext in (".bin", ".idx")]
    stale = re.compile(r"\.tmp-(?:" + "|".join(re.escape(f"{name}_{k}_{lv}")
                                               for k in args.json_keys for lv in LEVELS)
                       + r")-\d+\.(?:bin|idx)")
    for option, given in _inputs(args):
        for output, what in outputs:
            how = _same(output, given)
            if how:
                raise PreprocessError(
                    f"{option} {given} is also an output of this run: --output-prefix "
                    f"{args.output_prefix} with --json-keys {' '.join(args.json_keys)} {what}, "
                    f"which is {given} ({how}); the run would overwrite its own input. Choose "
                    f"another --output-prefix (or move the input); nothing was written")
        places = {Path(_entry(given)), Path(os.path.realpath(given))}
        if any(stale.fullmatch(place.name) and os.path.realpath(out_dir) == str(place.parent)
               for place in places):
            raise PreprocessError(
                f"{option} {given} has the name of a temporary file of this --output-prefix "
                f"({args.output_prefix}): a run removes such files when their writer is gone. "
                f"Rename the input, or choose another --output-prefix; nothing was written")


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
