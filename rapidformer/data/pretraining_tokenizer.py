"""The pretraining tokenizer of a run: built once per process from model.tokenizer_type,
model.tokenizer (the vocab file, or a tokenizer directory for HuggingFaceTokenizer) and
model.merge_file — the same files and types that rapidformer-preprocess-data takes, so training
reads the data with the vocabulary that wrote it.

BERT WordPiece data comes in two end-of-document conventions, and the tokenizer follows the data
(`data_path`, the run's data.path): Megatron-LM's BERT tokenizer adds `[BOS]` and `[EOS]` after
the vocab.txt's V entries and ends documents with `[EOS]` (id V + 1; preprocess_data's default,
`--bert-eod eos`), while `[SEP]` (`--bert-eod sep`, and this project's files before the option
existed) stays within the V entries. Data whose ids at V or above are all V + 1, each the last
token of a document, gets a tokenizer of V + 2 entries with `[BOS]` and `[EOS]` added as Megatron has them, so the model's
embeddings cover them and the export's tokenizer has them; data that holds none (a `[SEP]`
convention, or no end of document at all, as Megatron's BERT recipe makes it) keeps the V
entries, and with them the model shape, the masking's random replacement tokens and the
checkpoints of runs made before.
"""
from __future__ import annotations

import logging
from pathlib import Path

from rapidformer.config.schema import ModelConfig
from rapidformer.data.megatron import (MegatronTokenizer, largest_token,
                                       only_at_document_ends)
from rapidformer.data.preprocess_errors import PreprocessError
from rapidformer.data.preprocess_tokenizers import (MEGATRON_BERT_ADDED, build_tokenizer,
                                                    megatron_bert_added)
from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
_CACHE: dict = {}
_PLAIN: dict = {}


def load_pretraining_tokenizer(m: ModelConfig, data_path=None) -> MegatronTokenizer:
    """The run's tokenizer; `data_path` (data.path: a prefix, Megatron's 'w1 p1 w2 p2' blend or
    a list) decides a BERT vocabulary's end-of-document entries, from the files that exist."""
    if not m.tokenizer_type:
        raise InputError("pretraining needs the tokenizer its data was made with: set "
                         "model.tokenizer_type (BertWordPieceLowerCase, BertWordPieceCase, "
                         "GPT2BPETokenizer or HuggingFaceTokenizer) and model.tokenizer")
    plain = _plain(m)
    found = _megatron_ids_in(plain, data_path) \
        if m.tokenizer_type.startswith("BertWordPiece") else None
    key = (m.tokenizer_type, m.tokenizer, m.merge_file, found is not None)
    if key not in _CACHE:
        hf, eod, size = plain
        added: tuple = ()
        if found is not None:
            hf, eod, added = _with_megatron_bert_tokens(_build(m)[0])
            log.info("%s ends documents with id %d, past the %d entries of %s: Megatron-LM's "
                     "BERT [EOS], which its tokenizer adds after them with [BOS] (id %d); the "
                     "model gets %d embeddings (data made with --bert-eod sep keeps %d)",
                     found[0], eod, size, m.tokenizer, hf.bos_token_id, len(hf), size)
        _CACHE[key] = MegatronTokenizer.from_hf(hf, eod, added)
    return _CACHE[key]


def _plain(m: ModelConfig):
    """(tokenizer, eod, size) of the files as they are; shared, so never modified."""
    key = (m.tokenizer_type, m.tokenizer, m.merge_file)
    if key not in _PLAIN:
        _PLAIN[key] = _build(m)
    return _PLAIN[key]


def _build(m: ModelConfig):
    directory = m.tokenizer if m.tokenizer_type == "HuggingFaceTokenizer" else None
    try:
        return build_tokenizer(m.tokenizer_type, m.tokenizer, m.merge_file, directory)
    except PreprocessError as exc:
        raise InputError(f"{exc} (config keys: model.tokenizer is --vocab-file or the "
                         f"tokenizer directory, model.merge_file is --merge-file)") from exc


def data_prefixes(data_path) -> list[str]:
    """The prefixes of data.path whose .bin exists (the weights of a blend have none)."""
    if not data_path:
        return []
    parts = data_path.split() if isinstance(data_path, str) else [str(p) for p in data_path]
    return [p for p in parts if Path(p + ".bin").is_file()]


def _megatron_ids_in(plain, data_path) -> tuple[str, int] | None:
    """(prefix, [EOS] id) of the first file of data.path that ends documents with Megatron's
    [EOS], the id after the vocab.txt's entries and [BOS], or None. Ids past the entries used
    otherwise (anywhere else, or any other id) are another vocabulary: the data check says so."""
    hf, _, size = plain
    ids, extended = megatron_bert_added(hf.get_vocab())
    eos = ids["[EOS]"]
    if extended == size:  # the vocab.txt has [BOS] and [EOS] itself
        return None
    for prefix in data_prefixes(data_path):
        largest = largest_token(prefix)
        if largest == eos and only_at_document_ends(prefix, eos, size):
            return prefix, eos
    return None


def _with_megatron_bert_tokens(hf):
    """The tokenizer with [BOS] and [EOS] at Megatron's ids (V and V + 1, in that order), as
    special tokens, so that `len()` counts them and a saved tokenizer has them; its encoding of
    text is unchanged. Returns (tokenizer, eod, the tokens added)."""
    ids, _ = megatron_bert_added(hf.get_vocab())
    missing = tuple(t for t in MEGATRON_BERT_ADDED if t not in hf.get_vocab())
    hf.add_special_tokens({"bos_token": "[BOS]", "eos_token": "[EOS]"})
    got = {t: hf.convert_tokens_to_ids(t) for t in MEGATRON_BERT_ADDED}
    if got != ids:  # a guard: the model's embeddings and the data must agree on these ids
        raise InputError(f"the tokenizer gave {got} to Megatron's BERT tokens, which the data "
                         f"has as {ids}")
    return hf, ids["[EOS]"], missing


def check_pretrained_vocabulary(m, tokenizer) -> None:
    """A pretrained model's embeddings cover the pretraining tokenizer's ids (its config.json
    read, local or cached; a model that cannot be read is its loading's to refuse)."""
    from transformers import AutoConfig

    try:
        size = AutoConfig.from_pretrained(m.name_or_path).vocab_size
    except (OSError, ValueError):
        return  # the model's own loading says why
    if problem := vocabulary_problem(m, size, tokenizer):
        raise InputError(problem)


def vocabulary_problem(m, size: int, tokenizer) -> str | None:
    """Why a pretrained model of `size` embeddings cannot read the tokenizer's ids, or None. A
    pretrained BERT's embeddings end at its vocab.txt; data that ends documents with Megatron's
    [EOS] (an id past them) cannot train it: say which option makes data it can."""
    if size >= tokenizer.vocab_size:
        return None
    if tokenizer.added:
        return (f"model {m.name_or_path} has {size} embeddings, but data.path ends documents "
                f"with Megatron's [EOS] (id {tokenizer.eod}), which {m.tokenizer} does not have "
                f"(the tokenizer adds {' and '.join(tokenizer.added)}: {tokenizer.vocab_size} "
                f"entries); preprocess the data again with --bert-eod sep (or without "
                f"--append-eod), or train a model built from the config (model=bert_base)")
    return (f"model {m.name_or_path} has {size} embeddings but the tokenizer has "
            f"{tokenizer.vocab_size} tokens; use the model's own vocabulary for the data "
            f"(model.tokenizer)")
