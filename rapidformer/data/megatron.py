"""Pretraining data: Megatron mmap datasets (.bin/.idx) through megatron-core's dataset classes.

    bert = build_bert_datasets(prefix, tokenizer, "980,20", [1280, 640, 128], seq_length=512,
                               masked_lm_prob=0.15, short_seq_prob=0.1, seed=1234)
    gpt = build_gpt_datasets(prefix, tokenizer, "969,30,1", [...], seq_length=2048, seed=1234)

The samples come from megatron-core's `BERTMaskedWordPieceDataset` and `GPTDataset` (masking,
sentence pairing, document packing, shuffling and the index caches are theirs) and are handed
out under Hugging Face's names: BERT samples carry `input_ids, attention_mask, token_type_ids,
labels` (-100 where not masked) and `next_sentence_label`; GPT samples carry `input_ids`,
`labels` (already shifted, -100 where the loss is masked), `position_ids`, and `text` (the
seq_length + 1 tokens that the seed's Megatron-style forward steps slice themselves).

Every file is checked before megatron-core reads it, so a missing, corrupt or truncated file, an
empty dataset or data made with another vocabulary stops with one message saying what to do,
not with an assertion deep inside a worker.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rapidformer.data.indexed_writer import DTYPE_CODES, INDEX_HEADER
from rapidformer.errors import InputError, NotAvailableError

log = logging.getLogger("rapidformer")
# megatron-core's import warns that its optional fused kernels (Transformer Engine, Apex) are
# missing; its datasets do not use them
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
# its import and dataset builder log every step at INFO: quieted in rapidformer/__init__.py
# (a summary is logged here instead)

# the vocabulary check reads at most this many tokens of each file (a few hundred MB)
VOCAB_CHECK_TOKENS = 1 << 27
DATA_IMPLS = ("mmap", "infer")


@dataclass
class MegatronTokenizer:
    """What megatron-core's datasets read from a tokenizer, taken from a Hugging Face one.

    `pad` is left out on purpose: megatron-core then pads with -1, an id that cannot collide with
    a real token, and the padding is turned into Hugging Face's attention mask here.
    """

    vocab_size: int
    inv_vocab: dict = field(repr=False)
    eod: int | None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    hf_pad: int = 0
    name: str = ""
    hf: object = field(default=None, repr=False)  # the Hugging Face tokenizer, when built from one
    # tokens added after the vocabulary file's entries: Megatron-LM's BERT [BOS] and [EOS],
    # when the data holds their ids (data/pretraining_tokenizer.py), else none
    added: tuple = ()

    def tokenize(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        return self.hf.decode(ids)

    @classmethod
    def from_hf(cls, tokenizer, eod: int | None, added: tuple = ()) -> "MegatronTokenizer":
        vocab = tokenizer.get_vocab()
        digest = hashlib.sha256("\n".join(sorted(vocab)).encode()).hexdigest()[:16]
        # ordered by id: megatron-core draws BERT's random replacement tokens by position in
        # this dict, and a Rust tokenizer's vocab comes in hash order, other in every process
        inv_vocab = {i: t for t, i in sorted(vocab.items(), key=lambda item: item[1])}
        return cls(vocab_size=len(tokenizer), inv_vocab=inv_vocab,
                   eod=eod, cls=tokenizer.cls_token_id, sep=tokenizer.sep_token_id,
                   mask=tokenizer.mask_token_id, hf_pad=tokenizer.pad_token_id or 0,
                   name=f"{type(tokenizer).__name__}-{len(vocab)}-{digest}", hf=tokenizer,
                   added=tuple(added))

    @property
    def unique_identifiers(self) -> dict:
        # part of megatron-core's cache key: another vocabulary builds other index files
        return {"class": "rapidformer.MegatronTokenizer", "name": self.name}


def require_megatron_core() -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        raise NotAvailableError("pretraining data needs megatron-core, which is not installed: "
                                "pip install -e '.[megatron]' (or 'megatron-core>=0.16,<0.17')")


def check_data_impl(data_impl: str) -> None:
    if data_impl not in DATA_IMPLS:
        raise InputError(f"data.impl={data_impl}: megatron-core reads only the mmap format "
                         f"(the legacy 'lazy' and 'cached' formats are gone); regenerate the "
                         f"data with rapidformer-preprocess-data --dataset-impl mmap and use "
                         f"data.impl=mmap")


def _blend(data_path) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights) of `data.path`: one prefix, or Megatron's 'w1 prefix1 w2 prefix2'."""
    require_megatron_core()
    parts = data_path.split() if isinstance(data_path, str) else [str(p) for p in data_path]
    if not parts:
        raise InputError("data.path is empty: give the prefix that rapidformer-preprocess-data "
                         "printed, e.g. data.path=data/corpus_text_sentence")
    from megatron.core.datasets.utils import get_blend_from_list

    return get_blend_from_list(parts)


def _open_all(prefixes: list[str], vocab_size: int, skip_warmup: bool) -> list:
    """Every prefix's files checked (whole, this vocabulary), opened once, warmed if asked."""
    indexed = []
    for prefix in prefixes:
        indexed.append(open_indexed(prefix, vocab_size))
        if not skip_warmup:
            warm_up(prefix)
    return indexed


# the .idx layout after its header: version (u64), dtype code (u8), sequences (u64), documents
# (u64), then int32 lengths and int64 pointers per sequence and int64 document ends
_COUNTS = struct.Struct("<QBQQ")


def index_size_problem(idx: Path) -> str | None:
    """What is wrong with the size of a .idx file, from the counts its header gives; None when
    it is whole. Checked before megatron-core opens it: a half-made IndexedDataset fails again
    when it is collected, and prints a traceback after the message."""
    with open(idx, "rb") as f:
        f.seek(len(INDEX_HEADER))
        head = f.read(_COUNTS.size)
    if len(head) < _COUNTS.size:
        return f"{idx.stat().st_size} bytes, fewer than its header needs"
    _, _, sequences, documents = _COUNTS.unpack(head)
    expected = len(INDEX_HEADER) + _COUNTS.size + sequences * (4 + 8) + documents * 8
    actual = idx.stat().st_size
    if actual != expected:
        return (f"{actual:,} bytes, its header counts {sequences:,} sequences and {documents:,} "
                f"document ends: {expected:,} bytes")
    return None


def open_indexed(prefix: str, vocab_size: int | None = None):
    """megatron-core's IndexedDataset for `prefix`, after checking that the files are whole."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx, bin_):
        if not path.is_file():
            hint = f" (drop the '{Path(prefix).suffix}')" if Path(prefix).suffix in (".bin", ".idx") \
                else ""
            raise InputError(f"data.path={prefix}: {path} does not exist; give the prefix that "
                             f"rapidformer-preprocess-data printed, without .bin/.idx{hint}")
    with open(idx, "rb") as f:
        header = f.read(len(INDEX_HEADER))
    if header != INDEX_HEADER:
        raise InputError(f"{idx} is not a Megatron mmap index (its header is {header!r}, "
                         f"expected {INDEX_HEADER!r}); regenerate it with "
                         f"rapidformer-preprocess-data --dataset-impl mmap")
    if problem := index_size_problem(idx):
        raise InputError(f"{idx} is truncated or overwritten: {problem}; regenerate it with "
                         f"rapidformer-preprocess-data")
    try:
        dataset = IndexedDataset(prefix, mmap=True)
    except Exception as exc:  # struct/numpy/assert errors of a cut or overwritten index
        raise InputError(f"{idx} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                         f"regenerate it with rapidformer-preprocess-data") from exc
    if len(dataset) == 0:
        raise InputError(f"{prefix}.bin/.idx hold no documents; preprocess a non-empty corpus")
    itemsize = dataset.index.dtype_size
    expected = int(dataset.index.sequence_pointers[-1]) + int(dataset.index.sequence_lengths[-1]) \
        * itemsize
    actual = bin_.stat().st_size
    if actual != expected:
        state = "truncated" if actual < expected else "longer than its index says"
        raise InputError(f"{bin_} is {state}: {actual} bytes, its index describes {expected}; "
                         f"the .bin and .idx are not from the same run of "
                         f"rapidformer-preprocess-data — regenerate both")
    if vocab_size is not None:
        check_vocabulary(dataset, prefix, vocab_size)
    return dataset


# what was read of a file pair, by its version: a run's tokenizer, its vocabulary check and its
# plan each ask, and the answers cost a pass over the data
_READ: dict = {}


def _file_version(prefix: str) -> tuple | None:
    """The .bin/.idx pair's path, sizes, mtimes and inodes, or None where one is missing."""
    files = (Path(prefix + ".bin"), Path(prefix + ".idx"))
    try:
        stats = tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in (f.stat() for f in files))
    except OSError:
        return None
    return str(files[0].resolve()), stats


def largest_token(prefix: str, dtype=None) -> int | None:
    """The largest token id among the first VOCAB_CHECK_TOKENS of `prefix`.bin, or None for a
    file that is missing, empty or has no readable index (the checks in open_indexed say what is
    wrong with it). Read once per file version."""
    version = _file_version(prefix)
    if version is None:
        return None
    key = ("largest", version)
    if key not in _READ:
        dtype = dtype or _index_dtype(Path(prefix + ".idx"))
        if dtype is None or version[1][0][0] < np.dtype(dtype).itemsize:
            return None
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        _READ[key] = int(tokens[:VOCAB_CHECK_TOKENS].max())
    return _READ[key]


def _index_dtype(idx: Path):
    """The token dtype an .idx names (after its header and version), or None."""
    with open(idx, "rb") as f:
        head = f.read(len(INDEX_HEADER) + 9)
    if len(head) < len(INDEX_HEADER) + 9 or not head.startswith(INDEX_HEADER):
        return None
    codes = {code: dtype for dtype, code in DTYPE_CODES.items()}
    return codes.get(head[-1])


def only_at_document_ends(prefix: str, token: int, below: int) -> bool:
    """Whether, among the first VOCAB_CHECK_TOKENS of `prefix`.bin, every id of `below` or more
    is `token` and the last token of a document (an end-of-document id after the vocabulary),
    and there is one. False for a file whose .idx cannot be read (open_indexed says why). Read
    once per file version."""
    version = _file_version(prefix)
    if version is None:
        return False
    key = ("ends", version, token, below)
    if key not in _READ:
        _READ[key] = _only_at_document_ends(prefix, token, below)
    return _READ[key]


def _only_at_document_ends(prefix: str, token: int, below: int) -> bool:
    idx = Path(prefix + ".idx")
    dtype = _index_dtype(idx)
    if dtype is None:
        return False
    try:
        raw = np.memmap(idx, dtype=np.uint8, mode="r")  # a large corpus: read only what is used
        sequences, documents = (int(n) for n in raw[18:34].view("<u8"))
        at = 34
        lengths = raw[at:at + 4 * sequences].view("<i4")
        pointers = raw[at + 4 * sequences:at + 12 * sequences].view("<i8")
        ends = raw[at + 12 * sequences:at + 12 * sequences + 8 * documents].view("<i8")
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")[:VOCAB_CHECK_TOKENS]
    except (OSError, ValueError, IndexError):
        return False
    # each non-empty document's last sequence, and the position of its last token
    try:
        last = ends[1:][ends[1:] > ends[:-1]] - 1
        document_ends = pointers[last] // np.dtype(dtype).itemsize + lengths[last] - 1
    except IndexError:  # an index cut short
        return False
    where = np.flatnonzero(tokens >= below)
    return where.size > 0 and bool(np.all(tokens[where] == token)) and \
        bool(np.all(np.isin(where, document_ends)))


def check_vocabulary(dataset, prefix: str, vocab_size: int) -> None:
    """Token ids beyond the tokenizer's vocabulary mean the data was made with another one."""
    largest = largest_token(prefix, dataset.index.dtype)
    if largest is not None and largest >= vocab_size:
        raise InputError(f"{prefix}.bin holds token id {largest}, but the tokenizer has only "
                         f"{vocab_size} entries: the data was made with another vocabulary; "
                         f"pass the vocab/merge files that rapidformer-preprocess-data used "
                         f"(model.tokenizer, model.merge_file, model.tokenizer_type)")


def warm_up(prefix: str) -> None:
    """Read the .bin once so its pages are cached (the seed's --mmap-warmup)."""
    with open(prefix + ".bin", "rb") as f:
        while f.read(64 << 20):
            pass


@contextlib.contextmanager
def _process_group():
    """megatron-core's dataset builders ask torch.distributed for the rank (rank 0 builds the
    index caches, the others wait and load them); a single-process run lends them a group of one
    for the build."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_tokenizer(tokenizer: MegatronTokenizer, bert: bool) -> None:
    """What the task's samples need of the tokenizer: BERT's [CLS], [SEP] and [MASK], GPT's
    end-of-document token."""
    if bert and None in (tokenizer.cls, tokenizer.sep, tokenizer.mask):
        raise InputError("BERT pretraining needs a WordPiece tokenizer with [CLS], [SEP] and "
                         "[MASK]; use model.tokenizer_type=BertWordPieceLowerCase (or Case) with "
                         "the vocab.txt the data was made with")
    if not bert and tokenizer.eod is None:
        raise InputError("GPT pretraining needs an end-of-document token; the tokenizer has "
                         "none (GPT-2 vocabularies have <|endoftext|>)")


def check_sentences(prefix: str, dataset) -> None:
    """Next-sentence prediction pairs sentences of one document: data with one sequence per
    document (preprocessed without --split-sentences) has no pair to make."""
    if not np.any(np.diff(dataset.document_indices) > 1):
        raise InputError(f"{prefix} has one sentence per document (preprocessed without "
                         f"--split-sentences), but next-sentence prediction pairs sentences of "
                         f"a document: preprocess with --split-sentences (a '_sentence' "
                         f"prefix), or train masked LM alone with task.binary_head=false (the "
                         f"seed's --bert-no-binary-head)")


def checked_data(data_path, tokenizer: MegatronTokenizer, bert: bool, binary_head: bool = True,
                 skip_warmup: bool = True) -> tuple[tuple, list]:
    """(blend, opened datasets) of data.path after every check that needs no index built: the
    tokenizer has what the task needs, each prefix's files are whole and of this vocabulary,
    and BERT's next-sentence prediction has sentences to pair. What the refusal pass asks
    before a run starts, and the dataset builders again."""
    check_tokenizer(tokenizer, bert)
    blend = _blend(data_path)
    indexed = _open_all(blend[0], tokenizer.vocab_size, skip_warmup)
    if bert and binary_head:
        for prefix, dataset in zip(blend[0], indexed):
            check_sentences(prefix, dataset)
    return blend, indexed


def documents_of(indexed: list, bert: bool) -> int:
    """The documents data.split divides, as megatron-core counts them (BERT: documents, GPT:
    sequences, one per document); a blend's smallest prefix's."""
    if bert:
        from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset as cls
    else:
        from megatron.core.datasets.gpt_dataset import GPTDataset as cls
    return min(cls.numel_low_level_dataset(dataset) for dataset in indexed)


def no_training_documents(split: str, documents: int) -> str:
    return (f"data.split={split} leaves no training documents out of {documents}; give the "
            f"training split a larger share or add data")


def no_whole_document(split: str, name: str, share: float, documents: int | None) -> str:
    """An evaluated split (validation, test) whose share of data.split holds no document."""
    counted = f" of its {documents} documents" if documents else ""
    return (f"data.split={split} gives the {name} split {share:.2%} of data.path's documents, "
            f"which is not one whole document{counted}: every {name} evaluation would score "
            f"nothing. Give it a larger share (or add documents), or a share of 0 (or "
            f"trainer.eval_iters=0) to train without it")


def split_problems(split: str, documents: int, eval_iters: int) -> list[str]:
    """What the dataset builders and the pretraining tasks refuse in data.split for data of
    `documents`: no training document, or an evaluated split that is no whole document."""
    from rapidformer.config.splits import parse_split
    from rapidformer.data.splits import split_ranges

    ranges, shares = split_ranges(split, documents), parse_split(split)
    if ranges[0] is None:
        return [no_training_documents(split, documents)]
    return [no_whole_document(split, name, shares[index], documents)
            for index, name in ((1, "validation"), (2, "test"))
            if ranges[index] is None and shares[index] > 0 and eval_iters > 0]


def _build(dataset_cls, config, indexed: list, sizes: list[int]):
    """The three splits; an empty split (no documents or no samples asked) is None."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder

    documents = min(dataset_cls.numel_low_level_dataset(dataset) for dataset in indexed)
    for i, bookends in enumerate(config.split_matrix):
        if bookends is None:
            continue
        begin, end = (int(round(b * float(documents))) for b in bookends)
        if end <= begin or not sizes[i]:
            config.split_matrix[i] = None
    if config.split_matrix[0] is None:
        raise InputError(no_training_documents(config.split, documents))
    with _process_group():
        splits = BlendedMegatronDatasetBuilder(dataset_cls, [s or None for s in sizes],
                                               lambda: True, config).build()
    log.info("%s from %d documents, split %s: %s samples (train/valid/test); index cache %s",
             dataset_cls.__name__, documents, config.split,
             "/".join(str(len(d)) if d is not None else "-" for d in splits),
             config.path_to_cache or "beside the data")
    return splits


def build_bert_datasets(data_path, tokenizer: MegatronTokenizer, splits_string: str,
                        num_samples: list[int], seq_length: int, masked_lm_prob: float,
                        short_seq_prob: float, seed: int, binary_head: bool = True,
                        skip_warmup: bool = True, path_to_cache=None):
    """(train, valid, test) BERT datasets of Hugging Face-keyed samples; a missing split is None."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    from rapidformer.data.bert_masking import FastMaskingBERTDataset

    if not 0 < masked_lm_prob < 1:
        raise InputError(f"mask_prob={masked_lm_prob} must be in (0, 1), e.g. 0.15")
    if not 0 <= short_seq_prob <= 1:
        raise InputError(f"short_seq_prob={short_seq_prob} must be in [0, 1], e.g. 0.1")
    blend, indexed = checked_data(data_path, tokenizer, bert=True, binary_head=binary_head,
                                  skip_warmup=skip_warmup)
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend,
        split=splits_string, path_to_cache=None if path_to_cache is None else str(path_to_cache), tokenizer=tokenizer,
        masking_probability=masked_lm_prob, short_sequence_probability=short_seq_prob,
        # Megatron-LM's pretrain_bert.py settings
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=binary_head)
    # megatron-core's samples, their masking computed faster (data/bert_masking.py)
    splits = _build(FastMaskingBERTDataset, config, indexed, num_samples)
    return tuple(None if d is None else BertSamples(d, tokenizer.hf_pad) for d in splits)


def build_gpt_datasets(data_path, tokenizer: MegatronTokenizer, splits_string: str,
                       num_samples: list[int], seq_length: int, seed: int,
                       eod_mask_loss: bool = False, reset_position_ids: bool = False,
                       skip_warmup: bool = True, path_to_cache=None):
    """(train, valid, test) GPT datasets of seq_length-token samples; a missing split is None."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    blend, indexed = checked_data(data_path, tokenizer, bert=False, skip_warmup=skip_warmup)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend,
        split=splits_string, path_to_cache=None if path_to_cache is None else str(path_to_cache), tokenizer=tokenizer,
        reset_position_ids=reset_position_ids, reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss, create_attention_mask=False)
    splits = _build(GPTDataset, config, indexed, num_samples)
    return tuple(None if d is None else GPTSamples(d) for d in splits)


class BertSamples(torch.utils.data.Dataset):
    """megatron-core BERT samples under Hugging Face's keys (BertForPreTraining's inputs)."""

    def __init__(self, dataset, hf_pad: int):
        self.dataset, self.hf_pad = dataset, hf_pad

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        s = self.dataset[idx]
        real = s["padding_mask"] == 1  # megatron-core marks padding with its pad id, -1
        return {
            "input_ids": torch.from_numpy(np.where(real, s["text"], self.hf_pad)),
            "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "token_type_ids": torch.from_numpy(np.where(real, s["types"], 0)),
            "labels": torch.from_numpy(np.where(s["loss_mask"] == 1, s["labels"], -100)),
            "next_sentence_label": torch.tensor(int(s["is_random"])),
        }


class GPTSamples(torch.utils.data.Dataset):
    """megatron-core GPT samples: inputs, shifted labels masked to -100, positions, raw text."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        s = self.dataset[idx]
        tokens, labels = s["tokens"], s["labels"]
        return {
            "input_ids": tokens,
            "labels": torch.where(s["loss_mask"] > 0, labels, torch.full_like(labels, -100)),
            "position_ids": s["position_ids"],
            "text": torch.cat([tokens, labels[-1:]]),
        }
