"""Loose JSON -> Megatron's indexed dataset (.bin/.idx), as the seeds' preprocess_data.py.

    python -m rapidformer.data.preprocess_data --input corpus.json --output-prefix gpt_small \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

One JSON object per line; each `--json-keys` field (default `text`) becomes
`{prefix}_{key}_document.bin/.idx` (`_sentence` with `--split-sentences`). The files are
Megatron's format exactly (`data/indexed_writer.py`: byte for byte what megatron-core's
`IndexedDatasetBuilder` writes), without importing megatron-core.

Speed: the input is cut into byte ranges that start at a line (about 8 per worker, 1 to 4 MiB
each, shorter toward the end); a worker reads its own range from the file (no text goes through
a pipe), tokenizes it `CHUNK_LINES` lines per batched call to the Rust tokenizer
(`encode_batch_fast`: ids without offsets), rebuilt from the main process's serialized one (no
transformers or torch import in a worker; the main process builds the GPT-2 and BERT ones
without transformers too), and sends back NumPy arrays of the output's token dtype, which the
main process writes as they come, in input order, numbering the lines of each range after those
of the ranges before it. With --workers 1 the ranges are tokenized in the main process, whose
Rust tokenizer uses all cores (TOKENIZERS_PARALLELISM=false makes it one thread, as each
worker's is).

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

A run one of whose outputs is one of its inputs (`--input`, `--vocab-file`, `--merge-file`, the
files of `--tokenizer-model`) is refused before any work, however the two are named (a relative
or `..` path, a linked folder, a link either way, a hard link, another `--json-keys` key), and
so is an input named like one of the prefix's temporary files: exit code 2, nothing written.

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

The code: the command line and `main` here; the tokenizer files in `preprocess_tokenizers.py`,
a chunk of lines to token arrays (the workers' job) in `preprocess_encode.py`, the run that
writes the output in `preprocess_write.py`, the errors in `preprocess_errors.py`.
"""
from __future__ import annotations

import argparse
import sys

from rapidformer.data.preprocess_errors import Interrupted
from rapidformer.data.preprocess_tokenizers import BERT_EODS, TOKENIZER_TYPES
from rapidformer.data.preprocess_write import preprocess
from rapidformer.errors import InputError

PROG = "rapidformer-preprocess-data"


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
